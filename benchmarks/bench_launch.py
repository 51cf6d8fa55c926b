#!/usr/bin/env python
"""Launch latency, training overhead and scaling of ``%%horovod`` and ``%%torchrun``, against horovodrun,
torchrun and pyspark's TorchDistributor.

One command, from the repository root:

    .venv/bin/python benchmarks/bench_launch.py               # the full run (12-15 minutes, plus the torch part)
    .venv/bin/python benchmarks/bench_launch.py --quick       # a smoke run (a few minutes)
    .venv/bin/python benchmarks/bench_launch.py --repeats 6   # more launch rounds
    .venv/bin/python benchmarks/bench_launch.py --only torch  # part 5 alone: the torch.distributed launchers

It prints tables, writes every sample to ``artifacts/bench_launch.json`` and a plot to
``artifacts/bench_launch.png`` (docs/performance-launch.md shows and explains them).
What it measures, with one warm SparkSession (``local[4]``, started before any timing):

1. Launch latency of a trivial job (``hvd.init()``, one allreduce, return a value) at
   np = 2 and 4: a ``%%horovod --np N`` cell run through a real IPython shell (wall
   time around ``run_cell``), the same cell with ``--np -N`` (local mode),
   ``horovodrun -np N --gloo`` on the same code as a script (subprocess wall time), and
   pyspark's ``TorchDistributor(num_processes=N, local_mode=False)`` on the equivalent
   torch.distributed gloo allreduce. Floors: ``python -c pass`` and
   ``python -c "import torch, horovod.torch"``. Every rank stamps the first statement of
   user code, so the time from ``run_cell`` to user code is known per rank.
2. Training overhead: an MLP on random data (batch 64, fixed steps) under
   ``%%horovod --np 2`` calling ``hvdmagic.progress`` and ``hvdmagic.log_metrics`` every
   step, against the same script under ``horovodrun -np 2`` (where both calls are
   no-ops), with OMP_NUM_THREADS as hvdmagic's ranks get it and as horovodrun leaves
   it. Samples/s are timed inside the ranks, over the loop only (after a warm-up).
3. Scaling: total samples/s at np = 1, 2, 4 under ``%%horovod``.
4. Profile: where a warm trivial ``%%horovod --np 2`` cell spends its time, from
   timestamps (driver-side functions wrapped for the duration of the profile, the
   ranks' stamps, Spark's REST API for the stage and its tasks) and, unless
   ``--no-py-spy``, a py-spy sample of the driver and its whole process tree.
5. torch.distributed, np = 2, every launcher on the same source (workloads.TORCH_*):
   ``%%torchrun --np 2`` (warm kernel), hvdmagic's ``TorchDistributor`` drop-in and
   pyspark's ``TorchDistributor`` (both ``local_mode=False`` on the same SparkSession),
   ``torchrun --nproc-per-node 2`` (a cold process, OMP_NUM_THREADS=1 as torchrun
   defaults to and as Spark gives hvdmagic's ranks), with ``%%horovod --np 2`` for
   reference and the floor ``python -c "import torch, torch.distributed"``: (a) the wall
   time of a trivial job (``init_process_group("gloo")``, one all_reduce), (b) the
   samples/s of a DDP training loop (part 2's model and step). Ratios are reported both
   as the median of per-round ratios and as the ratio of the totals.
6. Fresh cells from the host's template (``--only template``): real Jupyter kernels, widgets
   on, each with its own embedded Spark, timed from the execute request to the kernel's idle,
   HVDMAGIC_TEMPLATE on and off taking turns: a kernel's first ``%%horovod --np 2`` cell, fresh
   cells on its warm Spark against the import floor, and a Keras cell's wait before its code
   and before training (the run's start-up stages). Parts 1-5 run with the template as the
   environment says (on by default).

Every comparison alternates the systems (A B C A B C ...), because this machine has
two cores and may be shared; ratios are taken within a round and summarised by their
median and min/max. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ["HVDMAGIC_NONINTERACTIVE"] = "1"  # the text view: no widgets in a benchmark
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
_USER_OMP = os.environ.get("OMP_NUM_THREADS")

from benchmarks import _common, workloads  # noqa: E402
from benchmarks._common import paired_ratios  # noqa: E402

PY = sys.executable
HOROVODRUN = str(Path(PY).parent / "horovodrun")
TORCHRUN = str(Path(PY).parent / "torchrun")
CORES = os.cpu_count() or 1

log = _common.Log("bench_launch")


# ---------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------

def stats(values) -> dict:
    """n, median, min, max and quartiles (q1, q3) of the values that are not None."""
    return _common.describe(values, q1=25, q3=75)


def fmt(s: dict, unit: str = "s", digits: int = 2) -> str:
    if not s or not s.get("n"):
        return "-"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}{unit} (n=1)"
    return f"{s['median']:.{digits}f}{unit} [{s['min']:.{digits}f}-{s['max']:.{digits}f}] n={s['n']}"


# ---------------------------------------------------------------------------
# The systems under test
# ---------------------------------------------------------------------------

def timed_run(t0: float, t1: float, ranks) -> dict:
    """One launch: its wall time, when it started and ended, and every rank's RESULT."""
    return {"wall": t1 - t0, "start": t0, "end": t1, "ranks": list(ranks)}


def quiet(call) -> tuple:
    """``call()`` with its output captured: (its value, started, ended), wall clock."""
    with _common.captured():
        t0 = time.time()
        out = call()
        t1 = time.time()
    return out, t0, t1


class Systems:
    def __init__(self, spark, tmp: Path):
        self.spark = spark
        self.tmp = tmp
        self.ip = _common.ipython_shell()
        self._count = 0
        # TorchDistributor ships its function with pyspark's cloudpickle: by value, so the
        # executors need not import this benchmark's package.
        import cloudpickle
        import pyspark.cloudpickle

        cloudpickle.register_pickle_by_value(workloads)
        pyspark.cloudpickle.register_pickle_by_value(workloads)

    # -- %%horovod and %%torchrun through IPython -----------------------------------
    def cell(self, np: int, body: str) -> dict:
        import hvdmagic

        _, t0, t1 = _common.checked_cell(self.ip, workloads.cell(np, body))
        return timed_run(t0, t1, hvdmagic.last_run().results)

    def torch_cell(self, np: int, body: str) -> dict:
        import hvdmagic

        _, t0, t1 = _common.checked_cell(self.ip, workloads.torch_cell(np, body))
        return timed_run(t0, t1, hvdmagic.last_run().result)

    # -- horovodrun and torchrun: a cold process on the same source as a script -----
    def _script(self, name: str, command: list[str], script: str, omp: str | None, read) -> dict:
        """``command job.py folder``, OMP_NUM_THREADS=``omp`` (None: unset); ``read(folder)``: the results."""
        self._count += 1
        work = self.tmp / f"job{self._count}"
        work.mkdir()
        (work / "job.py").write_text(script)
        env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
        if omp is not None:
            env["OMP_NUM_THREADS"] = omp
        t0 = time.time()
        proc = subprocess.run([*command, str(work / "job.py"), str(work)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env=env, cwd=work, timeout=900)
        t1 = time.time()
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout.decode()[-3000:]}")
        run = timed_run(t0, t1, read(work))
        shutil.rmtree(work, ignore_errors=True)
        return run

    def horovodrun(self, np: int, body: str, omp: str | None = None) -> dict:
        """``omp``: None leaves OMP_NUM_THREADS out of the environment (horovodrun's default)."""
        return self._script(f"horovodrun -np {np}", [HOROVODRUN, "-np", str(np), "--gloo", "-H", f"localhost:{np}", PY],
                            workloads.script(body), omp,
                            lambda work: [json.loads((work / f"rank{r}.json").read_text()) for r in range(np)])

    def torchrun(self, np: int, body: str, omp: str = "1") -> dict:
        """``torchrun --nproc-per-node N job.py``, a cold process as torchrun always is. ``omp``:
        OMP_NUM_THREADS for the workers; "1" is torchrun's own default for N > 1 (set here so
        it does not print its warning), and what Spark gives hvdmagic's ranks."""
        return self._script(f"torchrun --nproc-per-node {np}", [TORCHRUN, "--nproc-per-node", str(np)],
                            workloads.torch_script(body), omp,
                            lambda work: json.loads((work / "results.json").read_text()))

    # -- both TorchDistributors, on the same warm SparkSession -------------------------
    def torch_distributor(self, np: int) -> dict:
        """pyspark's, on a function (part 1)."""
        from pyspark.ml.torch.distributor import TorchDistributor

        out, t0, t1 = quiet(lambda: TorchDistributor(num_processes=np, local_mode=False, use_gpu=False).run(
            workloads.torch_distributed_trivial))
        if not out or out.get("value") != float(np):
            raise RuntimeError(f"TorchDistributor returned {out!r}")
        return timed_run(t0, t1, [out])

    def hvdmagic_td(self, np: int, body: str) -> dict:
        """hvdmagic's drop-in, as a user would call pyspark's."""
        from hvdmagic import TorchDistributor

        out, t0, t1 = quiet(lambda: TorchDistributor(num_processes=np, local_mode=False, use_gpu=False).run(
            workloads.run_source, body))
        return timed_run(t0, t1, out)

    def pyspark_td(self, np: int, body: str, timeout: float = 600) -> dict:
        """pyspark's, given ``timeout`` seconds: its torchrun agents can wait
        for a peer that never joins (seen once here: one task's agent waited alone for
        minutes), and it takes no timeout of its own. Past it, every Spark job is cancelled."""
        from pyspark.ml.torch.distributor import TorchDistributor

        box: dict = {}

        def call() -> None:
            try:
                box["out"] = TorchDistributor(num_processes=np, local_mode=False, use_gpu=False).run(
                    workloads.run_source, body)
            except BaseException as exc:  # re-raised below, in the benchmark's thread
                box["error"] = exc

        with _common.captured():
            t0 = time.time()
            thread = threading.Thread(target=call, name="bench-pyspark-td", daemon=True)
            thread.start()
            thread.join(timeout)
            t1 = time.time()
            if thread.is_alive():
                self.spark.sparkContext.cancelAllJobs()
                thread.join(120)
                raise TimeoutError(f"pyspark's TorchDistributor did not return in {timeout:.0f} s; "
                                   "its Spark job was cancelled")
        if "error" in box:
            raise box["error"]
        out = box.get("out")
        if not out or len(out) != np:
            raise RuntimeError(f"pyspark's TorchDistributor returned {out!r}")
        return timed_run(t0, t1, out)

    # -- floors --------------------------------------------------------------------
    @staticmethod
    def python(code: str) -> dict:
        t0 = time.time()
        subprocess.run([PY, "-c", code], check=True, stdout=subprocess.DEVNULL)
        return {"wall": time.time() - t0}


