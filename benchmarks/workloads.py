"""The jobs that benchmarks/bench_launch.py and bench_session.py run, as source text.

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

The torch.distributed workloads (``TORCH_*``) are the same jobs for ``%%torchrun``,
torchrun and both TorchDistributors, run literally unchanged by each: as the body of a
``%%torchrun`` cell, as the script torchrun runs, and exec'd by ``run_source`` (the
function both TorchDistributors run). Only rank 0's value comes back from a
TorchDistributor, so every rank's RESULT is gathered into RESULTS (after the last stamp,
outside what is timed), and every launcher reports rank 0's RESULTS. Their ``imported``
stamp is after ``import torch, torch.distributed`` and ``init`` after
``init_process_group("gloo")``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from string import Template

from benchmarks import _common

# The stamps every workload's RESULT holds (see above), in the order a rank passes them.
STAMPS = ("proc_start", "first", "imported", "init", "done")

# The rank-side /proc readers, as source: the process's start time (without psutil, whose
# import would be timed too) and a thread's CPU time.
_RANK_HELPERS = "\n" + inspect.getsource(_common.proc_start_time) + "\n" + inspect.getsource(_common.thread_cpu)

# How each framework spells the steps every workload shares.
_HOROVOD = {"imports": "import horovod.torch as hvd", "init": "hvd.init()", "rank": "hvd.rank()",
            "size": "hvd.size()"}
_TORCH = {"imports": "import torch.distributed as _dist", "init": '_dist.init_process_group("gloo")',
          "rank": "_dist.get_rank()", "size": "_dist.get_world_size()"}

# Every workload: the stamps around the imports, the init and the job, then RESULT.
_FRAME = Template('''\
import time as _time
_t_first = _time.time()
import torch
$imports
_t_imported = _time.time()
$init
_t_init = _time.time()
$job
_t_done = _time.time()
$helpers
$measure
RESULT = {"rank": $rank, "size": $size, $fields
          "proc_start": proc_start_time(), "first": _t_first, "imported": _t_imported, "init": _t_init, "done": _t_done}
$tail''')


def _workload(framework: dict, job: str, fields: str, imports: str = "", measure: str = "", tail: str = "") -> str:
    return _FRAME.substitute(framework, imports=framework["imports"] + imports, job=job, fields=fields,
                             helpers=_RANK_HELPERS, measure=measure, tail=tail)


# The training job: an MLP on random data, batch 64, the two reporting calls every step;
# samples/s and CPU time over the loop only, after the warm-up steps.
_MLP = ("torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), "
        "torch.nn.ReLU(), torch.nn.Linear(512, 10))")
_TRAIN_LOOP = '''
STEPS, WARMUP, BATCH = $steps, $warmup, $batch
torch.manual_seed(0)
$model
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
    # Outside an hvdmagic run (horovodrun, torchrun, pyspark's TorchDistributor) these two calls are no-ops.
    hvdmagic.progress(step + 1, total=WARMUP + STEPS, desc="train")
    hvdmagic.log_metrics(step=step, loss=loss.item())
_loop_s = _time.perf_counter() - _t_loop
_loop_cpu = _time.process_time() - _c_loop'''
_TRAIN_MEASURE = '''
# hvdmagic's background flusher (None outside an hvdmagic run): its CPU over the whole run.
import hvdmagic.rank.telemetry as _telemetry
_flusher = getattr(_telemetry, "_flusher", None)
_flusher_cpu = thread_cpu(getattr(_flusher, "native_id", None))
import os as _os'''
_TRAIN_FIELDS = ('"steps": STEPS, "batch": BATCH, "loop_s": _loop_s, "loop_cpu_s": _loop_cpu, '
                 '"samples_per_s": STEPS * BATCH / _loop_s, "cpu_ms_per_step": 1000 * _loop_cpu / STEPS, '
                 '"flusher_cpu_s": _flusher_cpu, "torch_threads": torch.get_num_threads(), '
                 '"omp_num_threads": _os.environ.get("OMP_NUM_THREADS"), ')


def _train(framework: dict, model: str, imports: str = "", tail: str = "") -> Template:
    """A training workload, with $steps, $warmup and $batch still to fill in."""
    loop = Template(_TRAIN_LOOP).safe_substitute(model=model)
    return Template(_workload(framework, loop, _TRAIN_FIELDS, imports + "\nimport hvdmagic", _TRAIN_MEASURE, tail))


TRIVIAL = _workload(_HOROVOD, "_value = hvd.allreduce(torch.tensor(1.0), op=hvd.Sum).item()", '"value": _value, ')
TRAIN = _train(_HOROVOD, f"model = {_MLP}\n"
               "opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),\n"
               "                               named_parameters=model.named_parameters())\n"
               "hvd.broadcast_parameters(model.state_dict(), root_rank=0)")

# What horovodrun's script adds: every rank writes RESULT to <dir>/rank<r>.json.
SCRIPT_TRAILER = '''
import json as _json, sys as _sys
with open(_sys.argv[1] + "/rank%d.json" % RESULT["rank"], "w") as _f:
    _json.dump(RESULT, _f)
'''

_TORCH_GATHER = '''
RESULTS = [None] * _dist.get_world_size()
_dist.all_gather_object(RESULTS, RESULT)
'''
TORCH_TRIVIAL = _workload(_TORCH, "_t = torch.tensor(1.0)\n_dist.all_reduce(_t)\n_value = _t.item()",
                          '"value": _value, ', tail=_TORCH_GATHER + "_dist.destroy_process_group()\n")
# TRAIN's step (the same model, data, batch and optimizer), with DDP averaging the gradients
# instead of hvd.DistributedOptimizer. No destroy_process_group() at its end: after DDP,
# destroying the group made about 1 in 10 torchrun workers abort at interpreter exit, after
# the script's last line (torch 2.13.0, "terminate called without an active exception",
# SIGABRT; 8 of 67 runs, with or without deleting the model first; 0 of 23 without
# destroying). hvdmagic's ranks leave with os._exit and never reach that teardown.
TORCH_TRAIN = _train(_TORCH, f"model = _DDP({_MLP})\nopt = torch.optim.SGD(model.parameters(), lr=0.01)",
                     "\nfrom torch.nn.parallel import DistributedDataParallel as _DDP", tail=_TORCH_GATHER)

# What torchrun's script adds: rank 0 writes RESULTS (every rank's RESULT) to <dir>/results.json.
TORCH_SCRIPT_TRAILER = '''
import json as _json, sys as _sys
if RESULT["rank"] == 0:
    with open(_sys.argv[1] + "/results.json", "w") as _f:
        _json.dump(RESULTS, _f)
'''


@dataclass(frozen=True)
class Launchers:
    """How one framework's launchers take a workload: as a cell, and as a script."""

    train_source: Template
    magic: str  # the cell magic
    value: str  # the cell's value: RESULT (rank 0's; every rank's is in last_run().results) or RESULTS
    trailer: str  # what the script adds to write the results

    def train(self, steps: int, warmup: int = 20, batch: int = 64) -> str:
        return self.train_source.substitute(steps=steps, warmup=warmup, batch=batch)

    def cell(self, np: int, body: str) -> str:
        return f"{self.magic} --np {np}\n{body}{self.value}\n"

    def script(self, body: str) -> str:
        """The same body, then the results written to the directory in argv[1]."""
        return body + self.trailer


HOROVOD = Launchers(TRAIN, "%%horovod", "RESULT", SCRIPT_TRAILER)
TORCH = Launchers(TORCH_TRAIN, "%%torchrun", "RESULTS", TORCH_SCRIPT_TRAILER)
train, cell, script = HOROVOD.train, HOROVOD.cell, HOROVOD.script
torch_train, torch_cell, torch_script = TORCH.train, TORCH.cell, TORCH.script


def run_source(source: str) -> list:
    """What a TorchDistributor runs: ``source`` (a torch workload) as a module body; its RESULTS."""
    namespace = {"__name__": "__bench_workload__"}
    exec(compile(source, "<bench-workload>", "exec"), namespace)
    return namespace["RESULTS"]


# TorchDistributor(...).run in bench_launch's part 1 runs a function, not a script: the
# equivalent trivial job with torch.distributed (gloo), which is what TorchDistributor sets up for.
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


__all__ = ["HOROVOD", "STAMPS", "TORCH", "TORCH_TRAIN", "TORCH_TRIVIAL", "TRAIN", "TRIVIAL", "cell", "run_source",
           "script", "torch_cell", "torch_distributed_trivial", "torch_script", "torch_train", "train"]
