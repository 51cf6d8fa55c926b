#!/usr/bin/env python
"""The kernel's cost per rank of a live run's view: 8 to 64 real ranks, and the same view to 256.

One command, from the repository root:

    .venv/bin/python benchmarks/bench_many_ranks.py            # about 3 minutes on 2 cores
    .venv/bin/python benchmarks/bench_many_ranks.py --quick    # a smoke run

Two parts:

- **real**: one Jupyter kernel (jupyter_client, widgets on, as in JupyterLab) runs, for each
  size N, a ``%%horovod --np -N`` cell: local ranks without a framework, each an
  ``hvdmagic.track`` loop of ``--seconds`` of 20 ms steps that prints a line every 25
  steps. Before the runs an untimed cell wraps ``RunRecord.apply`` and ``Dashboard._draw`` in
  the kernel to count their calls and time them (perf_counter, per call); the kernel process's
  own CPU (``resource.getrusage``: its threads, which include local mode's supervisors, not the
  rank processes) is read around each cell. From the client it counts the widget updates
  and display updates the kernel sent.
- **view**: in this process, a ``RunRecord`` of N ranks fed what N such ranks send in one
  second (a progress report every 0.1 s each, ``rank.telemetry.FLUSH_INTERVAL``, and a line
  every 0.5 s), then the live dashboard's redraw (``Dashboard._draw``, grouped rows from 9
  ranks on) and the text twins (``fallback_text``, the snapshot's HTML and text), each timed
  over ``--repeats`` in CPU time of this thread (``time.thread_time``, so that other processes
  on a busy machine do not count) and taken at the median; then the same with a row per rank,
  as before grouping, for comparison. No front end and no ranks: the view's own cost, to 256
  ranks, more than this machine can start.

It prints both tables and writes every figure to ``artifacts/bench_many_ranks.json``.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import _common  # noqa: E402

log = _common.Log("bench_many_ranks")

# Wraps the record's apply and the dashboard's redraw in the kernel, to count and time them.
INSTRUMENT = """
import time, resource, hvdmagic.kernel.record as _r, hvdmagic.kernel.ui.dashboard as _d
_bench = {"apply": [0, 0.0], "draw": [0, 0.0], "draw_max": 0.0}
def _timed(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t
            _bench[name][0] += 1
            _bench[name][1] += dt
            if name == "draw":
                _bench["draw_max"] = max(_bench["draw_max"], dt)
    return wrapper
_r.RunRecord.apply = _timed("apply", _r.RunRecord.apply)
_d.Dashboard._draw = _timed("draw", _d.Dashboard._draw)
def _bench_reset():
    _bench.update({"apply": [0, 0.0], "draw": [0, 0.0], "draw_max": 0.0})
    u = resource.getrusage(resource.RUSAGE_SELF)
    _bench["cpu0"] = u.ru_utime + u.ru_stime
def _bench_read():
    import json, hvdmagic
    u = resource.getrusage(resource.RUSAGE_SELF)
    run = hvdmagic.last_run()
    stages = run.timings["stages"]
    return json.dumps({**_bench, "cpu": u.ru_utime + u.ru_stime - _bench["cpu0"], "elapsed": run.elapsed,
                       "training": stages.get("training"), "state": run.state, "ranks": run.np})
"""
CELL = """%%horovod --np -{np}
import os, time, hvdmagic
rank = int(os.environ["HOROVOD_RANK"])
for step in hvdmagic.track(range({steps}), desc="train"):
    time.sleep(0.02)
    if step % 25 == 0:
        print(f"step {{step}}", flush=True)
rank
"""


def real_runs(sizes: list[int], seconds: float) -> list[dict]:
    from benchmarks.bench_quick_cells import Kernel

    kernel = Kernel()
    out = []
    try:
        kernel.run("%load_ext hvdmagic")
        kernel.run(INSTRUMENT)
        kernel.run("%%horovod --np -2\n1")  # warm: the imports a first run pays
        for np_ in sizes:
            log(f"a real run of {np_} local ranks, {seconds:g} s of steps")
            kernel.run("_bench_reset()")
            sample = kernel.run(CELL.format(np=np_, steps=int(seconds / 0.02)), timeout=600)
            if sample["result"] != "0":
                raise RuntimeError(f"np {np_}: the cell returned {sample['result']!r}, not rank 0's 0")
            stats = json.loads(ast.literal_eval(kernel.run("_bench_read()")["result"]))
            out.append({"np": np_, "wall": sample["seconds"], **stats,
                        "widget_updates": sample["widget_updates"], "display_updates": sample["display_updates"]})
    finally:
        kernel.stop()
    return out


def _feed_one_second(record, np_: int, t0: float) -> int:
    """What ``np_`` ranks send in a second: 10 progress reports each and 2 output lines. Returns the events."""
    events = 0
    for tick in range(10):
        stamp = t0 + tick / 10
        for rank in range(np_):
            step = 50 * (t0 - 1000) + 5 * tick + (rank % 3)
            record.apply({"type": "report", "rank": rank, "progress": {"train": [step, 100_000, stamp]}})
            events += 1
            if tick % 5 == 0:
                record.apply({"type": "output", "rank": rank, "stream": "stdout", "lines": [f"step {int(step)}"]})
                events += 1
    return events


def view_costs(sizes: list[int], repeats: int) -> list[dict]:
    """Each size's view costs, grouped (as shipped) and, for comparison, with a row per rank."""
    from hvdmagic.kernel.ui import grouping

    out = []
    for np_ in sizes:
        log(f"the view of {np_} ranks, in this process")
        grouped = _view_cost(np_, repeats)
        threshold = grouping.ONE_ROW_PER_RANK
        grouping.ONE_ROW_PER_RANK = 1 << 30  # every run a row per rank, as before grouping
        try:
            each = _view_cost(np_, repeats)
        finally:
            grouping.ONE_ROW_PER_RANK = threshold
        out.append({**grouped, "ungrouped": each})
    return out


def _view_cost(np_: int, repeats: int) -> dict:
    from hvdmagic.kernel.record import RunRecord
    from hvdmagic.kernel.ui.dashboard import Dashboard
    from hvdmagic.kernel.ui.snapshot import Snapshot
    from hvdmagic.launch.placement import Placement

    record = RunRecord(Placement.of(-np_))
    for rank in range(np_):
        record.apply({"type": "placed", "rank": rank, "host": "vm"})
    board = Dashboard(record)
    applies, draws, texts = [], [], []
    for r in range(repeats):
        t = time.thread_time()
        events = _feed_one_second(record, np_, 1000.0 + r)
        applies.append((time.thread_time() - t) / events)
        t = time.thread_time()
        board._draw()
        draws.append(time.thread_time() - t)
        t = time.thread_time()
        board.fallback_text()
        texts.append(time.thread_time() - t)
    record.finish(results=[None] * np_)
    snapshots = []
    for _ in range(max(3, repeats // 4)):
        t = time.thread_time()
        snapshot = Snapshot(record)
        html_text, plain = snapshot._repr_html_(), snapshot.text()
        snapshots.append(time.thread_time() - t)
    board.discard()
    apply_us, draw_ms = statistics.median(applies) * 1e6, statistics.median(draws) * 1e3
    text_ms = statistics.median(texts) * 1e3
    # A second of a live run: every event applied, 10 redraws, one text/plain.
    per_second_ms = apply_us * events / 1e3 + 10 * draw_ms + text_ms
    return {"np": np_, "events_per_s": events, "apply_us": apply_us, "draw_ms": draw_ms, "text_ms": text_ms,
            "per_second_ms": per_second_ms, "per_rank_ms": per_second_ms / np_,
            "snapshot_ms": statistics.median(snapshots) * 1e3, "snapshot_kb": len(html_text) / 1e3,
            "text_lines": plain.count("\n"), "rows_drawn": len(board._group_pool) or len(board.rows)}


def tables(result: dict) -> str:
    lines = []
    if result.get("real"):
        lines += ["real runs (kernel side, widgets on)", "np  training s  kernel CPU s  CPU ms/s/rank  applies/s  "
                  "apply µs  redraws/s  redraw ms (mean, max)  widget updates/s"]
        for r in result["real"]:
            training = r["training"] or r["elapsed"]
            lines.append(f"{r['np']:<3} {training:10.1f}  {r['cpu']:12.2f}  {1e3 * r['cpu'] / training / r['np']:13.2f}"
                         f"  {r['apply'][0] / training:9.0f}  {1e6 * r['apply'][1] / max(1, r['apply'][0]):8.1f}"
                         f"  {r['draw'][0] / r['elapsed']:9.1f}  {1e3 * r['draw'][1] / max(1, r['draw'][0]):8.2f}, "
                         f"{1e3 * r['draw_max']:6.1f}      {r['widget_updates'] / r['elapsed']:8.0f}")
        fastest = max(r["draw"][0] / r["elapsed"] for r in result["real"])
        lines.append(f"redraws: at most {fastest:.1f} a second (goal <= 10)")
        if len(result["real"]) > 1:  # the kernel's CPU a second of training, as a + b * np (least squares)
            xs = [r["np"] for r in result["real"]]
            ys = [r["cpu"] / (r["training"] or r["elapsed"]) for r in result["real"]]
            slope, intercept = statistics.linear_regression(xs, ys)
            worst = max(abs(y - (intercept + slope * x)) for x, y in zip(xs, ys))
            lines.append(f"kernel CPU per second of training: {1e3 * intercept:.0f} ms + {1e3 * slope:.2f} ms per rank "
                         f"(least squares; the farthest size is {1e3 * worst:.0f} ms off the line)")
        lines.append("")
    lines += ["the view alone, per second of a live run (in-process, no front end)",
              "np   events/s  apply µs  redraw ms  text ms  ms per s  ms per s per rank  rows  snapshot ms  KB  lines"
              "   | a row per rank: redraw ms  ms per s  KB  lines"]
    for v in result["view"]:
        u = v["ungrouped"]
        lines.append(f"{v['np']:<4} {v['events_per_s']:8d}  {v['apply_us']:8.1f}  {v['draw_ms']:9.2f}  "
                     f"{v['text_ms']:7.2f}  {v['per_second_ms']:8.1f}  {v['per_rank_ms']:17.2f}  {v['rows_drawn']:4d}  "
                     f"{v['snapshot_ms']:11.1f}  {v['snapshot_kb']:4.0f}  {v['text_lines']:5d}"
                     f"   |                  {u['draw_ms']:9.2f}  {u['per_second_ms']:8.1f}  {u['snapshot_kb']:3.0f}  "
                     f"{u['text_lines']:5d}")
    return "\n".join(lines)


COUNTS = {"repeats": (20, 5, "simulated seconds per size in the view part {}")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 8 and 16 real ranks, 4 s each")
    parser.add_argument("--sizes", default=None, help="real run sizes, comma-separated (default 8,16,32,64)")
    parser.add_argument("--view-sizes", default="8,16,32,64,128,256", help="view part sizes, comma-separated")
    parser.add_argument("--seconds", type=float, default=None, help="seconds of steps per real run (default 10)")
    parser.add_argument("--no-real", action="store_true", help="the view part only")
    _common.add_counts(parser, COUNTS)
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench_many_ranks.json"))
    args = parser.parse_args(argv)
    sizes = [int(n) for n in (args.sizes or ("8,16" if args.quick else "8,16,32,64")).split(",")]
    seconds = args.seconds or (4.0 if args.quick else 10.0)
    cfg = {"quick": args.quick, "sizes": sizes, "seconds": seconds, **_common.counts(args, COUNTS),
           "view_sizes": [int(n) for n in args.view_sizes.split(",")], "command": _common.command_line()}
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    result: dict = {"config": cfg, "started": time.time(),
                    "environment": _common.environment("ipykernel", "ipywidgets", "jupyter_client")}
    load = _common.LoadMonitor()
    result["view"] = view_costs(cfg["view_sizes"], cfg["repeats"])
    result["load_view"] = load.sample()
    if not args.no_real:
        result["real"] = real_runs(sizes, seconds)
        result["load_real"] = load.sample()
    result["ended"] = time.time()
    result["table"] = tables(result)
    path = _common.write_json(args.out, result)
    print(result["table"])
    others = {k: round(v["others_cores"], 2) for k, v in result.items() if k.startswith("load_")}
    print(f"\nother processes' CPU (cores): {others}; every figure: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