IMPORT_SPLIT = ("import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
                "import horovod.torch; t2 = time.perf_counter(); print(t1 - t0, t2 - t1)")


def import_split() -> dict:
    out = subprocess.run([PY, "-c", IMPORT_SPLIT], check=True, capture_output=True, text=True).stdout.split()
    return {"torch": float(out[0]), "horovod_torch": float(out[1])}


def first_statement(run: dict) -> dict:
    """Seconds from the launch (run_cell / subprocess start) to user code, per rank and the last one."""
    firsts = [r["first"] - run["start"] for r in run["ranks"] if "first" in r]
    return {"per_rank": firsts, "last": max(firsts) if firsts else None}


# ---------------------------------------------------------------------------
# 1. Launch latency
# ---------------------------------------------------------------------------

LAUNCH_PHASES = ("launch -> rank processes", "rank start -> user code", "import torch, horovod.torch",
                 "hvd.init()", "allreduce", "job done -> launcher returns")


def last_stamps(ranks: list[dict]) -> dict:
    """Each of the workloads' stamps as the last rank passed it: the critical path."""
    return {key: max(r[key] for r in ranks) for key in workloads.STAMPS}


def launch_phases(run: dict) -> dict:
    """The critical path of one run from the ranks' stamps (the last rank to reach each point)."""
    ranks = [r for r in run["ranks"] if "proc_start" in r]
    if not ranks:
        return {}
    last = last_stamps(ranks)
    points = [run["start"], last["proc_start"], last["first"], last["imported"], last["init"], last["done"], run["end"]]
    return {name: b - a for name, a, b in zip(LAUNCH_PHASES, points, points[1:])}


def bench_launch(sysm: Systems, nps: list[int], rounds: int, td_rounds: int, warmup: bool = True) -> dict:
    body = workloads.TRIVIAL
    systems = {
        "hvdmagic_spark": lambda np: sysm.cell(np, body),
        "hvdmagic_local": lambda np: sysm.cell(-np, body),
        "horovodrun": lambda np: sysm.horovodrun(np, body),
        "torch_distributor": lambda np: sysm.torch_distributor(np),
    }
    floors = {
        "python_bare": lambda: sysm.python("pass"),
        "import_floor": lambda: sysm.python("import torch, horovod.torch"),
    }
    samples: dict = {name: [] for name in floors}
    samples.update({f"{name}@{np}": [] for name in systems for np in nps})
    splits = []

    if warmup:
        # One untimed run of each system at the largest np (it starts that many Spark Python workers).
        log(f"launch: warm-up, one untimed run of each system at np={max(nps)}")
        for name, fn in systems.items():
            if name == "torch_distributor" and td_rounds == 0:
                continue
            fn(max(nps))

    for r in range(rounds):
        log(f"launch: round {r + 1}/{rounds}")
        for name, fn in floors.items():
            samples[name].append(fn())
        splits.append(import_split())
        for name, np in _common.rotated([(name, np) for np in nps for name in systems], r):
            if name == "torch_distributor" and r >= td_rounds:
                continue
            run = systems[name](np)
            run["first_statement"] = first_statement(run)
            samples[f"{name}@{np}"].append(run)
            log(f"  {name:18s} np={np}: {run['wall']:.2f} s"
                + (f" (user code on every rank after {run['first_statement']['last']:.2f} s)"
                   if run["first_statement"]["last"] is not None else ""))

    summary = {key: stats([s["wall"] for s in runs]) for key, runs in samples.items()}
    phases = {key: {name: stats([launch_phases(s).get(name) for s in runs]) for name in LAUNCH_PHASES}
              for key, runs in samples.items() if key not in floors and not key.startswith("torch_distributor")}
    first = {key: stats([s["first_statement"]["last"] for s in runs if "first_statement" in s])
             for key, runs in samples.items() if key not in floors}
    ratios = {}
    for np in nps:
        hr = [s["wall"] for s in samples[f"horovodrun@{np}"]]
        for name in ("hvdmagic_spark", "hvdmagic_local", "torch_distributor"):
            ratios[f"{name}/horovodrun@{np}"] = stats(paired_ratios([s["wall"] for s in samples[f"{name}@{np}"]], hr))
        floor = [s["wall"] for s in samples["import_floor"]]
        for name in ("hvdmagic_spark", "hvdmagic_local", "horovodrun"):
            ratios[f"{name}/import_floor@{np}"] = stats(
                paired_ratios([s["wall"] for s in samples[f"{name}@{np}"]], floor))
    return {"samples": samples, "wall": summary, "first_statement": first, "ratios": ratios, "phases": phases,
            "import_split": {k: stats([s[k] for s in splits]) for k in ("torch", "horovod_torch")}}


# ---------------------------------------------------------------------------
# 2. Training overhead and 3. scaling
# ---------------------------------------------------------------------------

def total_throughput(run: dict) -> float:
    return sum(r["samples_per_s"] for r in run["ranks"])


