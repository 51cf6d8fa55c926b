"""The jobs that benchmarks/bench_launch.py runs, as source text.

Each workload is one piece of Python source. It is the body of a ``%%horovod``
cell *and*, with a two-line trailer, the script that ``horovodrun`` runs, so the
compared systems execute literally the same code. Every workload leaves a dict in
the variable ``RESULT`` with wall-clock stamps (``time.time()``: the driver and
the ranks share this machine's clock) and its measurements.

The stamps, in the order a rank passes them:

* ``proc_start``: when the rank's process was created (from ``/proc/self/stat``,
  10 ms resolution), i.e. when its interpreter started;
* ``first``: the first statement of user code;
* ``imported``: after ``import torch, horovod.torch``;
* ``init``: after ``hvd.init()`` (Gloo rendezvous with the other ranks);
* ``done``: after the job (one allreduce, or the training loop).
"""

from __future__ import annotations

import inspect

from benchmarks import _common

# The stamps every workload's RESULT holds (see above), in the order a rank passes them.
STAMPS = ("proc_start", "first", "imported", "init", "done")

# The rank-side /proc readers, as source: the process's start time (without psutil, whose
# import would be timed too) and a thread's CPU time.
_RANK_HELPERS = "\n" + inspect.getsource(_common.proc_start_time) + "\n" + inspect.getsource(_common.thread_cpu)

TRIVIAL = '''\
import time as _time
_t_first = _time.time()
import torch
import horovod.torch as hvd
_t_imported = _time.time()
hvd.init()
_t_init = _time.time()
_value = hvd.allreduce(torch.tensor(1.0), op=hvd.Sum).item()
_t_done = _time.time()
''' + _RANK_HELPERS + '''
RESULT = {"rank": hvd.rank(), "size": hvd.size(), "value": _value, "proc_start": proc_start_time(),
          "first": _t_first, "imported": _t_imported, "init": _t_init, "done": _t_done}
'''

TRAIN = '''\
import time as _time
_t_first = _time.time()
import torch
import horovod.torch as hvd
import hvdmagic
_t_imported = _time.time()
hvd.init()
_t_init = _time.time()

STEPS, WARMUP, BATCH = {steps}, {warmup}, {batch}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                            torch.nn.ReLU(), torch.nn.Linear(512, 10))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
X = torch.randn(1024, 256)
Y = torch.randint(0, 10, (1024,))
for step in range(WARMUP + STEPS):
    if step == WARMUP:
        _t_loop = _time.perf_counter()
        _c_loop = _time.process_time()
    i = (step * BATCH) % 1024
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(X[i:i + BATCH]), Y[i:i + BATCH])
    loss.backward()
    opt.step()
    # Under horovodrun (no event pipe) these two calls are no-ops.
    hvdmagic.progress(step + 1, total=WARMUP + STEPS, desc="train")
    hvdmagic.log_metrics(step=step, loss=loss.item())
_loop_s = _time.perf_counter() - _t_loop
_loop_cpu = _time.process_time() - _c_loop
_t_done = _time.time()

{helpers}

# hvdmagic's background flusher (None outside a %%horovod run): its CPU over the whole run.
import hvdmagic.rank.report as _report
_flusher = getattr(_report, "_flusher", None)
_flusher_cpu = thread_cpu(getattr(_flusher, "native_id", None))
import os as _os
RESULT = {{"rank": hvd.rank(), "size": hvd.size(), "steps": STEPS, "batch": BATCH,
          "loop_s": _loop_s, "loop_cpu_s": _loop_cpu, "samples_per_s": STEPS * BATCH / _loop_s,
          "cpu_ms_per_step": 1000 * _loop_cpu / STEPS, "flusher_cpu_s": _flusher_cpu,
          "torch_threads": torch.get_num_threads(), "omp_num_threads": _os.environ.get("OMP_NUM_THREADS"),
          "proc_start": proc_start_time(), "first": _t_first, "imported": _t_imported, "init": _t_init,
          "done": _t_done}}
'''

# What horovodrun's script adds: every rank writes RESULT to <dir>/rank<r>.json.
SCRIPT_TRAILER = '''
import json as _json, sys as _sys
with open(_sys.argv[1] + "/rank%d.json" % RESULT["rank"], "w") as _f:
    _json.dump(RESULT, _f)
'''


def trivial() -> str:
    return TRIVIAL


def train(steps: int, warmup: int = 20, batch: int = 64) -> str:
    return TRAIN.format(steps=steps, warmup=warmup, batch=batch, helpers=_RANK_HELPERS)


def cell(np: int, body: str) -> str:
    """A %%horovod cell whose value (rank 0's) is RESULT; every rank's is in last_run().results."""
    return f"%%horovod --np {np}\n{body}RESULT\n"


def script(body: str) -> str:
    """The horovodrun script: the same body, then RESULT written to the directory in argv[1]."""
    return body + SCRIPT_TRAILER


# TorchDistributor runs a function, not a script: the equivalent trivial job with
# torch.distributed (gloo), which is what TorchDistributor sets up for.
def torch_distributed_trivial():
    import time as _time
    first = _time.time()
    import torch
    import torch.distributed as dist
    imported = _time.time()
    dist.init_process_group("gloo")
    init = _time.time()
    t = torch.tensor(1.0)
    dist.all_reduce(t)
    done = _time.time()
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {"rank": rank, "value": t.item(), "first": first, "imported": imported, "init": init, "done": done}


