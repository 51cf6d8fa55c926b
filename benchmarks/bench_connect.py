#!/usr/bin/env python
"""Launch time of a trivial ``%%horovod --np 2`` cell on a Spark Connect session against a classic one.

One command, from the repository root:

    .venv/bin/python benchmarks/bench_connect.py            # 12 rounds: 3 minutes on a busy 2-core machine
    .venv/bin/python benchmarks/bench_connect.py --quick    # a smoke run: 3 rounds

In one run it starts:

- a Spark Connect server, pyspark's own (``tests/connect_server.py``, ``--master local[4]``),
  in its own process on 127.0.0.1 (``PYSPARK_PYTHON`` is this interpreter, so its executors
  run hvdmagic's tasks), and a real Jupyter kernel (jupyter_client) whose session is
  ``SparkSession.builder.remote("sc://127.0.0.1:PORT")``: no JVM in that kernel;
- a second real Jupyter kernel with a classic ``local[4]`` session on 127.0.0.1 (its JVM
  under the kernel), made with ``SparkSession.builder`` as a user would.

Both kernels use the text view (``HVDMAGIC_NONINTERACTIVE=1``). Each gets two untimed
trivial cells first (the JVMs, the Python workers and the imports warm up), then the
timed cells take turns, one cell per kind, the order rotated each round, so that the load
of a shared machine falls on both kinds alike. Each cell is timed from its execute request
to the kernel's idle. After each timed cell an untimed one reads ``hvdmagic.last_run()``:
when the run reached each start-up stage (kernel clock), which shows where the time goes.

It prints the table and writes every sample to ``artifacts/bench_connect.json``
(docs/performance-launch.md shows the table). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))  # the Connect server the tests start

from connect_server import ConnectServer  # noqa: E402

from benchmarks import _common  # noqa: E402

log = _common.Log("bench_connect")

SLOTS = 4
SERVER_START = 180  # seconds the Connect server gets to listen: a JVM on a busy 2-core machine
TRIVIAL = "%%horovod --np 2\nimport torch, horovod.torch as hvd\nhvd.init()\nhvd.allreduce(torch.ones(1)).item()\n"
KINDS = ("classic", "connect")
LABELS = {"classic": "classic session (local[4], JVM in the kernel)",
          "connect": "Spark Connect session (local[4] server, no JVM in the kernel)"}
GOAL = 1.2  # Connect / classic, issue 23
SUBMITTED, HELLO = "stage submitted", "rank processes starting"  # protocol.Stage's values
# Read after each timed cell: the run's mode and when it reached each start-up stage, from its start.
PHASES = ("import hvdmagic\nr = hvdmagic.last_run()\n"
          "print(repr((r.mode, r.state, r.result, r.ended - r.started, "
          "{str(s): t - r.started for s, t in r.stage_reached.items()})))")


class Kernel(_common.Kernel):
    """A python3 kernel from this virtualenv, text view, with a session of one kind."""

    def __init__(self, session_code: str):
        super().__init__({"HVDMAGIC_NONINTERACTIVE": "1", "PYSPARK_PYTHON": sys.executable})
        self.run("%load_ext hvdmagic\nfrom pyspark.sql import SparkSession\n" + session_code
                 + "\nspark.range(1).count()", timeout=300)

    def run(self, code: str, timeout: float = 300) -> tuple[float, str]:
        """Run a cell: (seconds from the execute request to the kernel's idle, what it printed)."""
        seconds, _, printed = self.execute(code, timeout)
        return seconds, printed

    def value(self, code: str):
        return ast.literal_eval(self.run(code)[1].strip().splitlines()[-1])


def timed_cell(kernel: Kernel, kind: str) -> dict:
    seconds, _ = kernel.run(TRIVIAL)
    mode, state, result, elapsed, stages = kernel.value(PHASES)
    expected = "spark connect" if kind == "connect" else "spark"
    if (mode, state, result) != (expected, "finished", 1.0):
        raise RuntimeError(f"{kind}: the cell ran as {(mode, state, result)}, not ({expected!r}, 'finished', 1.0)")
    return {"seconds": seconds, "run_elapsed": elapsed, "stages": stages, "time": time.time(),
            "load1": os.getloadavg()[0]}


def summary(samples: dict) -> dict:
    out: dict = {kind: {"seconds": _common.describe([s["seconds"] for s in runs], q1=25, q3=75),
                        "stages": {stage: _common.describe([s["stages"].get(stage) for s in runs])
                                   for stage in dict.fromkeys(k for s in runs for k in s["stages"])},
                        "run_elapsed": _common.describe([s["run_elapsed"] for s in runs])}
                 for kind, runs in samples.items()}
    out["ratio"] = _common.paired([s["seconds"] for s in samples["connect"]],
                                  [s["seconds"] for s in samples["classic"]], totals=True)
    out["ratio_of_medians"] = out["connect"]["seconds"]["median"] / out["classic"]["seconds"]["median"]
    # From "stage submitted" to "rank processes starting" (every task has said hello on the channel):
    # where a Connect stage differs from a classic one.
    hello = {kind: [s["stages"][HELLO] - s["stages"][SUBMITTED] if {HELLO, SUBMITTED} <= s["stages"].keys() else None
                    for s in runs] for kind, runs in samples.items()}
    out["hello"] = {kind: _common.describe(gaps) for kind, gaps in hello.items()}
    out["hello"]["paired_difference"] = _common.describe(
        [b - a for a, b in zip(hello["classic"], hello["connect"]) if a is not None and b is not None])
    return out


def table(result: dict) -> str:
    s = result["summary"]
    lines = ["| trivial `%%horovod --np 2`, warm kernel | n | median | [min-max] | quartiles |",
             "| --- | --- | --- | --- | --- |"]
    for kind in KINDS:
        d = s[kind]["seconds"]
        lines.append(f"| {LABELS[kind]} | {d['n']} | {d['median']:.2f} s | [{d['min']:.2f}-{d['max']:.2f}] | "
                     f"{d['q1']:.2f}-{d['q3']:.2f} |")
    r = s["ratio"]
    ci = r.get("median_ci95")
    lines += ["", f"Connect / classic, paired by round: median {r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]"
              + (f", 95 % CI of the median [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else "")
              + f"; ratio of totals {r['ratio_of_totals']:.2f}x; ratio of medians {s['ratio_of_medians']:.2f}x "
              f"(goal <= {GOAL}x: {'met' if r['median'] <= GOAL else 'NOT met'})", "",
              "| reached, s after the run started: median (n) | classic | connect | connect - classic |",
              "| --- | --- | --- | --- |"]
    stages = list(dict.fromkeys([*s["classic"]["stages"], *s["connect"]["stages"]]))
    for stage in [*stages, "run ended"]:
        a = s["classic"]["run_elapsed"] if stage == "run ended" else s["classic"]["stages"].get(stage, {})
        b = s["connect"]["run_elapsed"] if stage == "run ended" else s["connect"]["stages"].get(stage, {})
        if a.get("n") == s["classic"]["seconds"]["n"] and b.get("n") == s["connect"]["seconds"]["n"]:  # every cell
            lines.append(f"| {stage} | {a['median']:.2f} ({a['n']}) | {b['median']:.2f} ({b['n']}) | "
                         f"{b['median'] - a['median']:+.2f} |")
    h = s["hello"]
    lines += ["", f"stage submitted -> every task said hello: classic {h['classic']['median']:.2f} s "
              f"[{h['classic']['min']:.2f}-{h['classic']['max']:.2f}], connect {h['connect']['median']:.2f} s "
              f"[{h['connect']['min']:.2f}-{h['connect']['max']:.2f}]; connect - classic, paired by round: "
              f"median {h['paired_difference']['median']:+.2f} s"]
    return "\n".join(lines)


COUNTS = {"rounds": (12, 3, "timed rounds, one cell of each kind per round {}")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 rounds")
    _common.add_counts(parser, COUNTS)
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench_connect.json"))
    args = parser.parse_args(argv)
    cfg = {"quick": args.quick, **_common.counts(args, COUNTS), "command": _common.command_line()}
    result: dict = {"config": cfg, "started": time.time(),
                    "environment": _common.environment("pyspark", "jupyter_client", "ipykernel"),
                    "samples": {kind: [] for kind in KINDS}}
    load = _common.LoadMonitor()
    server = None
    kernels: dict[str, Kernel] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-connect-") as workdir:
            log(f"starting the Connect server (local[{SLOTS}]) and the classic kernel")
            server = ConnectServer(Path(workdir), f"local[{SLOTS}]")
            kernels["classic"] = Kernel(
                f'spark = (SparkSession.builder.master("local[{SLOTS}]").config("spark.driver.host", "127.0.0.1")'
                '.config("spark.ui.enabled", "false").getOrCreate())')
            result["server_start_s"] = server.wait_listening(SERVER_START)
            log(f"the server listens on 127.0.0.1:{server.port} after {result['server_start_s']:.1f} s; "
                "starting the Connect kernel")
            kernels["connect"] = Kernel(f'spark = SparkSession.builder.remote("sc://127.0.0.1:{server.port}")'
                                        ".getOrCreate()")
            if kernels["connect"].value("print(repr(__import__('pyspark').SparkContext._active_spark_context))"):
                raise RuntimeError("the Connect kernel has a classic SparkContext")
            log("warm-up: 2 untimed cells of each kind")
            for _ in range(2):
                for kind in KINDS:
                    timed_cell(kernels[kind], kind)
            load.sample()
            result["load_before"] = os.getloadavg()
            log(f"{cfg['rounds']} rounds, one cell of each kind per round, taking turns")
            for r in range(cfg["rounds"]):
                for kind in _common.rotated(list(KINDS), r):
                    result["samples"][kind].append(timed_cell(kernels[kind], kind))
                log(f"round {r + 1}: " + ", ".join(f"{kind} {result['samples'][kind][-1]['seconds']:.2f} s"
                                                   for kind in KINDS))
            result["load"] = load.sample()
            result["load_after"] = os.getloadavg()
    finally:
        for kernel in kernels.values():
            kernel.stop()
        if server is not None:
            server.stop()
    result["summary"] = summary(result["samples"])
    result["ended"] = time.time()
    result["table"] = table(result)
    path = _common.write_json(args.out, result)
    print(result["table"])
    print(f"\nload average (1, 5, 15 min) before the timed rounds {tuple(round(x, 2) for x in result['load_before'])}, "
          f"after {tuple(round(x, 2) for x in result['load_after'])}; other processes' CPU during them: "
          f"{result['load']['others_cores']:.2f} cores of {os.cpu_count()}; every sample: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