def bench_training(sysm: Systems, rounds: int, steps: int, default_omp_steps: int) -> dict:
    np = 2
    matched = str(max(1, CORES // np))  # what hvdmagic gives each rank when OMP_NUM_THREADS is unset
    systems = {
        "hvdmagic_spark": lambda: sysm.cell(np, workloads.train(steps)),
        "horovodrun_omp_matched": lambda: sysm.horovodrun(np, workloads.train(steps), omp=matched),
    }
    if default_omp_steps:
        systems["horovodrun_omp_unset"] = lambda: sysm.horovodrun(np, workloads.train(default_omp_steps))
    runs: dict = {name: [] for name in systems}
    for r in range(rounds):
        for name in _common.rotated(list(systems), r):
            run = systems[name]()
            run["total_samples_per_s"] = total_throughput(run)
            runs[name].append(run)
            log(f"training round {r + 1}/{rounds}: {name:24s} {run['total_samples_per_s']:8.0f} samples/s "
                f"(torch threads per rank {[x['torch_threads'] for x in run['ranks']]}, "
                f"launch+run {run['wall']:.1f} s)")
    thr = {name: [x["total_samples_per_s"] for x in rs] for name, rs in runs.items()}
    # CPU per step (all threads of the rank process, loop only): far less sensitive to other
    # work on the machine than samples/s, and it includes hvdmagic's flusher thread.
    cpu = {name: [statistics.mean(r["cpu_ms_per_step"] for r in x["ranks"]) for x in rs] for name, rs in runs.items()}
    flusher = [r.get("flusher_cpu_s") for x in runs["hvdmagic_spark"] for r in x["ranks"]]
    result = {"np": np, "steps": steps, "batch": 64, "omp_matched": matched, "runs": runs,
              "samples_per_s": {name: stats(v) for name, v in thr.items()},
              "cpu_ms_per_step": {name: stats(v) for name, v in cpu.items()},
              "ratio_hvdmagic_vs_horovodrun_matched": stats(paired_ratios(thr["hvdmagic_spark"],
                                                                          thr["horovodrun_omp_matched"])),
              "cpu_ratio_hvdmagic_vs_horovodrun_matched": stats(paired_ratios(cpu["hvdmagic_spark"],
                                                                              cpu["horovodrun_omp_matched"])),
              "flusher_cpu_s_per_rank": stats([f for f in flusher if f is not None]),
              "torch_threads": {name: rs[0]["ranks"][0]["torch_threads"] for name, rs in runs.items() if rs},
              "omp_env": {name: rs[0]["ranks"][0]["omp_num_threads"] for name, rs in runs.items() if rs}}
    if "horovodrun_omp_unset" in thr:
        result["default_omp_steps"] = default_omp_steps
        result["ratio_hvdmagic_vs_horovodrun_unset"] = stats(paired_ratios(thr["hvdmagic_spark"],
                                                                           thr["horovodrun_omp_unset"]))
    return result


def bench_scaling(sysm: Systems, rounds: int, steps: int, nps=(1, 2, 4), local_np1: bool = True) -> dict:
    """Total samples/s at each np under %%horovod on Spark; ``local_np1`` adds ``--np -1``,
    whose rank gets OMP_NUM_THREADS from hvdmagic's own rule instead of from Spark."""
    series = [(str(np), np) for np in nps] + ([("local-1", -1)] if local_np1 else [])
    runs: dict = {key: [] for key, _ in series}
    for r in range(rounds):
        for key, np in _common.rotated(series, r):
            run = sysm.cell(np, workloads.train(steps))
            run["total_samples_per_s"] = total_throughput(run)
            runs[key].append(run)
            log(f"scaling round {r + 1}/{rounds}: np={np} {run['total_samples_per_s']:8.0f} samples/s total "
                f"(torch threads per rank {[x['torch_threads'] for x in run['ranks']]})")
    thr = {key: [x["total_samples_per_s"] for x in rs] for key, rs in runs.items()}
    base = thr[str(nps[0])]
    return {"steps_per_rank": steps, "runs": runs,
            "samples_per_s": {key: stats(v) for key, v in thr.items()},
            "speedup_vs_np1": {key: stats(paired_ratios(v, base)) for key, v in thr.items()},
            "torch_threads": {key: [x["torch_threads"] for x in rs[0]["ranks"]] for key, rs in runs.items()},
            "omp_env": {key: rs[0]["ranks"][0]["omp_num_threads"] for key, rs in runs.items()}}


# ---------------------------------------------------------------------------
# 5. torch.distributed: %%torchrun, both TorchDistributors and torchrun, side by side
# ---------------------------------------------------------------------------

TORCH_LABELS = {
    "torchrun_cell": "%%torchrun --np N (Spark, warm kernel)",
    "hvdmagic_td": "hvdmagic TorchDistributor (same Spark)",
    "pyspark_td": "pyspark TorchDistributor (same Spark)",
    "torchrun": "torchrun --nproc-per-node N (cold)",
    "horovod_cell": "%%horovod --np N (Spark), reference",
    "import_floor_torch": "floor: import torch, torch.distributed",
    "python_bare": "python -c pass",
}
TORCH_FLOORS = ("import_floor_torch", "python_bare")
TORCH_PHASES = ("launch -> rank processes", "rank start -> user code", "import torch (+ horovod.torch)",
                "init_process_group / hvd.init()", "all_reduce", "job done -> launcher returns")
# (numerator, denominator) of the paired ratios reported; the first of each part is its goal.
TORCH_LAUNCH_PAIRS = [("torchrun_cell", "pyspark_td"), ("hvdmagic_td", "pyspark_td"), ("torchrun_cell", "torchrun"),
                      ("hvdmagic_td", "torchrun"), ("torchrun", "pyspark_td"),
                      ("torchrun_cell", "import_floor_torch"), ("torchrun_cell", "horovod_cell")]
TORCH_TRAIN_PAIRS = [("torchrun_cell", "torchrun"), ("hvdmagic_td", "torchrun"), ("pyspark_td", "torchrun"),
                     ("torchrun_cell", "hvdmagic_td")]
LAUNCH_GOAL, TRAIN_GOAL = 0.15, 0.99


def have_horovod() -> bool:
    import importlib.util

    return importlib.util.find_spec("horovod") is not None


def paired(a: dict, b: dict) -> dict:
    """a/b for the rounds both ran (``{round: value}`` each), with the ratio of the totals."""
    rounds = sorted(set(a) & set(b))
    return _common.paired([a[r] for r in rounds], [b[r] for r in rounds], totals=True, q1=25, q3=75)


def bench_torch(sysm: Systems, np: int, rounds: int, td_rounds: int, train_rounds: int, train_td_rounds: int,
                steps: int, warmup: bool = True) -> dict:
    """(a) launch latency of a trivial all_reduce job and (b) training throughput, every torch
    launcher on the same code (workloads.TORCH_*), the modes taking turns in rotating order."""
    trivial = workloads.TORCH_TRIVIAL
    launch = {
        "torchrun_cell": lambda: sysm.torch_cell(np, trivial),
        "hvdmagic_td": lambda: sysm.hvdmagic_td(np, trivial),
        "pyspark_td": lambda: sysm.pyspark_td(np, trivial),
        "torchrun": lambda: sysm.torchrun(np, trivial),
        "import_floor_torch": lambda: sysm.python("import torch, torch.distributed"),
        "python_bare": lambda: sysm.python("pass"),
    }
    if have_horovod():
        launch["horovod_cell"] = lambda: sysm.cell(np, workloads.TRIVIAL)
    body = workloads.torch_train(steps)
    train = {
        "torchrun_cell": lambda: sysm.torch_cell(np, body),
        "hvdmagic_td": lambda: sysm.hvdmagic_td(np, body),
        "pyspark_td": lambda: sysm.pyspark_td(np, body),
        "torchrun": lambda: sysm.torchrun(np, body),
    }

    failures: list[dict] = []

    def attempt(part: str, name: str, r: int, fn) -> dict | None:
        """One run; a failure is recorded and the round goes on without it (its pairs drop out)."""
        try:
            return fn()
        except Exception as exc:
            failures.append({"part": part, "mode": name, "round": r, "error": repr(exc)[:2000]})
            log(f"  {name}: FAILED in {part} round {r + 1} ({exc!r:.300})")
            return None

    if warmup:
        log(f"torch: warm-up, one untimed trivial run of each launcher at np={np}")
        for name, fn in launch.items():
            if name not in TORCH_FLOORS and (name != "pyspark_td" or td_rounds or train_td_rounds):
                attempt("warm-up", name, 0, fn)

    runs: dict = {name: {} for name in launch}  # name -> {round: run}
    for r in range(rounds):
        log(f"torch launch: round {r + 1}/{rounds}")
        for name in _common.rotated([n for n in launch if n != "pyspark_td" or r < td_rounds], r):
            run = attempt("launch", name, r, launch[name])
            if run is None:
                continue
            if name not in TORCH_FLOORS:
                values = {x.get("value") for x in run["ranks"]}
                if values != {float(np)} or len(run["ranks"]) != np:
                    raise RuntimeError(f"{name}: the all_reduce gave {values} on {len(run['ranks'])} ranks")
                run["first_statement"] = first_statement(run)
            runs[name][r] = run
            log(f"  {name:20s} np={np}: {run['wall']:.2f} s")
    walls = {name: {r: run["wall"] for r, run in rs.items()} for name, rs in runs.items()}
    launch_result = {
        "runs": runs,
        "wall": {name: stats(w.values()) for name, w in walls.items()},
        "first_statement": {name: stats([run["first_statement"]["last"] for run in rs.values()])
                            for name, rs in runs.items() if name not in TORCH_FLOORS},
        "phases": {name: {label: stats([dict(zip(TORCH_PHASES, launch_phases(run).values())).get(label)
                                        for run in rs.values()]) for label in TORCH_PHASES}
                   for name, rs in runs.items() if name not in TORCH_FLOORS},
        "ratios": {f"{a}/{b}": paired(walls[a], walls[b]) for a, b in TORCH_LAUNCH_PAIRS
                   if a in walls and b in walls},
    }

    truns: dict = {name: {} for name in train}
    for r in range(train_rounds):
        for name in _common.rotated([n for n in train if n != "pyspark_td" or r < train_td_rounds], r):
            run = attempt("training", name, r, train[name])
            if run is None:
                continue
            run["total_samples_per_s"] = total_throughput(run)
            run["cpu_ms_per_step"] = statistics.mean(x["cpu_ms_per_step"] for x in run["ranks"])
            truns[name][r] = run
            log(f"torch training round {r + 1}/{train_rounds}: {name:14s} {run['total_samples_per_s']:8.0f} samples/s"
                f" (torch threads per rank {[x['torch_threads'] for x in run['ranks']]}, "
                f"OMP_NUM_THREADS {run['ranks'][0]['omp_num_threads']}, launch+run {run['wall']:.1f} s)")
    thr = {name: {r: run["total_samples_per_s"] for r, run in rs.items()} for name, rs in truns.items()}
    cpu = {name: {r: run["cpu_ms_per_step"] for r, run in rs.items()} for name, rs in truns.items()}
    threads = {name: sorted({(x["torch_threads"], x["omp_num_threads"]) for run in rs.values() for x in run["ranks"]})
               for name, rs in truns.items()}
    train_result = {
        "steps": steps, "batch": 64, "runs": truns,
        "samples_per_s": {name: stats(v.values()) for name, v in thr.items()},
        "cpu_ms_per_step": {name: stats(v.values()) for name, v in cpu.items()},
        "ratios": {f"{a}/{b}": paired(thr[a], thr[b]) for a, b in TORCH_TRAIN_PAIRS},
        "cpu_ratios": {f"{a}/{b}": paired(cpu[a], cpu[b]) for a, b in TORCH_TRAIN_PAIRS},
        "threads_and_omp": threads,
        "same_threads": len({tuple(t) for t in threads.values() if t}) <= 1,
        "flusher_cpu_s_per_rank": stats([x.get("flusher_cpu_s") for run in truns["torchrun_cell"].values()
                                         for x in run["ranks"]]),
    }
    result = {"np": np, "launch": launch_result, "training": train_result, "failures": failures}
    result["goal"] = torch_goal_lines(result)
    return result


def torch_goal_lines(res: dict) -> list[str]:
    def met(ratio: dict, ok) -> str:
        if not ratio.get("n"):
            return "not measured"
        both = ok(ratio["median"]) and ok(ratio["ratio_of_totals"])
        return "met" if both else ("met by one summary only" if ok(ratio["median"]) or ok(ratio["ratio_of_totals"])
                                   else "NOT met")

    def line(ratio: dict) -> str:
        ci = ratio.get("median_ci95")
        return (f"median of ratios {fmt(ratio, unit='x', digits=3)}"
                + (f", 95 % CI of the median [{ci[0]:.3f}-{ci[1]:.3f}]" if ci else "")
                + (f"; ratio of totals {ratio['ratio_of_totals']:.3f}x" if ratio.get("ratio_of_totals") else ""))

    a = res["launch"]["ratios"].get("torchrun_cell/pyspark_td", {})
    b = res["training"]["ratios"].get("torchrun_cell/torchrun", {})
    return [f"goal (a): a trivial %%torchrun --np {res['np']} at most {LAUNCH_GOAL} x pyspark's TorchDistributor -> "
            f"{line(a)} ({met(a, lambda v: v <= LAUNCH_GOAL)})",
            f"goal (b): %%torchrun training at least {TRAIN_GOAL} x torchrun's samples/s -> "
            f"{line(b)} ({met(b, lambda v: v >= TRAIN_GOAL)})"]


def phase_rows(title: str, names: tuple, phases: dict, indent: str, width: int) -> list[str]:
    """A critical-path table: the title and the phases' names, then each system's medians."""
    return [title + " | ".join(names)] + [
        f"{indent}{system:{width}s} " + "  ".join(f"{ph[n].get('median', float('nan')):6.2f}" for n in names)
        for system, ph in phases.items()]


def print_torch(t: dict) -> list[str]:
    out = []
    la, tr = t["launch"], t["training"]
    out.append(f"\n== 5a. torch.distributed: launch latency of a trivial all_reduce job, np={t['np']} "
               f"(wall s: median [min-max]; user code on every rank after) ==")
    for name, label in TORCH_LABELS.items():
        if name in la["wall"]:
            first = la["first_statement"].get(name)
            out.append(f"  {label:42s} {fmt(la['wall'][name]):>30s}"
                       + (f"   {fmt(first)}" if first else ""))
    out.extend(phase_rows("  critical path (median s): ", TORCH_PHASES, la["phases"], "    ", 18))
    out.append("  paired ratios: median [min-max] n; ratio of totals")
    for key, s in la["ratios"].items():
        out.append(f"    {key:36s} {fmt(s, unit='x', digits=3):>30s}; {s.get('ratio_of_totals') or float('nan'):.3f}x")
    out.append(f"\n== 5b. torch.distributed: training, np={t['np']}, total samples/s inside the ranks "
               f"({tr['steps']} steps x batch 64 per rank, DDP, gloo) ==")
    for name, s in tr["samples_per_s"].items():
        out.append(f"  {TORCH_LABELS[name]:42s} {fmt(s, unit='', digits=0):>26s}  CPU ms/step "
                   f"{fmt(tr['cpu_ms_per_step'][name], unit='', digits=2):>24s}  "
                   f"(threads, OMP) {tr['threads_and_omp'][name]}")
    out.append("  paired ratios of samples/s: median [min-max] n; ratio of totals; CPU per step ratio")
    for key, s in tr["ratios"].items():
        c = tr["cpu_ratios"][key]
        out.append(f"    {key:36s} {fmt(s, unit='x', digits=3):>30s}; {s.get('ratio_of_totals') or float('nan'):.3f}x;"
                   f" CPU {fmt(c, unit='x', digits=3)}")
    if not tr["same_threads"]:
        out.append("  NOTE: the launchers' ranks did not run with the same threads / OMP_NUM_THREADS")
    out.append(f"  hvdmagic's flusher thread, CPU s per rank over a %%torchrun run: "
               f"{fmt(tr['flusher_cpu_s_per_rank'], digits=3)}")
    out.extend("  " + line for line in t["goal"])
    for failure in t.get("failures", []):
        out.append(f"  FAILED: {failure['part']} round {failure['round'] + 1}, {failure['mode']}: "
                   f"{failure['error'][:200]}")
    return out


# ---------------------------------------------------------------------------
# 4. Profile of a warm trivial %%horovod --np 2 cell
# ---------------------------------------------------------------------------

class Probe:
    """Wraps driver-side hvdmagic functions (in this process only, for the profile's
    duration) so each call leaves wall-clock marks. hvdmagic's code is not changed."""

    def __init__(self):
        self.marks: list[tuple[str, float]] = []
        self.job_groups: list[str] = []
        self._undo: list[tuple[object, str, object]] = []

    def mark(self, name: str) -> None:
        self.marks.append((name, time.time()))

    def wrap(self, owner, attr: str, name: str) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            return
        probe = self

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            probe.mark(name + ".start")
            try:
                return original(*args, **kwargs)
            finally:
                probe.mark(name + ".end")

        setattr(owner, attr, wrapper)
        self._undo.append((owner, attr, original))

    def __enter__(self):
        import hvdmagic.channel as channel
        import hvdmagic.kernel.magic as magic
        import hvdmagic.kernel.runner as runner
        import hvdmagic.launch.job as job
        import hvdmagic.launch.rendezvous as rendezvous
        import hvdmagic.launch.spark as spark

        self.wrap(magic, "capture_cell", "capture")
        self.wrap(runner, "launch", "launch")
        self.wrap(runner, "make_view", "make_view")
        self.wrap(spark.SparkBackend, "__init__", "backend_init")
        self.wrap(spark, "session_for", "session_for")
        self.wrap(spark.SparkBackend, "_run", "spark_job")
        self.wrap(spark.SparkBackend, "join", "backend_join")
        self.wrap(job.Job, "_run", "job")
        self.wrap(job.Job, "_loop", "loop")
        self.wrap(job.Job, "_shutdown", "shutdown")
        self.wrap(channel.ChannelServer, "__init__", "channel_start")
        self.wrap(channel.ChannelServer, "close", "channel_close")
        self.wrap(rendezvous.Rendezvous, "__init__", "rendezvous_start")
        self.wrap(rendezvous.Rendezvous, "stop", "rendezvous_stop")
        self.wrap(rendezvous.Rendezvous, "init", "rendezvous_init")

        original_handle = job.Job._handle
        probe = self

        def handle(job_self, event, *args, **kwargs):
            kind = event.get("type")
            who = event.get("rank", event.get("task"))
            probe.mark(f"event.{kind}.{who}")
            return original_handle(job_self, event, *args, **kwargs)

        job.Job._handle = handle
        self._undo.append((job.Job, "_handle", original_handle))

        original_start = spark.SparkBackend.start

        def start(backend_self, *args, **kwargs):
            probe.job_groups.append(backend_self.job_group)
            probe.mark("backend_start")
            return original_start(backend_self, *args, **kwargs)

        spark.SparkBackend.start = start
        self._undo.append((spark.SparkBackend, "start", original_start))
        return self

    def __exit__(self, *exc):
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)

    def first(self, name: str, after: float = 0.0, before: float = float("inf")) -> float | None:
        times = [t for n, t in self.marks if n == name and after <= t <= before]
        return min(times) if times else None

    def last(self, name_prefix: str, after: float = 0.0, before: float = float("inf")) -> float | None:
        times = [t for n, t in self.marks if n.startswith(name_prefix) and after <= t <= before]
        return max(times) if times else None


def _spark_time(text: str | None) -> float | None:
    if not text:
        return None
    return dt.datetime.strptime(text.replace("GMT", ""), "%Y-%m-%dT%H:%M:%S.%f").replace(
        tzinfo=dt.UTC).timestamp()


def spark_stage_times(spark, job_group: str) -> dict:
    """Stage submission and task launch/finish times from Spark's REST API (ms resolution)."""
    sc = spark.sparkContext
    base = f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}"

    def get(path):
        with urllib.request.urlopen(base + path, timeout=10) as resp:
            return json.load(resp)

    for _ in range(20):  # the status store is fed asynchronously by the listener bus
        jobs = [j for j in get("/jobs") if j.get("jobGroup") == job_group]
        if jobs and jobs[0].get("completionTime"):
            break
        time.sleep(0.25)
    else:
        return {}
    job = jobs[0]
    stage = get(f"/stages/{job['stageIds'][0]}?details=true")[0]
    tasks = list(stage.get("tasks", {}).values())
    launches = [_spark_time(t.get("launchTime")) for t in tasks]
    ends = [lt + t.get("duration", 0) / 1000 for lt, t in zip(launches, tasks)]
    return {
        "job_submitted": _spark_time(job.get("submissionTime")),
        "stage_submitted": _spark_time(stage.get("submissionTime")),
        "first_task_launched": min(launches),
        "last_task_launched": max(launches),
        "last_task_finished": max(ends),
        "job_completed": _spark_time(job.get("completionTime")),
        "executor_deserialize_ms": [t.get("taskMetrics", {}).get("executorDeserializeTime") for t in tasks],
    }


