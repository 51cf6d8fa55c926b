#!/usr/bin/env python
"""Many ranks on many hosts: what the kernel spends to launch and follow 128 ranks on 16 hosts,
and whether a failing rank among them is still named.

One command, from the repository root, as root (it makes network namespaces):

    .venv/bin/python benchmarks/bench_many_hosts.py --hosts 16 --per-host 8

It prints its tables and writes every figure to ``artifacts/bench_many_hosts.json``.

The set-up: ``--hosts`` simulated hosts (tests/netns.py: network namespaces on one bridge,
links uncapped), a standalone Spark cluster with one worker of ``--per-host`` cores on each,
and one Jupyter kernel (jupyter_client, widgets on, as in JupyterLab) whose SparkSession runs
on that cluster, its driver on the bridge. Every rank of every host runs on this machine's 2
cores, so wall times are the 2 cores', while the kernel's own CPU (``resource.getrusage``
in the kernel: its threads, not the ranks' or the executors' processes) is what a real
cluster's notebook machine would spend.

Parts, each in the same kernel:

- **launch**: a trivial ``%%horovod --np N`` cell (``os.environ["HOROVOD_RANK"]``, no
  framework) at N = hosts, half the slots and all of them (``--launch-sizes``). For each: the
  wall time from request to idle, the stages the run record names, and the kernel's CPU
  seconds; then the kernel's CPU per rank as the slope between sizes.
- **report**: N = all slots, each rank an ``hvdmagic.track`` loop of 20 ms steps for
  ``--seconds``, with ``hvdmagic.log_metrics`` every step (each rank's flusher sends about 10
  reports a second). The kernel's CPU per second of training, the events a second it applied
  (``RunRecord.apply``, counted in the kernel) and the dashboard's redraws a second and their
  duration (``Dashboard._draw``).
- **allreduce**: ``import horovod.torch``, ``hvd.init()`` and one allreduce on
  ``--allreduce-per-host`` ranks per host, or as many as the memory available then holds
  (a torch rank keeps about 210 MiB of its own, so 128 of them do not fit in 24 GiB beside
  16 workers' and executors' JVMs): the result checked.
- **faults**: on the same N ranks, one rank on host ``--fault-host`` (1-based) raises, is
  SIGKILLed, or hangs (``--stall-timeout 20``); each cell must fail, and its error must name
  that rank and that host. The error's first lines are recorded.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))  # the simulated hosts and the standalone cluster the tests use

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the executors' Python: the kernel's

import netns  # noqa: E402
from helpers import StandaloneCluster  # noqa: E402

from benchmarks import _common  # noqa: E402
from benchmarks.bench_many_ranks import INSTRUMENT  # noqa: E402

log = _common.Log("bench_many_hosts")

SESSION = """
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master({url!r}).appName("bench-many-hosts")
         .config("spark.driver.host", {driver!r}).config("spark.driver.bindAddress", {driver!r})
         .config("spark.executor.cores", "{cores}").config("spark.executor.memory", "512m")
         .config("spark.ui.enabled", "false").getOrCreate())
spark.sparkContext.defaultParallelism
"""
LAUNCH = "%%horovod --np {np}\nimport os\nint(os.environ['HOROVOD_RANK'])\n"
REPORT = """%%horovod --np {np}
import os, time, hvdmagic
rank = int(os.environ["HOROVOD_RANK"])
for step in hvdmagic.track(range({steps}), desc="train"):
    time.sleep(0.02)
    hvdmagic.log_metrics(loss=1.0 / (step + 1))
rank
"""
ALLREDUCE = """%%horovod --np {np}
import torch, horovod.torch as hvd
hvd.init()
int(hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item())
"""
FAULTS = {
    "raises": "raise ValueError('this rank gives up')",
    "killed": "os.kill(os.getpid(), 9)",
    "hangs": "time.sleep(3600)",
}
# The victim: one rank of the fault host (its hostname is its namespace's name, tests/helpers.py).
FAULT_CELL = """%%horovod --np {np}{flags}
import os, socket, time, hvdmagic
victim = socket.gethostname() == {host!r} and int(os.environ["HOROVOD_LOCAL_RANK"]) == {local}
for step in hvdmagic.track(range(150), desc="train"):
    time.sleep(0.02)
    if step == 50 and victim:
        {fault}
