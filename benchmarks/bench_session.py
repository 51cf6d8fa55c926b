#!/usr/bin/env python
"""Warm ranks (``%horovod start``) against fresh ones (``%%horovod --np N``), side by side.

One command, from the repository root:

    .venv/bin/python benchmarks/bench_session.py            # the full run (about 10 minutes on 2 cores)
    .venv/bin/python benchmarks/bench_session.py --quick    # a smoke run (about 3 minutes)

It prints a table and writes every sample to ``artifacts/bench_session.json``
(docs/performance-session.md shows and explains the figures). Every cell goes through a
real IPython shell (``ip.run_cell``, wall time around it: what the kernel spends on the
cell), with one warm embedded SparkSession (``local[4]``: a session's 2 ranks hold 2 task
slots while a fresh ``--np 2`` cell takes 2 more). For each mode, local (``--np -2``)
and Spark (``--np 2``), it measures:

(a) a trivial cell on the session's warm ranks, ``hvd.allreduce`` of one scalar after a
    set-up cell did the imports and ``hvd.init()``: median and p90 over many cells, in the
    text view (``HVDMAGIC_NONINTERACTIVE=1``) and, alternating with it cell by cell, in the
    widget view (``=0``: the dashboard's widgets are built and drawn in this process; no
    front end is attached, so their messages go nowhere), and a no-op cell (``hvd.rank()``,
    no collective) in the text view, for hvdmagic's share without Horovod's. The time inside
    ``Session.run_cell`` (cell sent -> every rank idle again) is recorded too.
(b) a fresh ``%%horovod --np N`` cell doing the same: start the ranks, import torch and
    horovod.torch, ``hvd.init()``, one allreduce (``workloads.TRIVIAL``).
(c) ``%horovod start --np N`` itself, then the set-up cell on the new ranks (the same
    ``workloads.TRIVIAL`` source), and ``%horovod stop``: start, and start + set-up,
    against the fresh cell of (b) of the same round.
(d) training throughput: ``workloads.TRAIN`` (an MLP, batch 64, hvd.DistributedOptimizer,
    ``hvdmagic.progress`` and ``hvdmagic.log_metrics`` every step; steps/s timed inside
    the ranks over the loop only, after 20 warm-up steps) as a session cell and as a fresh
    ``%%horovod --np N`` cell: the very same source. The session's training cell runs on
    ranks that have trained before (from the second training cell of a session on); the
    first training cell after each ``%horovod start`` is recorded beside it.

Each round runs one block of each kind (restart, session cells, fresh cell, session
training, fresh training) in an order that rotates from round to round, so no kind always
follows another; ratios are taken within a round. A session's idle ranks stay up while a
fresh cell runs (as in a notebook), and the fresh ranks are gone while the session works.
The machine's load from other processes is sampled per block. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ["HVDMAGIC_NONINTERACTIVE"] = "1"  # the text view, unless a cell asks for widgets
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

from benchmarks import _common, workloads  # noqa: E402

log = _common.Log("bench_session")

TRIVIAL_CELL = "%%horovod\nhvd.allreduce(torch.tensor(1.0), op=hvd.Sum).item()\n"
NOOP_CELL = "%%horovod\nhvd.rank()\n"
GOAL_CELL_MS = 20.0  # median of (a), text view
BLOCKS = ("restart", "session_cells", "fresh_trivial", "session_train", "fresh_train")


def stats(values) -> dict:
    return _common.describe(values, p10=10, p90=90)


def paired(a: list, b: list) -> dict:
    return _common.paired(a, b, p10=10, p90=90)


class Bench:
    """One IPython shell for the whole run; ``np`` says which mode the blocks run in."""

    def __init__(self):
        import hvdmagic
        from hvdmagic.launch import warm_ranks

        self.np = 0
        self.hvdmagic = hvdmagic
        self.ip = _common.ipython_shell()
        # Time inside Session.run_cell (cell sent over the channel -> every rank idle): the ranks'
        # part of a session cell; the rest of run_cell's wall time is the kernel's.
        self.inner: list[float] = []
        original = warm_ranks.Session.run_cell

        def timed(session_self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(session_self, *args, **kwargs)
            finally:
                self.inner.append(time.perf_counter() - t0)

        warm_ranks.Session.run_cell = timed

    def cell(self, source: str, widgets: bool = False) -> dict:
        os.environ["HVDMAGIC_NONINTERACTIVE"] = "0" if widgets else "1"
        try:
            result, t0, t1 = _common.checked_cell(self.ip, source)
        finally:
            os.environ["HVDMAGIC_NONINTERACTIVE"] = "1"
        return {"wall": t1 - t0, "start": t0, "end": t1, "result": result}

    def line(self, magic_line: str) -> float:
        _, t0, t1 = _common.checked_cell(self.ip, magic_line)
        return t1 - t0

    # -- the blocks -------------------------------------------------------------------
    def restart(self, steps: int) -> dict:
        """(c): stop the running session, start a new one, and run the set-up cell on it; then the
        first training cell on the new ranks (outside (d): it pays the ranks' first use of the
        model, the optimizer and the collectives, which (d)'s warm session cells do not)."""
        stop = self.line("%horovod stop")
        start = self.line(f"%horovod start --np {self.np}")
        setup = self.cell("%%horovod\n" + workloads.TRIVIAL + "RESULT\n")
        ranks = self.hvdmagic.last_run().results
        if [r["value"] for r in ranks] != [float(abs(self.np))] * abs(self.np):
            raise RuntimeError(f"the set-up cell's allreduce gave {ranks}")
        return {"stop": stop, "start": start, "setup": setup["wall"], "start_plus_setup": start + setup["wall"],
                "first_train": self.train(steps, session=True)}

    def session_cells(self, count: int, widgets: bool) -> dict:
        """(a): ``count`` cells per kind, the kinds taking turns cell by cell: the trivial cell in the
        text view, the same in the widget view, and a no-op (``hvd.rank()``, no collective) in the
        text view, which leaves hvdmagic's own share without Horovod's allreduce."""
        kinds = [("text", TRIVIAL_CELL, False, float(abs(self.np))), ("noop", NOOP_CELL, False, 0)]
        if widgets:
            kinds.insert(1, ("widgets", TRIVIAL_CELL, True, float(abs(self.np))))
        out: dict = {f"{kind}{part}": [] for kind in ("text", "widgets", "noop") for part in ("", "_inner")}
        for i in range(count * len(kinds)):
            kind, source, with_widgets, expected = kinds[i % len(kinds)]
            before = len(self.inner)
            run = self.cell(source, widgets=with_widgets)
            if run["result"] != expected:
                raise RuntimeError(f"{source!r} gave {run['result']!r}, not {expected!r}")
            out[kind].append(run["wall"])
            out[f"{kind}_inner"].append(self.inner[-1] if len(self.inner) > before else None)
        return out

    def fresh_trivial(self) -> dict:
        """(b): the same allreduce in a fresh cell, with everything a session did beforehand."""
        run = self.cell(workloads.cell(self.np, workloads.TRIVIAL))
        ranks = self.hvdmagic.last_run().results
        first = max(r["first"] for r in ranks) - run["start"]
        return {"wall": run["wall"], "user_code_after": first}

    def train(self, steps: int, session: bool) -> dict:
        """(d): workloads.TRAIN, as a session cell or as a fresh cell."""
        body = workloads.train(steps)
        source = f"%%horovod\n{body}RESULT\n" if session else workloads.cell(self.np, body)
        run = self.cell(source)
        ranks = self.hvdmagic.last_run().results
        return {"wall": run["wall"], "steps_per_s": statistics.mean(r["steps"] / r["loop_s"] for r in ranks),
                # the cell's wall time in three parts, from the ranks' stamps (the last rank's)
                "to_user_code": max(r["first"] for r in ranks) - run["start"],
                "user_code": max(r["done"] for r in ranks) - max(r["first"] for r in ranks),
                "after_user_code": run["end"] - max(r["done"] for r in ranks),
                "loop_s": max(r["loop_s"] for r in ranks),
                "samples_per_s_total": sum(r["samples_per_s"] for r in ranks),
                "cpu_ms_per_step": statistics.mean(r["cpu_ms_per_step"] for r in ranks),
                "torch_threads": [r["torch_threads"] for r in ranks]}


PARTS = {"cells": ("session_cells", "fresh_trivial"), "start": ("restart", "fresh_trivial"),
         "train": ("session_train", "fresh_train")}


def bench_mode(bench: Bench, np: int, rounds: int, cells: int, steps: int, widgets: bool,
               parts: tuple[str, ...] = tuple(PARTS)) -> dict:
    mode = "local" if np < 0 else "spark"
    bench.np = np
    blocks = [b for b in BLOCKS if any(b in PARTS[part] for part in parts)]
    load = _common.LoadMonitor()
    log(f"{mode}: warm-up (a fresh cell, a session, a few cells on it, a short training run of each kind)")
    bench.fresh_trivial()
    bench.line(f"%horovod start --np {np}")
    bench.cell("%%horovod\n" + workloads.TRIVIAL + "RESULT\n")
    bench.session_cells(5, widgets)
    bench.train(max(steps // 5, 20), session=True)
    bench.train(max(steps // 5, 20), session=False)
    load.sample()

    samples: dict = {"restart": [], "session_cells": [], "fresh_trivial": [], "session_train": [],
                     "fresh_train": [], "load": []}
    for r in range(rounds):
        order = _common.rotated(blocks, r)
        log(f"{mode}: round {r + 1}/{rounds}: {', '.join(order)}")
        loads = {}
        for block in order:
            if block == "restart":
                out = bench.restart(steps)
                log(f"  %horovod start {out['start']:.2f} s, + set-up cell {out['start_plus_setup']:.2f} s, "
                    f"stop {out['stop']:.2f} s; the first training cell on the new ranks "
                    f"{out['first_train']['wall']:.1f} s ({out['first_train']['steps_per_s']:.1f} steps/s)")
            elif block == "session_cells":
                out = bench.session_cells(cells, widgets)
                log(f"  {len(out['text'])} session cells of each kind, median: text view "
                    f"{1e3 * statistics.median(out['text']):.1f} ms"
                    + (f", widgets {1e3 * statistics.median(out['widgets']):.1f} ms" if out["widgets"] else "")
                    + f", no-op {1e3 * statistics.median(out['noop']):.1f} ms")
            elif block == "fresh_trivial":
                out = bench.fresh_trivial()
                log(f"  fresh %%horovod --np {np} cell {out['wall']:.2f} s")
            else:
                out = bench.train(steps, session=block == "session_train")
                log(f"  {block}: {out['steps_per_s']:.1f} steps/s per rank (cell {out['wall']:.1f} s: "
                    f"{out['to_user_code']:.1f} s to user code, {out['user_code']:.1f} s in it, of which "
                    f"{out['loop_s']:.1f} s timed, {out['after_user_code']:.1f} s after)")
            samples[block].append(out)
            loads[block] = load.sample()
        samples["load"].append(loads)
    bench.line("%horovod stop")

    cells = samples["session_cells"]
    trains = {"session": samples["session_train"], "fresh": samples["fresh_train"],
              "first_after_start": [s["first_train"] for s in samples["restart"]]}

    def flat(key: str) -> list:
        return [x for block in cells for x in block[key] if x is not None]

    def kernel(kind: str) -> list:  # run_cell's wall time less Session.run_cell's
        return [w - i for block in cells for w, i in zip(block[kind], block[f"{kind}_inner"]) if i is not None]

    def col(block: str, key: str) -> list:
        return [s[key] for s in samples[block]]

    def train(kind: str, key: str) -> list:
        return [s[key] for s in trains[kind]]

    fresh = col("fresh_trivial", "wall")
    round_median = [statistics.median(block["text"]) for block in cells]
    loads = [x for block_loads in samples["load"] for x in block_loads.values()]
    summary = {
        "session_cell_text_s": stats(flat("text")),
        "session_cell_text_inner_s": stats(flat("text_inner")),
        "session_cell_text_kernel_s": stats(kernel("text")),
        "session_cell_text_round_medians_s": stats(round_median),
        "session_cell_widgets_s": stats(flat("widgets")),
        "session_cell_widgets_inner_s": stats(flat("widgets_inner")),
        "session_cell_widgets_kernel_s": stats(kernel("widgets")),
        "session_cell_noop_s": stats(flat("noop")),
        "session_cell_noop_inner_s": stats(flat("noop_inner")),
        "fresh_cell_s": stats(fresh),
        "fresh_user_code_after_s": stats(col("fresh_trivial", "user_code_after")),
        "start_s": stats(col("restart", "start")),
        "setup_cell_s": stats(col("restart", "setup")),
        "start_plus_setup_s": stats(col("restart", "start_plus_setup")),
        "stop_s": stats(col("restart", "stop")),
        "start_over_fresh": paired(col("restart", "start"), fresh),
        "start_plus_setup_over_fresh": paired(col("restart", "start_plus_setup"), fresh),
        "fresh_over_session_cell": paired(fresh, round_median),
        "train_steps_per_s_session": stats(train("session", "steps_per_s")),
        "train_steps_per_s_fresh": stats(train("fresh", "steps_per_s")),
        "train_session_over_fresh": paired(train("session", "steps_per_s"), train("fresh", "steps_per_s")),
        "train_cpu_ms_per_step_session": stats(train("session", "cpu_ms_per_step")),
        "train_cpu_ms_per_step_fresh": stats(train("fresh", "cpu_ms_per_step")),
        "train_cpu_session_over_fresh": paired(train("session", "cpu_ms_per_step"), train("fresh", "cpu_ms_per_step")),
        "train_cell_wall_s_session": stats(train("session", "wall")),
        "train_cell_wall_s_fresh": stats(train("fresh", "wall")),
        "train_cell_phases_s": {name: {part: stats(train(kind, part))
                                       for part in ("to_user_code", "user_code", "loop_s", "after_user_code")}
                                for name, kind in (("session_train", "session"), ("fresh_train", "fresh"),
                                                   ("first_train_after_start", "first_after_start"))},
        "first_train_after_start_wall_s": stats(train("first_after_start", "wall")),
        # the cell's wall time outside the timed loop: launch, imports, model, optimizer, warm-up steps
        "train_outside_loop_s": {kind: stats([s["wall"] - s["loop_s"] for s in runs]) for kind, runs in trains.items()},
        "first_train_after_start_steps_per_s": stats(train("first_after_start", "steps_per_s")),
        "torch_threads": {kind: trains[kind][0]["torch_threads"] if trains[kind] else None
                          for kind in ("session", "fresh")},
        "others_cores": stats([x["others_cores"] for x in loads]),
        "load1": stats([x["load1"] for x in loads]),
    }
    return {"np": np, "samples": samples, "summary": summary}


# ---------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------

def ms(s: dict, key: str = "median") -> str:
    return "-" if not s.get("n") else f"{1e3 * s[key]:.1f}"


def sec(s: dict) -> str:
    return "-" if not s.get("n") else f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def ratio(s: dict) -> str:
    if not s.get("n"):
        return "-"
    ci = s.get("median_ci95")
    return f"{s['median']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f" [{s['min']:.3f}-{s['max']:.3f}]")


def table(result: dict) -> str:
    modes = list(result["modes"])
    heads = {m: f"{m} (--np {result['modes'][m]['np']})" for m in modes}
    rows: list[tuple[str, ...]] = []

    def row(label: str, fn) -> None:
        rows.append((label, *(fn(result["modes"][m]["summary"]) for m in modes)))

    row("(a) trivial session cell, text view: median / p90 ms",
        lambda s: f"{ms(s['session_cell_text_s'])} / {ms(s['session_cell_text_s'], 'p90')}"
                  f"  (n={s['session_cell_text_s'].get('n', 0)})")
    row("    of which in Session.run_cell (ranks): median ms", lambda s: ms(s["session_cell_text_inner_s"]))
    row("    the kernel's rest (magic, capture, view): median ms", lambda s: ms(s["session_cell_text_kernel_s"]))
    row("(a) trivial session cell, widget view: median / p90 ms",
        lambda s: f"{ms(s['session_cell_widgets_s'])} / {ms(s['session_cell_widgets_s'], 'p90')}"
                  f"  (n={s['session_cell_widgets_s'].get('n', 0)})")
    row("    the kernel's rest, widget view: median ms", lambda s: ms(s["session_cell_widgets_kernel_s"]))
    row("    no-op session cell (hvd.rank()), text: median / p90 ms",
        lambda s: f"{ms(s['session_cell_noop_s'])} / {ms(s['session_cell_noop_s'], 'p90')}")
    row("(b) fresh %%horovod --np N cell: median [min-max] s", lambda s: sec(s["fresh_cell_s"]))
    row("(c) %horovod start: s", lambda s: sec(s["start_s"]))
    row("    start + set-up cell (imports, hvd.init()): s", lambda s: sec(s["start_plus_setup_s"]))
    row("    %horovod stop: s", lambda s: sec(s["stop_s"]))
    row("    start / fresh cell, per round", lambda s: ratio(s["start_over_fresh"]))
    row("    (start + set-up) / fresh cell, per round", lambda s: ratio(s["start_plus_setup_over_fresh"]))
    row("(d) training steps/s per rank, session: median [min-max]", lambda s: sec(s["train_steps_per_s_session"]))
    row("    training steps/s per rank, fresh cell", lambda s: sec(s["train_steps_per_s_fresh"]))
    row("    session / fresh, per round", lambda s: ratio(s["train_session_over_fresh"]))
    row("    CPU ms per step (a rank, all threads), session / fresh",
        lambda s: ratio(s["train_cpu_session_over_fresh"]))
    row("    training cell wall s, session (warm)", lambda s: sec(s["train_cell_wall_s_session"]))
    row("    training cell wall s, fresh cell", lambda s: sec(s["train_cell_wall_s_fresh"]))
    row("    training cell wall s, first on a new session", lambda s: sec(s["first_train_after_start_wall_s"]))
    row("    training cell wall s outside the loop, session", lambda s: sec(s["train_outside_loop_s"]["session"]))
    row("    ... fresh cell", lambda s: sec(s["train_outside_loop_s"]["fresh"]))
    row("    ... first on a new session", lambda s: sec(s["train_outside_loop_s"]["first_after_start"]))
    row("other processes' CPU, cores: median [min-max]", lambda s: sec(s["others_cores"]))
    widths = [max(len(r[i]) for r in rows + [("", *heads.values())]) for i in range(len(modes) + 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(("", *heads.values()), widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    goals = []
    for m in modes:
        s = result["modes"][m]["summary"]
        if s["session_cell_text_s"].get("n"):
            median = 1e3 * s["session_cell_text_s"]["median"]
            goals.append(f"{m}: trivial session cell {median:.1f} ms median, goal <= {GOAL_CELL_MS:.0f} ms: "
                         f"{'met' if median <= GOAL_CELL_MS else 'NOT met'}")
        if s["start_over_fresh"].get("n"):
            goals.append(f"{m}: %horovod start / fresh cell {s['start_over_fresh']['median']:.3f}, goal <= 1: "
                         f"{'met' if s['start_over_fresh']['median'] <= 1 else 'NOT met'}")
        if s["train_session_over_fresh"].get("n"):
            goals.append(f"{m}: training session / fresh {ratio(s['train_session_over_fresh'])}, goal: the same")
    return "\n".join(lines + [""] + goals)


# option: (full-run default, --quick default, help)
COUNTS = {"rounds": (5, 2, "rounds per mode {}"),
          "cells": (40, 10, "trivial session cells per view per round {}"),
          "steps": (300, 100, "training steps per run {}")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds, 10 cells, 100 steps")
    _common.add_counts(parser, COUNTS)
    parser.add_argument("--modes", default="local,spark", help="comma-separated: local (--np -2), spark (--np 2)")
    parser.add_argument("--no-widgets", action="store_true", help="skip the widget view")
    parser.add_argument("--parts", default="cells,start,train",
                        help="comma-separated: cells ((a) and (b)), start ((b) and (c)), train ((d))")
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench_session.json"))
    args = parser.parse_args(argv)
    cfg = {
        "quick": args.quick,
        **_common.counts(args, COUNTS),
        "modes": [m.strip() for m in args.modes.split(",") if m.strip()],
        "widgets": not args.no_widgets,
        "parts": [p.strip() for p in args.parts.split(",") if p.strip()],
        "command": _common.command_line(),
    }
    result: dict = {"config": cfg, "started": time.time(),
                    "environment": _common.environment("torch", "horovod", "pyspark",
                                                       OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS")),
                    "modes": {}}
    if "spark" in cfg["modes"]:
        log("starting the embedded SparkSession (local[4]): a session's 2 slots + a fresh cell's 2")
        t = time.time()
        _common.start_spark(4)
        result["spark_start_s"] = time.time() - t
    bench = Bench()
    for mode in cfg["modes"]:
        np = {"local": -2, "spark": 2}[mode]
        result["modes"][mode] = bench_mode(bench, np, cfg["rounds"], cfg["cells"], cfg["steps"], cfg["widgets"],
                                           tuple(cfg["parts"]))
        _common.write_json(args.out, result)  # what is done so far survives a later failure
    result["ended"] = time.time()
    result["table"] = table(result)
    path = _common.write_json(args.out, result)
    print(result["table"])
    print(f"\nevery sample: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