PHASES = [
    # (label, start key, end key): keys are critical-path timestamps computed in profile_run
    ("magic + capture/pickle", "t0", "capture_end"),
    ("view, session lookup + slot check", "capture_end", "job_start"),
    ("channel + rendezvous start", "job_start", "spark_job_start"),
    ("Spark: submit barrier stage -> tasks launched", "spark_job_start", "last_task_launched"),
    ("task: python worker + connect + hello -> go", "last_task_launched", "go"),
    ("go -> rank processes created", "go", "proc_start"),
    ("rank interpreter start -> user code", "proc_start", "first"),
    ("import torch, horovod.torch", "first", "imported"),
    ("hvd.init() (Gloo rendezvous)", "imported", "init"),
    ("the job (one allreduce)", "init", "done"),
    ("rank: pickle + send result -> driver has it", "done", "last_result"),
    ("rank exit (teardown) + relays -> driver sees exits", "last_result", "last_exit"),
    ("driver: Spark job end, rendezvous/channel stop", "last_exit", "shutdown_end"),
    ("record/view close, IPython", "shutdown_end", "t1"),
]


def profile_run(sysm: Systems, probe: Probe, np: int = 2) -> dict:
    run = sysm.cell(np, workloads.TRIVIAL)
    t0, t1 = run["start"], run["end"]
    ranks = run["ranks"]
    points = {"t0": t0, "t1": t1}
    points["capture_end"] = probe.first("capture.end", t0, t1)
    points["job_start"] = probe.first("job.start", t0, t1)
    points["spark_job_start"] = probe.first("spark_job.start", t0, t1)
    points["go"] = probe.first("rendezvous_init.end", t0, t1)
    points.update(last_stamps(ranks))
    points["last_result"] = probe.last("event.result.", t0, t1)
    points["last_exit"] = probe.last("event.exit.", t0, t1)
    points["shutdown_end"] = probe.first("shutdown.end", t0, t1)
    detail = {f"{kind}s": [t - t0 for n, t in probe.marks if n.startswith(f"event.{kind}.") and t0 <= t <= t1]
              for kind in ("hello", "result", "exit")}
    detail.update({f"rank_{stamp}": [r[stamp] - t0 for r in ranks] for stamp in workloads.STAMPS})
    for name in ("capture", "session_for", "backend_init", "make_view", "channel_start", "rendezvous_start",
                 "spark_job", "backend_join", "rendezvous_stop", "channel_close", "shutdown"):
        s, e = probe.first(f"{name}.start", t0, t1), probe.first(f"{name}.end", t0, t1)
        if s is not None and e is not None:
            detail[f"{name}_s"] = e - s
    group = probe.job_groups[-1] if probe.job_groups else None
    try:
        sparkt = spark_stage_times(sysm.spark, group) if group else {}
    except Exception as exc:  # the UI may be disabled; the breakdown then merges the Spark rows
        sparkt = {"error": repr(exc)}
    if sparkt.get("last_task_launched"):
        points["last_task_launched"] = sparkt["last_task_launched"]
        detail["spark"] = {k: (v - t0 if isinstance(v, float) else v) for k, v in sparkt.items()}
    if points.get("spark_job_start") and sparkt.get("job_completed"):
        detail["spark_job_end_after_last_exit_s"] = ((probe.first("spark_job.end", t0, t1) or 0)
                                                     - (points["last_exit"] or 0))
    phases = {}
    for label, a, b in PHASES:
        if points.get(a) is not None and points.get(b) is not None:
            phases[label] = points[b] - points[a]
    return {"wall": t1 - t0, "phases": phases, "detail": detail}