int(os.environ["HOROVOD_RANK"])
"""
READ = ("import json, hvdmagic\nr = hvdmagic.last_run()\n"
        "print(json.dumps({'state': r.state, 'stages': r.timings['stages'], 'error': str(r.error or ''), "
        "'hosts': {r_.rank: r_.host for r_ in r.ranks}}))")


def _printed(kernel, code: str) -> dict:
    return json.loads(kernel.run_capturing(code).strip().splitlines()[-1])


class _Kernel:
    """bench_quick_cells' Kernel, plus what a cell printed, or the error of a cell that must fail."""

    def __init__(self):
        from benchmarks.bench_quick_cells import Kernel

        self.kernel = Kernel()

    def run(self, code: str, timeout: float = 900) -> dict:
        return self.kernel.run(code, timeout=timeout)

    def run_capturing(self, code: str, timeout: float = 120) -> str:
        return self.kernel.execute(code, timeout)[2]

    def failing(self, code: str, timeout: float = 900) -> str:
        """Run a cell that must fail: the error's text as the notebook shows it."""
        errors: list[str] = []

        def keep(message: dict) -> None:
            if message["msg_type"] == "error":
                content = message["content"]
                errors.append("\n".join(content.get("traceback", [])) or content.get("evalue", ""))

        _, _, printed = self.kernel.execute(code, timeout, on_message=keep, must_fail=True)
        return printed + "".join(errors)

    def stats(self) -> dict:
        return json.loads(ast.literal_eval(self.run("_bench_read()")["result"]))

    def stop(self) -> None:
        self.kernel.stop()


def launch_part(kernel: _Kernel, sizes: list[int]) -> list[dict]:
    out = []
    for np_ in sizes:
        kernel.run("_bench_reset()")
        sample = kernel.run(LAUNCH.format(np=np_))
        if sample["result"] != "0":
            raise RuntimeError(f"np {np_}: the cell returned {sample['result']!r}, not rank 0's 0")
        stats = kernel.stats()
        stages = _printed(kernel, READ)["stages"]
        log(f"launch np {np_}: {sample['seconds']:.2f} s, kernel CPU {stats['cpu']:.2f} s, stages "
            + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()))
        out.append({"np": np_, "wall": sample["seconds"], "kernel_cpu": stats["cpu"], "stages": stages,
                    "applies": stats["apply"][0]})
    if len(out) > 1:
        slope, intercept = statistics.linear_regression([r["np"] for r in out], [r["kernel_cpu"] for r in out])
        out.append({"kernel_cpu_per_rank_s": slope, "kernel_cpu_fixed_s": intercept})
    return out


def report_part(kernel: _Kernel, np_: int, seconds: float) -> dict:
    kernel.run("_bench_reset()")
    sample = kernel.run(REPORT.format(np=np_, steps=int(seconds / 0.02)))
    if sample["result"] != "0":
        raise RuntimeError(f"the report cell returned {sample['result']!r}, not rank 0's 0")
    stats = kernel.stats()
    training = stats["training"] or stats["elapsed"]
    figures = {"np": np_, "wall": sample["seconds"], "training_s": training, "kernel_cpu": stats["cpu"],
               "kernel_cores_while_training": stats["cpu"] / training,
               "applies_per_s": stats["apply"][0] / training,
               "apply_us": 1e6 * stats["apply"][1] / max(1, stats["apply"][0]),
               "redraws_per_s": stats["draw"][0] / stats["elapsed"],
               "redraw_ms": 1e3 * stats["draw"][1] / max(1, stats["draw"][0]), "redraw_max_ms": 1e3 * stats["draw_max"],
               "widget_updates_per_s": sample["widget_updates"] / stats["elapsed"]}
    log(f"report np {np_}: {json.dumps({k: round(v, 3) for k, v in figures.items()})}")
    return figures


def allreduce_part(kernel: _Kernel, np_: int) -> dict:
    kernel.run("_bench_reset()")
    sample = kernel.run(ALLREDUCE.format(np=np_))
    if sample["result"] != str(np_):
        raise RuntimeError(f"the allreduce of {np_} ones gave {sample['result']!r}")
    stats = kernel.stats()
    stages = _printed(kernel, READ)["stages"]
    log(f"allreduce np {np_}: {sample['seconds']:.2f} s, kernel CPU {stats['cpu']:.2f} s")
    return {"np": np_, "wall": sample["seconds"], "kernel_cpu": stats["cpu"], "stages": stages}


TORCH_RANK_BYTES = 230 << 20  # a rank after `import torch, horovod.torch` and hvd.init(): 206 MiB private here
MEMORY_MARGIN = 2 << 30