# ---------------------------------------------------------------------------
# torch.distributed: the same jobs for %%torchrun, torchrun, and both TorchDistributors
# ---------------------------------------------------------------------------
#
# One source text per job again, run literally unchanged by every torch launcher: as the
# body of a %%torchrun cell, as the script torchrun runs, and exec'd by ``run_source``
# (the function both TorchDistributors run). Only rank 0's value comes back from a
# TorchDistributor, so every rank's RESULT is gathered into RESULTS (after the last stamp,
# outside what is timed), and every launcher reports rank 0's RESULTS.
# The stamps are those above, with ``imported`` after ``import torch, torch.distributed``
# and ``init`` after ``init_process_group("gloo")``.

_TORCH_GATHER = '''
RESULTS = [None] * _dist.get_world_size()
_dist.all_gather_object(RESULTS, RESULT)
'''
_TORCH_DESTROY = '''_dist.destroy_process_group()
'''

TORCH_TRIVIAL = '''\
import time as _time
_t_first = _time.time()
import torch
import torch.distributed as _dist
_t_imported = _time.time()
_dist.init_process_group("gloo")
_t_init = _time.time()
_t = torch.tensor(1.0)
_dist.all_reduce(_t)
_value = _t.item()
_t_done = _time.time()
''' + _RANK_HELPERS + '''
RESULT = {"rank": _dist.get_rank(), "size": _dist.get_world_size(), "value": _value, "proc_start": proc_start_time(),
          "first": _t_first, "imported": _t_imported, "init": _t_init, "done": _t_done}
''' + _TORCH_GATHER + _TORCH_DESTROY

# TRAIN's step (the same model, data, batch and optimizer), with DDP averaging the
# gradients instead of hvd.DistributedOptimizer, and the same two reporting calls.
TORCH_TRAIN = '''\
import time as _time
_t_first = _time.time()
import torch
import torch.distributed as _dist
from torch.nn.parallel import DistributedDataParallel as _DDP
import hvdmagic
_t_imported = _time.time()
_dist.init_process_group("gloo")
_t_init = _time.time()

STEPS, WARMUP, BATCH = {steps}, {warmup}, {batch}
torch.manual_seed(0)
model = _DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                 torch.nn.ReLU(), torch.nn.Linear(512, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X = torch.randn(1024, 256)
Y = torch.randint(0, 10, (1024,))
for step in range(WARMUP + STEPS):
    if step == WARMUP:
        _t_loop = _time.perf_counter()
        _c_loop = _time.process_time()
    i = (step * BATCH) % 1024
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(X[i:i + BATCH]), Y[i:i + BATCH])
    loss.backward()
    opt.step()
    # Outside an hvdmagic run (torchrun, pyspark's TorchDistributor) these two calls are no-ops.
    hvdmagic.progress(step + 1, total=WARMUP + STEPS, desc="train")
    hvdmagic.log_metrics(step=step, loss=loss.item())
_loop_s = _time.perf_counter() - _t_loop
_loop_cpu = _time.process_time() - _c_loop
_t_done = _time.time()

{helpers}

import hvdmagic.rank.report as _report
_flusher = getattr(_report, "_flusher", None)
_flusher_cpu = thread_cpu(getattr(_flusher, "native_id", None))
import os as _os
RESULT = {{"rank": _dist.get_rank(), "size": _dist.get_world_size(), "steps": STEPS, "batch": BATCH,
          "loop_s": _loop_s, "loop_cpu_s": _loop_cpu, "samples_per_s": STEPS * BATCH / _loop_s,
          "cpu_ms_per_step": 1000 * _loop_cpu / STEPS, "flusher_cpu_s": _flusher_cpu,
          "torch_threads": torch.get_num_threads(), "omp_num_threads": _os.environ.get("OMP_NUM_THREADS"),
          "proc_start": proc_start_time(), "first": _t_first, "imported": _t_imported, "init": _t_init,
          "done": _t_done}}
# No destroy_process_group() here: after DDP, destroying the group made about 1 in 10 torchrun
# workers abort at interpreter exit, after the script's last line (torch 2.13.0, "terminate called
# without an active exception", SIGABRT; 8 of 67 runs, with or without deleting the model first;
# 0 of 23 without destroying). hvdmagic's ranks leave with os._exit and never reach that teardown.
{gather}'''

# What torchrun's script adds: rank 0 writes RESULTS (every rank's RESULT) to <dir>/results.json.
TORCH_SCRIPT_TRAILER = '''
import json as _json, sys as _sys
if RESULT["rank"] == 0:
    with open(_sys.argv[1] + "/results.json", "w") as _f:
        _json.dump(RESULTS, _f)
'''


def torch_trivial() -> str:
    return TORCH_TRIVIAL


def torch_train(steps: int, warmup: int = 20, batch: int = 64) -> str:
    return TORCH_TRAIN.format(steps=steps, warmup=warmup, batch=batch, helpers=_RANK_HELPERS, gather=_TORCH_GATHER)


def torch_cell(np: int, body: str) -> str:
    """A %%torchrun cell whose value (rank 0's) is RESULTS, every rank's RESULT."""
    return f"%%torchrun --np {np}\n{body}RESULTS\n"


def torch_script(body: str) -> str:
    """The torchrun script: the same body, then rank 0 writes RESULTS to the directory in argv[1]."""
    return body + TORCH_SCRIPT_TRAILER


def run_source(source: str) -> list:
    """What a TorchDistributor runs: ``source`` (a torch workload) as a module body; its RESULTS."""
    namespace = {"__name__": "__bench_workload__"}
    exec(compile(source, "<bench-workload>", "exec"), namespace)
    return namespace["RESULTS"]


__all__ = ["cell", "run_source", "script", "torch_cell", "torch_distributed_trivial", "torch_script",
           "torch_train", "torch_trivial", "train", "trivial"]