def horovodrun_profile(sysm: Systems, np: int = 2) -> dict:
    run = sysm.horovodrun(np, workloads.TRIVIAL)
    t0 = run["start"]
    last = last_stamps(run["ranks"])
    return {"wall": run["wall"], "phases": {
        "horovodrun: start -> rank processes created": last["proc_start"] - t0,
        "rank interpreter start -> user code": last["first"] - last["proc_start"],
        "import torch, horovod.torch": last["imported"] - last["first"],
        "hvd.init() (Gloo rendezvous)": last["init"] - last["imported"],
        "the job (one allreduce)": last["done"] - last["init"],
        "rank exit + horovodrun teardown": run["end"] - last["done"],
    }}


def bare_barrier(spark, np: int, gather: bool) -> float:
    def task(_):
        from pyspark import BarrierTaskContext

        context = BarrierTaskContext.get()
        if gather:
            context.allGather("x")
        yield context.partitionId()

    t0 = time.time()
    spark.sparkContext.parallelize(range(np), np).barrier().mapPartitions(task).collect()
    return time.time() - t0


EXIT_COST = ("import time, os, torch, horovod.torch as hvd\n"
             "hvd.init(); hvd.allreduce(torch.tensor(1.0))\n"
             "print(time.time(), flush=True)\n")


def exit_cost(fast: bool) -> float:
    """Seconds from a torch + horovod process's last statement to its exit as its parent sees it:
    a normal interpreter exit, or ``os._exit(0)`` (no module teardown, no finalizers)."""
    code = EXIT_COST + ("os._exit(0)\n" if fast else "")
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True)
    end = time.time()
    return end - float(proc.stdout.split()[-1])