def torch_ranks_that_fit(hosts: int, wanted: int) -> int:
    """Torch ranks per host (at most ``wanted``) that the memory available now holds, with a margin."""
    import psutil

    fit = (psutil.virtual_memory().available - MEMORY_MARGIN) // TORCH_RANK_BYTES // hosts
    if fit < 1:
        raise RuntimeError(f"not one torch rank per host fits in the {psutil.virtual_memory().available >> 20} MiB "
                           "available")
    if fit < wanted:
        log(f"allreduce: {fit} torch ranks per host fit in the memory available, not {wanted}")
    return min(wanted, int(fit))


def fault_part(kernel: _Kernel, network: netns.Hosts, np_: int, per_host: int, fault_host: int) -> dict:
    """One rank on host ``fault_host`` fails each way; the error must name its rank and its host."""
    namespace = network.hosts[fault_host - 1][1]
    local = per_host // 2
    out = {}
    for how, fault in FAULTS.items():
        flags = " --stall-timeout 20" if how == "hangs" else ""
        started = time.perf_counter()
        shown = kernel.failing(FAULT_CELL.format(np=np_, flags=flags, host=namespace, local=local, fault=fault))
        seconds = time.perf_counter() - started
        record = _printed(kernel, READ)
        on_host = sorted(int(rank) for rank, host in record["hosts"].items() if host == namespace)
        victim = on_host[local] if len(on_host) > local else None
        error = record["error"]
        names_rank = victim is not None and f"rank {victim}" in error
        names_host = namespace in error
        head = "\n".join(error.splitlines()[:6])
        log(f"fault {how}: {seconds:.1f} s; names rank {victim}: {names_rank}; names {namespace}: {names_host}\n{head}")
        out[how] = {"victim": victim, "host": namespace, "seconds": seconds, "names_rank": names_rank,
                    "names_host": names_host, "error_head": head, "error_lines": error.count("\n") + 1,
                    "shown_chars": len(shown)}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=16)
    parser.add_argument("--per-host", type=int, default=8, help="ranks (Spark cores) per host")
    parser.add_argument("--launch-sizes", default=None, help="launch part sizes (default: hosts, half, all)")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds of steps in the report part")
    parser.add_argument("--allreduce-per-host", type=int, default=4, help="torch ranks per host (0: skip)")
    parser.add_argument("--fault-host", type=int, default=11, help="the host (1-based) whose rank fails")
    parser.add_argument("--parts", default="launch,report,allreduce,faults")
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench_many_hosts.json"))
    args = parser.parse_args(argv)
    if why := netns.available():
        parser.error(f"simulated hosts cannot be made here: {why}")
    slots = args.hosts * args.per_host
    sizes = [int(n) for n in (args.launch_sizes or f"{args.hosts},{slots // 2},{slots}").split(",")]
    parts = args.parts.split(",")
    result: dict = {"config": {**vars(args), "command": _common.command_line()},
                    "environment": _common.environment("pyspark", "ipykernel", "ipywidgets", "torch")}
    load = _common.LoadMonitor()
    workdir = Path(tempfile.mkdtemp(prefix="bench-many-hosts-"))
    with netns.Hosts(args.hosts) as network:
        cluster = StandaloneCluster(workdir, workers=args.hosts, cores=args.per_host, gpus=0, host=network.driver,
                                    worker_hosts=network.hosts)
        log(f"starting {args.hosts} workers of {args.per_host} cores")
        cluster.start(timeout=600)
        kernel = _Kernel()
        try:
            kernel.run(SESSION.format(url=cluster.url, driver=network.driver, cores=args.per_host), timeout=600)
            kernel.run("%load_ext hvdmagic")
            kernel.run(INSTRUMENT)
            log("a first cell on every host: the executors' Python workers start")
            kernel.run(LAUNCH.format(np=args.hosts))
            # First, while only one Python worker per host holds memory (a run of all slots leaves
            # one per slot behind, as Spark reuses them).
            if "allreduce" in parts and args.allreduce_per_host:
                per_host = torch_ranks_that_fit(args.hosts, args.allreduce_per_host)
                result["allreduce"] = allreduce_part(kernel, args.hosts * per_host)
                result["allreduce"]["per_host"] = per_host
            if "launch" in parts:
                result["launch"] = launch_part(kernel, sizes)
            if "report" in parts:
                result["report"] = report_part(kernel, slots, args.seconds)
            if "faults" in parts:
                result["faults"] = fault_part(kernel, network, slots, args.per_host, args.fault_host)
        finally:
            result["load"] = load.sample()
            _common.write_json(args.out, result)
            kernel.stop()
            cluster.stop()
    print(json.dumps({k: v for k, v in result.items() if k not in ("environment",)}, indent=1, default=str))
    print(f"every figure: {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