def py_spy_profile(sysm: Systems, out_dir: Path, cells: int) -> dict:
    """py-spy over this process and its whole tree (JVM's Python workers, supervisors,
    ranks) during ``cells`` warm cells; summarised per process role and function."""
    exe = shutil.which("py-spy") or str(Path(PY).parent / "py-spy")
    if not Path(exe).exists():
        return {"skipped": "py-spy is not installed (pip install py-spy)"}
    raw = out_dir / "bench_launch_pyspy.txt"
    cmd = [exe, "record", "--pid", str(os.getpid()), "--subprocesses", "--nonblocking",
           "--rate", "100", "--format", "raw", "--output", str(raw)]
    spy = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(1.5)
    if spy.poll() is not None:
        return {"skipped": f"py-spy failed: {spy.stdout.read().decode()[-500:]}"}
    walls = []
    try:
        for _ in range(cells):
            walls.append(sysm.cell(2, workloads.TRIVIAL)["wall"])
    finally:
        spy.send_signal(signal.SIGINT)
        try:
            spy.wait(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
    if not raw.exists():
        return {"skipped": "py-spy wrote no output"}
    return {"walls": walls, "raw": str(raw), **summarise_py_spy(raw)}


# (substring of a frame, label), in priority order: the first key found anywhere in a
# sample's stack names it. Frames look like "HorovodBasics.init (horovod/common/basics.py:105)".
_SPY_LABELS = [
    ("LoadMonitor", None),  # this benchmark's own sampler: left out
    ("_exitfunc", "interpreter exit (finalizers)"),
    ("_run_exitfuncs", "interpreter exit (atexit)"),
    ("_flush_loop", "report flusher thread"),
    ("<module> (horovod/torch/__init__.py", "import horovod.torch"),
    ("<module> (torch/__init__.py", "import torch"),
    ("HorovodBasics.init (", "hvd.init"),
    ("report_result (", "pickle + send result"),
    ("<module> (<horovod-cell>", "cell body (other)"),
    ("main (hvdmagic/rank/__main__.py", "rank: read + unpickle payload, other"),
    ("_get_module_details", "rank start-up imports"),
    ("<module> (hvdmagic/rank/__main__.py", "rank start-up imports"),
    ("serve_forever", "driver HTTP servers (horovod rendezvous KV store)"),
    ("process_request_thread", "driver HTTP servers (horovod rendezvous KV store)"),
    ("capture_cell (", "capture + pickle"),
    ("session_for (", "session lookup + slot check"),
    ("Job._loop (", "job loop"),
    ("Job._shutdown (", "job shutdown"),
    ("ChannelServer", "channel server threads"),
    ("FinalizerWorker", "py4j"),
    ("java_gateway", "py4j"),
    ("run_cell (", "run_cell (other)"),
    ("RankProcess._relay", "supervisor relays"),
    ("Supervisor._listen", "supervisor abort listener"),
    ("allGather", "barrier allGather"),
    ("Supervisor", "supervisor (other)"),
    ("RankProcess", "supervisor (other)"),
    ("worker (pyspark/daemon.py", "pyspark worker"),
    ("manager (pyspark/daemon.py", "pyspark daemon"),
]


def _role(command: str) -> str:
    role = _common.process_role(command)
    if role == "rank":
        return "rank"
    if role == "spark_python":
        return "spark python worker (supervisor)"
    if "bench_launch" in command:
        return "driver"
    return command.strip('"')[:60]


def summarise_py_spy(raw: Path) -> dict:
    """CPU samples (py-spy records active threads only) per process role and per label.

    py-spy writes one line per distinct stack: ``process P:"cmd";...;frame;frame N``.
    The last ``process`` entry is the sampled process; stacks with no Python frame
    (native threads of torch, Gloo, horovod's background loop) are counted apart."""
    roles: dict[str, dict[str, int]] = {}
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        try:
            n = int(count)
        except ValueError:
            continue
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        role = _role(procs[-1].split(":", 1)[-1]) if procs else "?"
        python_frames = [f for f in frames if not f.startswith("process ")]
        if not python_frames:
            label = "native threads, no Python frame (py-spy cannot tell idle ones)"
        else:
            label = next((lab for key, lab in _SPY_LABELS if any(key in f for f in python_frames)), "other")
        if label is None:
            continue
        counts = roles.setdefault(role, {})
        counts[label] = counts.get(label, 0) + n
    return {"rate_hz": 100, "cpu_s_by_role_and_label": {
        role: dict(sorted(((k, v / 100) for k, v in counts.items()), key=lambda kv: -kv[1]))
        for role, counts in roles.items()}}


def bench_profile(sysm: Systems, cells: int, use_py_spy: bool, out_dir: Path) -> dict:
    result: dict = {}
    runs, hr_runs, bare, gathered, exits, fast_exits = [], [], [], [], [], []
    with Probe() as probe:
        for i in range(cells):
            bare.append(bare_barrier(sysm.spark, 2, gather=False))
            gathered.append(bare_barrier(sysm.spark, 2, gather=True))
            exits.append(exit_cost(fast=False))
            fast_exits.append(exit_cost(fast=True))
            runs.append(profile_run(sysm, probe))
            hr_runs.append(horovodrun_profile(sysm))
            log(f"profile cell {i + 1}/{cells}: {runs[-1]['wall']:.2f} s (horovodrun {hr_runs[-1]['wall']:.2f} s)")
    labels = [label for label, _, _ in PHASES]
    result["hvdmagic_spark_np2"] = {
        "wall": stats([r["wall"] for r in runs]),
        "phases": {label: stats([r["phases"].get(label) for r in runs]) for label in labels},
        "runs": runs,
    }
    hr_labels = list(hr_runs[0]["phases"]) if hr_runs else []
    result["horovodrun_np2"] = {
        "wall": stats([r["wall"] for r in hr_runs]),
        "phases": {label: stats([r["phases"][label] for r in hr_runs]) for label in hr_labels},
    }
    result["bare_barrier_job_np2"] = stats(bare)
    result["bare_barrier_job_with_allgather_np2"] = stats(gathered)
    result["exit_after_torch_horovod"] = stats(exits)
    result["exit_after_torch_horovod_os_exit"] = stats(fast_exits)
    if use_py_spy:
        log("profile: py-spy over the driver's process tree")
        result["py_spy"] = py_spy_profile(sysm, out_dir, max(2, cells // 2))
    return result


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------

LABELS = {
    "hvdmagic_spark": "%%horovod --np N (Spark)",
    "hvdmagic_local": "%%horovod --np -N (local)",
    "horovodrun": "horovodrun -np N --gloo",
    "torch_distributor": "TorchDistributor(N)",
}


def print_tables(res: dict) -> None:
    out = []
    launch = res.get("launch")
    if launch:
        out.append("\n== 1. Launch latency of a trivial job (wall s: median [min-max]) ==")
        out.append(f"{'system':32s} " + "".join(f"{'np=' + str(np):>34s}" for np in res["config"]["nps"]))
        for name, label in LABELS.items():
            out.append(f"{label:32s} " + "".join(f"{fmt(launch['wall'].get(f'{name}@{np}')):>34s}"
                                              for np in res["config"]["nps"]))
        out.append(f"{'python -c pass':32s} {fmt(launch['wall']['python_bare']):>34s}")
        out.append(f"{'import torch, horovod.torch':32s} {fmt(launch['wall']['import_floor']):>34s}")
        split = launch["import_split"]
        out.append(f"   (in-process: import torch {fmt(split['torch'])}, "
                   f"then horovod.torch {fmt(split['horovod_torch'])})")
        out.append("launch -> user code running on every rank (s):")
        for name, label in LABELS.items():
            out.append(f"  {label:30s} " + "".join(f"{fmt(launch['first_statement'].get(f'{name}@{np}')):>34s}"
                                                for np in res["config"]["nps"]))
        out.extend(phase_rows("critical path per system (median s): ", LAUNCH_PHASES, launch["phases"], "  ", 24))
        out.append("paired ratios (same round):")
        for key, s in launch["ratios"].items():
            out.append(f"  {key:40s} {fmt(s, unit='x')}")
    goal = res.get("goal")
    if goal:
        out.append("\n== The issue's goal for a trivial warm %%horovod --np 2 ==")
        for line in goal["lines"]:
            out.append("  " + line)
    tr = res.get("training")
    if tr:
        out.append(f"\n== 2. Training overhead, np=2, samples/s inside the ranks ({tr['steps']} steps x batch 64) ==")
        for name, s in tr["samples_per_s"].items():
            out.append(f"  {name:28s} {fmt(s, unit='', digits=0):>30s}  torch threads/rank {tr['torch_threads'][name]}"
                       f", OMP_NUM_THREADS={tr['omp_env'][name]}")
        out.append("  CPU ms per step and rank (all threads of the rank, loop only):")
        for name, s in tr["cpu_ms_per_step"].items():
            out.append(f"    {name:26s} {fmt(s, unit='', digits=2):>30s}")
        out.append("  hvdmagic's flusher thread, CPU s per rank over the whole run: "
                   f"{fmt(tr['flusher_cpu_s_per_rank'], digits=3)}")
        out.append("  ratio hvdmagic / horovodrun (OMP matched): "
                   f"{fmt(tr['ratio_hvdmagic_vs_horovodrun_matched'], unit='x', digits=3)}"
                   f"; CPU per step {fmt(tr['cpu_ratio_hvdmagic_vs_horovodrun_matched'], unit='x', digits=3)}")
        if "ratio_hvdmagic_vs_horovodrun_unset" in tr:
            out.append("  ratio hvdmagic / horovodrun (OMP unset):   "
                       f"{fmt(tr['ratio_hvdmagic_vs_horovodrun_unset'], unit='x', digits=3)}")
    sc = res.get("scaling")
    if sc:
        out.append(f"\n== 3. Scaling under %%horovod (Spark), total samples/s, "
                   f"{sc['steps_per_rank']} steps per rank ==")
        for np, s in sc["samples_per_s"].items():
            out.append(f"  np={np:7s}: {fmt(s, unit='', digits=0):>30s}  "
                       f"speed-up vs np=1 {fmt(sc['speedup_vs_np1'][np], unit='x')}"
                       f"  torch threads/rank {sc['torch_threads'][np]}, OMP_NUM_THREADS={sc['omp_env'][np]}")
    prof = res.get("profile")
    if prof:
        p = prof["hvdmagic_spark_np2"]
        out.append(f"\n== 4. Where a warm trivial %%horovod --np 2 cell spends its time (wall {fmt(p['wall'])}) ==")
        for label, s in p["phases"].items():
            out.append(f"  {label:52s} {fmt(s, digits=3)}")
        out.append(f"  (bare barrier job np=2: {fmt(prof['bare_barrier_job_np2'], digits=3)}; "
                   f"with one allGather: {fmt(prof['bare_barrier_job_with_allgather_np2'], digits=3)})")
        out.append("  (a torch + horovod process's exit after its last statement: "
                   f"{fmt(prof['exit_after_torch_horovod'], digits=3)}; "
                   f"with os._exit(0): {fmt(prof['exit_after_torch_horovod_os_exit'], digits=3)})")
        h = prof["horovodrun_np2"]
        out.append(f"horovodrun -np 2 in the same rounds (wall {fmt(h['wall'])}):")
        for label, s in h["phases"].items():
            out.append(f"  {label:52s} {fmt(s, digits=3)}")
        spy = prof.get("py_spy")
        if spy:
            if "skipped" in spy:
                out.append(f"py-spy: skipped ({spy['skipped']})")
            else:
                out.append(f"py-spy, CPU seconds over {len(spy['walls'])} cells (per role, by label):")
                for role, labels in spy["cpu_s_by_role_and_label"].items():
                    top = ", ".join(f"{k} {v:.2f}" for k, v in list(labels.items())[:8])
                    out.append(f"  {role}: {top}")
    if res.get("torch"):
        out.extend(print_torch(res["torch"]))
    if res.get("template"):
        out.extend(print_template(res["template"]))
    for part, load in (res.get("load_by_part") or {}).items():
        if load:
            out.append(f"load during {part}: other processes {load.get('others_cores', 0):.2f} cores, "
                       f"this benchmark {load.get('ours_cores', 0):.2f}; load1 {fmt(load.get('load1'), unit='')}")
    load = res.get("load")
    if load:
        out.append(f"\nmachine: {CORES} cores; other processes used {load.get('others_cores', 0):.2f} cores on average "
                   f"during the run (this benchmark {load.get('ours_cores', 0):.2f}); "
                   f"load1 {fmt(load.get('load1'), unit='')}")
    print("\n".join(out), flush=True)


def goal_lines(res: dict) -> dict:
    launch = res.get("launch") or {}
    wall = launch.get("wall", {})
    ours, hr, floor = wall.get("hvdmagic_spark@2"), wall.get("horovodrun@2"), wall.get("import_floor")
    if not (ours and hr and floor and ours.get("n") and hr.get("n") and floor.get("n")):
        return {}
    r_hr = launch["ratios"].get("hvdmagic_spark/horovodrun@2", {})
    r_fl = launch["ratios"].get("hvdmagic_spark/import_floor@2", {})
    lines = [
        f"goal 1: at most 0.5 x horovodrun -np 2  -> now {fmt(r_hr, unit='x')}  "
        f"({'met' if r_hr.get('median', 9) <= 0.5 else 'NOT met'})",
        f"goal 2: at most 2 x the import floor     -> now {fmt(r_fl, unit='x')}  "
        f"({'met' if r_fl.get('median', 9) <= 2 else 'NOT met'})",
        f"in seconds: %%horovod --np 2 {ours['median']:.2f} s; horovodrun {hr['median']:.2f} s; "
        f"import floor {floor['median']:.2f} s; target <= {min(0.5 * hr['median'], 2 * floor['median']):.2f} s",
    ]
    return {"lines": lines, "ratio_vs_horovodrun": r_hr, "ratio_vs_import_floor": r_fl}


def _whiskers(summaries: list[dict]) -> tuple[list, list]:
    """The medians, and their distances down to the min and up to the max (matplotlib's yerr)."""
    meds = [s.get("median", float("nan")) for s in summaries]
    return meds, [[m - s.get("min", m) for s, m in zip(summaries, meds)],
                  [s.get("max", m) - m for s, m in zip(summaries, meds)]]


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    nps = res["config"]["nps"]
    ax = axes[0][0]
    launch = res.get("launch")
    if launch:
        names = list(LABELS)
        width = 0.8 / len(nps)
        # TorchDistributor is several times slower: clip the axis so the others stay readable.
        ycap = 1.35 * max((launch["wall"].get(f"{n}@{np}") or {}).get("max", 0)
                          for n in names if n != "torch_distributor" for np in nps)
        for j, np in enumerate(nps):
            meds, err = _whiskers([launch["wall"].get(f"{name}@{np}") or {} for name in names])
            xs = [i + j * width for i in range(len(names))]
            ax.bar(xs, meds, width, yerr=err, capsize=3, label=f"np={np}")
            for x, m in zip(xs, meds):
                ax.text(x, min(m, ycap), f"{m:.1f}", ha="center", va="bottom", fontsize=7)
        floor = launch["wall"]["import_floor"]["median"]
        ax.axhline(floor, color="k", ls=":", lw=1, label=f"import floor {floor:.1f} s")
        ax.axhline(2 * floor, color="k", ls="--", lw=1, label=f"goal: 2 x floor {2 * floor:.1f} s")
        hr2 = (launch["wall"].get("horovodrun@2") or {}).get("median")
        if hr2:
            ax.axhline(0.5 * hr2, color="C3", ls="--", lw=1, label=f"goal: 0.5 x horovodrun np=2 {0.5 * hr2:.1f} s")
        ax.set_xticks([i + width * (len(nps) - 1) / 2 for i in range(len(names))])
        ax.set_xticklabels([LABELS[n].replace(" (", "\n(") for n in names], fontsize=8)
        ax.set_ylim(0, ycap * 1.08)
        ax.set_ylabel("wall seconds (median, min-max; axis clipped)")
        ax.set_title("1. Launch latency of a trivial job (warm Spark)")
        ax.legend(fontsize=8)

    ax = axes[0][1]
    prof = res.get("profile")
    if prof:
        rows = [("%%horovod --np 2", prof["hvdmagic_spark_np2"]["phases"]),
                ("horovodrun -np 2", prof["horovodrun_np2"]["phases"])]
        cmap = plt.get_cmap("tab20")
        all_labels = []
        for _, phases in rows:
            for label in phases:
                if label not in all_labels:
                    all_labels.append(label)
        colors = {label: cmap(i % 20) for i, label in enumerate(all_labels)}
        for y, (_name, phases) in enumerate(rows):
            left = 0.0
            for label, s in phases.items():
                v = s.get("median") or 0.0
                ax.barh(y, v, left=left, color=colors[label], edgecolor="white",
                        label=label if y == 0 or label not in rows[0][1] else None)
                if v > 0.35:
                    ax.text(left + v / 2, y, f"{v:.1f}", ha="center", va="center", fontsize=7)
                left += v
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([r[0] for r in rows])
        ax.set_xlabel("seconds (median of each phase, critical path)")
        ax.set_title("4. Where the time goes (trivial job, np=2)")
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)

    ax = axes[1][0]
    tr = res.get("training")
    if tr:
        names = list(tr["samples_per_s"])
        meds, err = _whiskers(list(tr["samples_per_s"].values()))
        ax.bar(range(len(names)), meds, yerr=err, capsize=4, color=["C0", "C1", "C3"][:len(names)])
        for i, m in enumerate(meds):
            ax.text(i, m, f"{m:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([n.replace("_", "\n", 1) for n in names], fontsize=8)
        ratio = tr["ratio_hvdmagic_vs_horovodrun_matched"]
        ax.set_title(f"2. Training, np=2: samples/s in the loop\n(hvdmagic/horovodrun, same OMP: "
                     f"{ratio.get('median', float('nan')):.3f}x)")
        ax.set_ylabel("total samples/s (median, min-max)")

    ax = axes[1][1]
    sc = res.get("scaling")
    if sc:
        xs = [int(k) for k in sc["samples_per_s"] if k.isdigit()]
        meds, err = _whiskers([sc["samples_per_s"][str(x)] for x in xs])
        ax.errorbar(xs, meds, yerr=err, marker="o", capsize=4, label="%%horovod (Spark)")
        ax.plot(xs, [meds[0] * min(x, CORES) for x in xs], "k:", label=f"linear up to {CORES} cores")
        local = sc["samples_per_s"].get("local-1")
        if local and local.get("n"):
            ax.errorbar([1], *_whiskers([local]),
                        marker="s", color="C2", capsize=4, ls="none",
                        label=f"--np -1 (local; {sc['torch_threads']['local-1'][0]} torch threads)")
        ax.set_xticks(xs)
        ax.set_xlabel("np")
        ax.set_ylabel("total samples/s")
        ax.set_title(f"3. Scaling on {CORES} cores (np > {CORES} oversubscribes)")
        ax.legend(fontsize=8)
    fig.suptitle(f"bench_launch ({'quick' if res['config']['quick'] else 'full'} run, {CORES} cores, no GPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def environment() -> dict:
    modules = ("torch", "horovod", "pyspark") if have_horovod() else ("torch", "pyspark")
    return _common.environment(*modules, user_OMP_NUM_THREADS=_USER_OMP)


# option: (full-run default, --quick default, help)
# ---------------------------------------------------------------------------
# 6. Fresh cells from the host's template, through real kernels (issue 38)
# ---------------------------------------------------------------------------

FRESH_CELL = "%%horovod --np 2\nimport torch, horovod.torch as hvd\nhvd.init()\nhvd.allreduce(torch.ones(1)).item()\n"
KERAS_CELL = """%%horovod --np 2
import numpy as np, tensorflow as tf, horovod.tensorflow.keras as hvd
hvd.init()
model = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="relu", input_shape=(8,)), tf.keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)), loss="mse")
x = np.random.rand(512, 8).astype("float32")
model.fit(x, x.sum(1, keepdims=True), batch_size=32, epochs=2,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)]).history["loss"][-1]
"""
STAGES_CELL = "import json, hvdmagic\nprint(json.dumps(hvdmagic.last_run().timings['stages']))"
# The stages before a cell's own code runs: what the template takes away.
START_STAGES = ("rank processes starting", "importing into the template", "forking from the template", "importing")


class TimedKernel(_common.Kernel):
    """A python3 kernel of this virtualenv, widgets on, its own embedded Spark: cells timed from the
    execute request to the kernel's idle, as a user waits for them."""

    def __init__(self, template: bool):
        super().__init__({"HVDMAGIC_NONINTERACTIVE": None, "HVDMAGIC_TEMPLATE": "1" if template else "0"})
        self.run("%load_ext hvdmagic")

    def run(self, code: str, timeout: float = 600) -> tuple[float, str]:
        seconds, _, printed = self.execute(code, timeout)
        return seconds, printed

    def cell(self, code: str) -> dict:
        seconds, _ = self.run(code)
        _, text = self.run(STAGES_CELL)
        stages = json.loads(text.strip().splitlines()[-1])
        return {"wall": seconds, "stages": stages,
                "before_code": sum(v for k, v in stages.items() if k in START_STAGES),
                "before_training": sum(v for k, v in stages.items() if k != "training")}


def bench_template(rounds: int, fresh: int, keras: bool) -> dict:
    """Each round, for the template on and off in turn: a new kernel's first %%horovod --np 2 cell
    (it starts the embedded Spark too), ``fresh`` fresh cells on its warm Spark, and two Keras
    cells; the import floor ``fresh`` times in the same round."""
    samples: dict = {f"{what}_{mode}": [] for what in ("first", "fresh", "keras_first", "keras")
                     for mode in ("on", "off")}
    samples["import_floor"] = []
    for r in range(rounds):
        for mode in _common.rotated(["on", "off"], r):
            log(f"template: round {r + 1}/{rounds}, template {mode}")
            kernel = TimedKernel(template=mode == "on")
            try:
                samples[f"first_{mode}"].append(kernel.cell(FRESH_CELL))
                for _ in range(fresh):
                    samples[f"fresh_{mode}"].append(kernel.cell(FRESH_CELL))
                    samples["import_floor"].append(Systems.python("import torch, horovod.torch"))
                if keras:
                    samples[f"keras_first_{mode}"].append(kernel.cell(KERAS_CELL))
                    samples[f"keras_{mode}"].append(kernel.cell(KERAS_CELL))
            finally:
                kernel.stop()
    walls = {key: stats([s["wall"] for s in runs]) for key, runs in samples.items() if runs}
    before = {key: {"code": stats([s["before_code"] for s in runs]),
                    "training": stats([s["before_training"] for s in runs])}
              for key, runs in samples.items() if runs and key != "import_floor"}
    floor = [s["wall"] for s in samples["import_floor"]]
    ratios = {f"fresh_{mode}/import_floor": stats(paired_ratios([s["wall"] for s in samples[f"fresh_{mode}"]],
                                                                floor)) for mode in ("on", "off")}
    ratios["first_on/first_off"] = stats(paired_ratios([s["wall"] for s in samples["first_on"]],
                                                       [s["wall"] for s in samples["first_off"]]))
    return {"samples": samples, "wall": walls, "before": before, "ratios": ratios}


def print_template(t: dict) -> list[str]:
    out = ["\n== 6. Fresh cells from the host's template, real kernels, request to idle (s: median [min-max]) =="]
    rows = [("fresh %%horovod --np 2, warm Spark", "fresh"), ("first cell after the kernel starts", "first"),
            ("Keras cell, the kernel's first", "keras_first"), ("Keras cell, the next", "keras")]
    out.append(f"{'':40s} {'template on':>28s} {'template off':>28s}")
    for label, key in rows:
        out.append(f"{label:40s} {fmt(t['wall'].get(key + '_on')):>28s} {fmt(t['wall'].get(key + '_off')):>28s}")
        if key.startswith("keras") and t["before"].get(key + "_on"):
            for what in ("code", "training"):
                out.append(f"{'  wait before its ' + what:40s} {fmt(t['before'][key + '_on'][what]):>28s} "
                           f"{fmt(t['before'][key + '_off'][what]):>28s}")
    out.append(f"{'import torch, horovod.torch':40s} {fmt(t['wall'].get('import_floor')):>28s}")
    for name, ratio in t["ratios"].items():
        out.append(f"{name:40s} {fmt(ratio, unit='x'):>28s}")
    return out


COUNTS = {
    "repeats": (4, 1, "timed launch rounds {}"),
    "td_repeats": (2, 0, "rounds that include TorchDistributor {}; it is slow"),
    "train_repeats": (3, 1, "training rounds {}"),
    "train_steps": (1500, 150, "steps per rank {}"),
    "scaling_repeats": (2, 1, "scaling rounds {}"),
    "profile_cells": (4, 1, "profiled cells {}"),
    "torch_repeats": (6, 1, "torch part: launch rounds {}"),
    "torch_td_repeats": (3, 0, "torch part: rounds that include pyspark's TorchDistributor, in launch and in "
                               "training {}; it is slow"),
    "torch_train_repeats": (6, 1, "torch part: training rounds {}"),
    "torch_train_steps": (800, 100, "torch part: steps per rank {}"),
    "template_repeats": (3, 1, "template part: rounds (two new kernels each) {}"),
    "template_fresh": (5, 2, "template part: fresh cells per kernel {}"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: np=2 only, short runs, no py-spy")
    _common.add_counts(parser, COUNTS)
    parser.add_argument("--no-py-spy", action="store_true", help="skip the py-spy sample")
    parser.add_argument("--only", default="launch,training,scaling,profile,torch",
                        help="comma-separated parts to run (launch, training, scaling, profile, torch, template)")
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench_launch.json"))
    args = parser.parse_args(argv)
    quick = args.quick
    cfg = {
        "quick": quick,
        "nps": [2] if quick else [2, 4],
        **_common.counts(args, COUNTS),
        "py_spy": not (quick or args.no_py_spy),
        "parts": [p.strip() for p in args.only.split(",") if p.strip()],
        "command": _common.command_line(),
    }
    cfg["td_repeats"] = min(cfg["td_repeats"], cfg["repeats"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)  # py-spy's raw output goes there before the JSON
    if _USER_OMP is not None:
        log(f"note: OMP_NUM_THREADS={_USER_OMP} is set in this environment; hvdmagic then keeps it")
    res: dict = {"config": cfg, "environment": environment(), "started": time.time()}
    tmp = Path(tempfile.mkdtemp(prefix="bench_launch_"))
    monitor = _common.LoadMonitor()
    try:
        with monitor:
            log("starting the shared SparkSession (local[4]) and an IPython shell")
            t = time.time()
            spark = _common.start_spark(4)
            sysm = Systems(spark, tmp)
            res["spark_start_s"] = time.time() - t
            if cfg["parts"] == ["torch"] or not have_horovod():
                log("warming Spark up with one untimed %%torchrun --np 2 cell")
                sysm.torch_cell(2, workloads.TORCH_TRIVIAL)
            else:
                log("warming Spark up with one untimed %%horovod --np 2 cell")
                sysm.cell(2, workloads.TRIVIAL)
            parts = {
                "launch": lambda: bench_launch(sysm, cfg["nps"], cfg["repeats"], cfg["td_repeats"], warmup=not quick),
                # horovodrun without OMP_NUM_THREADS oversubscribes the cores; it gets fewer steps.
                "training": lambda: bench_training(sysm, cfg["train_repeats"], cfg["train_steps"],
                                                   max(30, cfg["train_steps"] // 10)),
                "scaling": lambda: bench_scaling(sysm, cfg["scaling_repeats"], max(50, cfg["train_steps"] // 3),
                                                 nps=(1, 2) if quick else (1, 2, 4)),
                "profile": lambda: bench_profile(sysm, cfg["profile_cells"], cfg["py_spy"], out.parent),
                "torch": lambda: bench_torch(
                    sysm, 2, cfg["torch_repeats"], min(cfg["torch_td_repeats"], cfg["torch_repeats"]),
                    cfg["torch_train_repeats"], min(cfg["torch_td_repeats"], cfg["torch_train_repeats"]),
                    cfg["torch_train_steps"]),
                "template": lambda: bench_template(cfg["template_repeats"], cfg["template_fresh"],
                                                   keras=importlib.util.find_spec("tensorflow") is not None),
            }
            parts_time = {}
            for part, run in parts.items():
                if part in cfg["parts"]:
                    t = time.time()
                    res[part] = run()
                    parts_time[part] = (t, time.time())
        if "launch" in res:
            res["goal"] = goal_lines(res)
        res["load"] = monitor.summary()
        res["load_by_part"] = {name: monitor.summary(a, b) for name, (a, b) in parts_time.items()}
        res["load_samples"] = monitor.samples
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["ended"] = time.time()
    res["duration_s"] = res["ended"] - res["started"]
    _common.write_json(out, res)
    print_tables(res)
    png = out.with_suffix(".png")
    if not any(res.get(part) for part in ("launch", "training", "scaling", "profile")):
        log(f"wrote {out} in {res['duration_s']:.0f} s (the plot shows parts 1-4 only)")
        return 0
    try:
        plot(res, png)
        log(f"wrote {out} and {png} in {res['duration_s']:.0f} s")
    except ImportError:
        log(f"wrote {out} in {res['duration_s']:.0f} s (no plot: pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
