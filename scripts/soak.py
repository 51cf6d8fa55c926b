"""Soak test: many %%horovod cells with random faults in one IPython shell.

Not part of the test suite. It runs ``--cells`` cells (default 100) in one real
IPython shell with hvdmagic loaded, alternating at random between Spark mode
(``--np 2``) and local mode (``--np -2``), each cell with one fault drawn from a
seeded mix (``--seed``), and checks every outcome against what the fault must
produce. It measures how fast each fault is detected, counts rank processes
left behind after each cell, and compares the process's threads, sockets, fds
and children before (after warm-up) and after the run.

    .venv/bin/python scripts/soak.py [--cells 100] [--seed 1]

The fault scenarios, each a cell and the check of its outcome, are
tests/fault_scenarios.py's: tests/test_faults.py runs the same ones.

It prints a table at the end and writes everything to artifacts/soak.json
(per-cell records too); the output of every cell goes to artifacts/soak-cells.log.
Exit status 0 when every cell ended as expected and nothing leaked, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The scenarios and the resource counts are the tests' own (tests/); the helpers, the benchmarks'.
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("HVDMAGIC_NONINTERACTIVE", "1")
# Every rank started from this process inherits this token (through the Spark JVM
# and its Python workers too), so a rank orphaned away from our process tree is
# still found and attributed to us, not to other work on the machine.
SOAK_TOKEN = uuid.uuid4().hex
os.environ["HVDMAGIC_SOAK_TOKEN"] = SOAK_TOKEN

import psutil  # noqa: E402
from fault_scenarios import FLOOD_LINES, SCENARIOS, Outcome  # noqa: E402
from procs import kernel_resources  # noqa: E402

from benchmarks import _common  # noqa: E402

HANG_TIMEOUT = 8  # --timeout of the hang cells
STALL_TIMEOUT = 6  # --stall-timeout of the deadlock cells
SAFETY_TIMEOUT = 60  # --timeout on cells that must end by themselves (early exit): a hang still ends
CELL_LIMIT = 150  # the soak's own watchdog: a cell still running after this is interrupted (SIGINT)
# The limit each scenario's option gets (tests/fault_scenarios.py: Scenario.option).
LIMITS = {"hang_timeout": HANG_TIMEOUT, "stall_timeout": STALL_TIMEOUT, "early_exit": SAFETY_TIMEOUT}
fmt = _common.num  # a figure in the table

# kind -> weight in the mix (every kind appears at least once whatever --cells is)
KINDS = {
    "none": 26,
    "raise": 14,
    "sigkill": 12,
    "exit_code": 8,
    "early_exit": 10,
    "hang_timeout": 10,
    "stall_timeout": 10,
    "log_flood": 10,
}
assert set(KINDS) == set(SCENARIOS), "every scenario of tests/fault_scenarios.py needs a weight"
# The faults that end one rank, and how that rank's own failure reads.
OWN_FAILURE = {kind: SCENARIOS[kind].own_failure for kind in KINDS if SCENARIOS[kind].own_failure}


# --------------------------------------------------------------------------- cells

def attribution(kind: str, r: int, error) -> str | None:
    """For the faults that end one rank: is that rank's own failure the one the cell names first?

    "first": the headline names it; "later": it is listed, after a collateral failure of
    another rank (e.g. HorovodInternalError in the survivor); "lost": it is not among the
    failures at all (reported as "stopped", or missing).
    """
    from hvdmagic.errors import JobFailed

    own = OWN_FAILURE.get(kind)
    if own is None or not isinstance(error, JobFailed):
        return None
    mine = [i for i, f in enumerate(error.failures) if f.rank == r and f.summary.startswith(own)]
    if not mine:
        return "lost"
    return "first" if mine[0] == 0 else "later"


def check(kind: str, r: int, result, error, output: str) -> tuple[bool, str]:
    """Whether the outcome is the one this fault must produce (the scenario's check), and what was seen."""
    seen = f"{type(error).__name__}: {error}" if error is not None else f"ok: {result!r}"
    try:
        SCENARIOS[kind].check(Outcome(result, error, output, r, LIMITS.get(kind)))
    except AssertionError as exc:
        return False, f"{seen} (check: {exc})" if str(exc) else seen
    return True, seen


# --------------------------------------------------------------------------- resources

def is_rank(cmdline) -> bool:
    return _common.process_role(" ".join(cmdline or ())) == "rank"


def our_rank_processes() -> list[psutil.Process]:
    """Rank processes started by this soak: descendants, plus orphans carrying our token."""
    found = {}
    for proc in _common.process_tree()[1:]:
        try:
            if is_rank(proc.cmdline()) and proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = proc
        except psutil.Error:
            continue
    for proc in psutil.process_iter(["cmdline"]):
        if proc.pid in found:
            continue
        try:
            if is_rank(proc.info["cmdline"]):
                if proc.environ().get("HVDMAGIC_SOAK_TOKEN") == SOAK_TOKEN and proc.status() != psutil.STATUS_ZOMBIE:
                    found[proc.pid] = proc
        except psutil.Error:
            continue
    return list(found.values())


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def resources() -> dict[str, int]:
    """The tests' counts (Python threads, inet sockets, fds, children), and OS threads,
    rank processes and RSS."""
    me = psutil.Process(os.getpid())
    counts = kernel_resources()
    return {
        "threads": counts["threads"],
        "os_threads": me.num_threads(),
        **counts,
        "rank_processes": len(our_rank_processes()),
        "rss_mib": me.memory_info().rss // (1 << 20),
    }


def active_spark_jobs() -> int | None:
    from hvdmagic.launch import spark_session as spark

    session = spark._embedded
    if session is None:
        return None
    try:
        return len(session.sparkContext.statusTracker().getActiveJobsIds())
    except Exception:
        return None


# --------------------------------------------------------------------------- running

class _Observed:
    """Wraps the cell's real view and timestamps the first failure event the driver handles.

    Observation only: every event still goes to hvdmagic's own view unchanged.
    """

    first_failure_at: float | None = None

    def __init__(self, view):
        self._view = view

    def __getattr__(self, name):
        return getattr(self._view, name)

    def on_event(self, event: dict) -> None:
        failed = event.get("type") == "error" or (event.get("type") == "exit" and event.get("code") not in (0, None))
        if failed and _Observed.first_failure_at is None:
            _Observed.first_failure_at = time.time()
        self._view.on_event(event)


def observe_views() -> None:
    import hvdmagic.kernel.runner

    make_view = hvdmagic.kernel.runner.make_view
    hvdmagic.kernel.runner.make_view = lambda record: _Observed(make_view(record))


class CellWatchdog:
    """Interrupts a cell (SIGINT, like the notebook's stop button) that runs past CELL_LIMIT."""

    def __init__(self, log):
        self.fired = False
        self._log = log
        self._timer: threading.Timer | None = None

    def __enter__(self):
        self.fired = False
        self._timer = threading.Timer(CELL_LIMIT, self._fire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def _fire(self):
        self.fired = True
        frames = sys._current_frames()
        self._log.write(f"\n!!! soak watchdog: cell still running after {CELL_LIMIT} s; thread stacks:\n")
        for thread in threading.enumerate():
            frame = frames.get(thread.ident)
            if frame is not None:
                self._log.write(f"--- {thread.name}\n{''.join(traceback.format_stack(frame))}")
        self._log.flush()
        os.kill(os.getpid(), signal.SIGINT)

    def __exit__(self, *exc):
        self._timer.cancel()
        return False


def run_cell(ip, cell: str, log, watchdog: CellWatchdog):
    """Run one cell in the shell; return (result, error, output text, started wall clock, ended)."""
    _Observed.first_failure_at = None
    with watchdog:
        outcome, output, started, ended = _common.run_cell(ip, cell)
    log.write(output if len(output) < 200_000 else output[:200_000] + "\n... (log truncated)\n")
    log.flush()
    return outcome.result, outcome.error_in_exec, output, started, ended


def schedule(cells: int, rng: random.Random) -> list[tuple[str, int, int]]:
    """(kind, np argument, faulty rank) per cell: every kind at least once, then by weight."""
    kinds = list(KINDS)[:cells]
    weights = list(KINDS.values())
    kinds += rng.choices(list(KINDS), weights=weights, k=cells - len(kinds))
    rng.shuffle(kinds)
    return [(kind, rng.choice((2, -2)), rng.randrange(2)) for kind in kinds]


def percentile_summary(values: list[float]) -> dict[str, float | None]:
    s = _common.describe(values)
    if not s["n"]:
        return {"median": None, "worst": None}
    return {"median": round(s["median"], 3), "worst": round(s["max"], 3)}


def summarise(records: list[dict]) -> dict:
    out = {}
    for kind in KINDS:
        rows = [r for r in records if r["kind"] == kind]
        out[kind] = {
            "expected_outcome": SCENARIOS[kind].describe(LIMITS.get(kind)),
            "cells": len(rows),
            "spark": sum(r["mode"] == "spark" for r in rows),
            "local": sum(r["mode"] == "local" for r in rows),
            "as_expected": sum(r["as_expected"] for r in rows),
            "unexpected": sum(not r["as_expected"] for r in rows),
            "fault_attribution": {a: sum(r["fault_attribution"] == a for r in rows) for a in ("first", "later", "lost")}
            if kind in OWN_FAILURE else None,
            "latency_s": percentile_summary([r["latency_s"] for r in rows if r["latency_s"] is not None]),
            "overshoot_s": percentile_summary([r["overshoot_s"] for r in rows if r["overshoot_s"] is not None]),
            "duration_s": percentile_summary([r["duration_s"] for r in rows]),
            "driver_saw_failure_s": percentile_summary([r["driver_saw_failure_s"] for r in rows
                                                        if r["driver_saw_failure_s"] is not None]),
            "teardown_s": percentile_summary([r["teardown_s"] for r in rows if r["teardown_s"] is not None]),
            "by_mode": {
                mode: {
                    "latency_s": percentile_summary([r["latency_s"] for r in rows
                                                     if r["mode"] == mode and r["latency_s"] is not None]),
                    "overshoot_s": percentile_summary([r["overshoot_s"] for r in rows
                                                       if r["mode"] == mode and r["overshoot_s"] is not None]),
                }
                for mode in ("spark", "local")
            },
        }
    return out


def print_table(summary: dict, records: list[dict], before: dict, after: dict, peak: dict) -> None:
    print()
    header = (f"{'fault kind':<14} {'cells':>5} {'spark':>5} {'local':>5} {'ok':>4} {'bad':>4} "
              f"{'latency med':>11} {'worst':>6} {'overshoot med':>13} {'worst':>6} "
              f"{'seen med':>8} {'worst':>6} {'teardown med':>12} {'worst':>6} {'cell med':>8} {'worst':>6}")
    print(header)
    print("-" * len(header))
    for kind, s in summary.items():
        print(f"{kind:<14} {s['cells']:>5} {s['spark']:>5} {s['local']:>5} {s['as_expected']:>4} {s['unexpected']:>4} "
              f"{fmt(s['latency_s']['median']):>11} {fmt(s['latency_s']['worst']):>6} "
              f"{fmt(s['overshoot_s']['median']):>13} {fmt(s['overshoot_s']['worst']):>6} "
              f"{fmt(s['driver_saw_failure_s']['median']):>8} {fmt(s['driver_saw_failure_s']['worst']):>6} "
              f"{fmt(s['teardown_s']['median']):>12} {fmt(s['teardown_s']['worst']):>6} "
              f"{fmt(s['duration_s']['median']):>8} {fmt(s['duration_s']['worst']):>6}")
    total_ok = sum(r["as_expected"] for r in records)
    print("-" * len(header))
    print(f"{'total':<14} {len(records):>5} {sum(r['mode'] == 'spark' for r in records):>5} "
          f"{sum(r['mode'] == 'local' for r in records):>5} {total_ok:>4} {len(records) - total_ok:>4}")
    print("latency: fault stamp (time.time() written by the rank just before the fault) -> cell returned, seconds;")
    print(f"overshoot: hang cells, cell duration - --timeout {HANG_TIMEOUT}; stall cells, latency - "
          f"--stall-timeout {STALL_TIMEOUT}.")
    print("seen: fault stamp -> the driver handled the first error / non-zero exit event; "
          "teardown: that event -> cell returned.")
    for kind in OWN_FAILURE:
        a = summary[kind]["fault_attribution"]
        print(f"{kind}: the faulty rank's own failure named first {a['first']}, listed after a collateral "
              f"failure {a['later']}, missing (reported as stopped) {a['lost']}")
    leaked = sum(r["leaked_at_return"] for r in records)
    lingering = sum(r["leaked_after_10s"] for r in records)
    spark_jobs = sum(1 for r in records if r["active_spark_jobs"])
    print(f"rank processes alive when a cell returned: {leaked} (still alive 10 s later: {lingering}); "
          f"cells leaving an active Spark job: {spark_jobs}")
    print(f"{'resource':<16} {'start':>7} {'end':>7} {'growth':>7} {'peak':>7}")
    for key in before:
        print(f"{key:<16} {before[key]:>7} {after[key]:>7} {after[key] - before[key]:>+7} {peak[key]:>7}")
    bad = [r for r in records if not r["as_expected"]]
    if bad:
        print("\nunexpected outcomes:")
        for r in bad:
            print(f"  cell {r['cell']:>3} {r['mode']:<5} {r['kind']:<13} r={r['rank']}: {r['seen'][:300]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, default=100, help="how many cells to run (default 100)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the fault mix (default 1)")
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "soak.json"), help="where to write the JSON")
    args = parser.parse_args()
    if args.cells < 1:
        parser.error("--cells must be at least 1")
    if not __debug__:
        parser.error("the scenarios' checks are assert statements: run without python -O")

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    log_path = out_path.with_name(out_path.stem + "-cells.log")
    log = open(log_path, "w", encoding="utf-8")
    rng = random.Random(args.seed)
    plan = schedule(args.cells, rng)
    stamps = Path(tempfile.mkdtemp(prefix="hvdmagic-soak-"))
    real_stdout = sys.stdout

    def say(text: str) -> None:
        real_stdout.write(text + "\n")
        real_stdout.flush()

    ip = _common.ipython_shell()
    observe_views()
    watchdog = CellWatchdog(log)
    soak_started = time.time()

    # Warm-up: the Spark session, its JVM and Python workers, horovod's imports.
    say(f"soak: hvdmagic from {_common.code_under_test()}")
    say(f"soak: {args.cells} cells, seed {args.seed}; warming up (embedded Spark start, one cell per mode)")
    warmup = []
    for np_arg in (2, -2):
        cell = SCENARIOS["none"].cell(np_arg, 0, stamps / "warm-up")
        log.write(f"\n===== warm-up --np {np_arg}\n")
        result, error, _, t0, t1 = run_cell(ip, cell, log, watchdog)
        warmup.append({"np": np_arg, "ok": error is None and result == 3.0, "duration_s": round(t1 - t0, 2),
                       "error": None if error is None else f"{type(error).__name__}: {error}"})
        say(f"  warm-up --np {np_arg}: {'ok' if warmup[-1]['ok'] else warmup[-1]['error']} in {t1 - t0:.1f} s")
    gc.collect()
    time.sleep(1)
    before = resources()
    peak = dict(before)
    say(f"  baseline: {before}")

    records = []
    for index, (kind, np_arg, r) in enumerate(plan, 1):
        mode = "spark" if np_arg > 0 else "local"
        stamp = stamps / f"cell{index}"
        configured = LIMITS.get(kind)
        cell = SCENARIOS[kind].cell(np_arg, r, stamp, configured)
        log.write(f"\n===== cell {index}: {mode} {kind} rank {r}\n{cell}\n")
        result, error, output, t0, t1 = run_cell(ip, cell, log, watchdog)
        interrupted = watchdog.fired
        as_expected, seen = check(kind, r, result, error, output)
        attributed = attribution(kind, r, error)
        if interrupted:
            as_expected, seen = False, f"soak watchdog interrupted the cell after {CELL_LIMIT} s; " + seen
        fault_at = float(stamp.read_text()) if stamp.exists() else None
        latency = None if fault_at is None else t1 - fault_at  # none and log_flood write no stamp
        first_failure = _Observed.first_failure_at
        # For the faults that end a rank: how long until the driver handled the first failure
        # event (error, or a non-zero exit), and how long the teardown took after it.
        seen_after = None if latency is None or first_failure is None or SCENARIOS[kind].times_out \
            else first_failure - fault_at
        teardown = None if seen_after is None else t1 - first_failure
        overshoot = None
        if kind == "hang_timeout":
            overshoot = (t1 - t0) - configured
        elif kind == "stall_timeout" and latency is not None:
            overshoot = latency - configured

        leaked = our_rank_processes()
        leaked_pids = [p.pid for p in leaked]
        lingering = []
        if leaked:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                lingering = [p for p in leaked if alive(p)]
                if not lingering:
                    break
                time.sleep(0.2)
            for proc in lingering:  # so one leak does not disturb the cells after it
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        spark_jobs = active_spark_jobs()
        now = resources()
        for key in peak:
            peak[key] = max(peak[key], now[key])
        record = {
            "cell": index, "kind": kind, "mode": mode, "np": np_arg, "rank": r,
            "as_expected": as_expected, "seen": seen, "fault_attribution": attributed,
            "failures": ([{"rank": f.rank, "summary": f.summary[:200]} for f in getattr(error, "failures", [])]
                         if error is not None else []),
            "stopped": list(getattr(error, "stopped", []) or []), "error_type": type(error).__name__ if error else None,
            "duration_s": round(t1 - t0, 3),
            "latency_s": None if latency is None else round(latency, 3),
            "overshoot_s": None if overshoot is None else round(overshoot, 3),
            "driver_saw_failure_s": None if seen_after is None else round(seen_after, 3),
            "teardown_s": None if teardown is None else round(teardown, 3),
            "fault_stamp_written": fault_at is not None,
            "leaked_at_return": len(leaked), "leaked_pids": leaked_pids, "leaked_after_10s": len(lingering),
            "active_spark_jobs": spark_jobs or 0, "interrupted_by_soak": interrupted,
            "resources": now,
        }
        records.append(record)
        lat = f"latency {latency:5.2f} s" if latency is not None else " " * 15
        over = f" overshoot {overshoot:+5.2f} s" if overshoot is not None else ""
        say(f"[{index:>3}/{args.cells}] {mode:<5} {kind:<13} r={r} {'ok ' if as_expected else 'BAD'} "
            f"{t1 - t0:5.1f} s {lat}{over} leaked {len(leaked)} threads {now['threads']} "
            f"fds {now['fds']} sockets {now['sockets']} children {now['children']}"
            + ("" if as_expected else f"\n      saw: {seen[:400]}"))

    gc.collect()
    time.sleep(1)
    after = resources()
    for key in peak:
        peak[key] = max(peak[key], after[key])
    summary = summarise(records)
    print_table(summary, records, before, after, peak)

    report = {
        "command": _common.command_line(),
        "cells": args.cells, "seed": args.seed,
        "started": dt.datetime.fromtimestamp(soak_started, dt.UTC).isoformat(timespec="seconds"),
        "wall_s": round(time.time() - soak_started, 1),
        "machine": {**_common.machine(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
        "hvdmagic": _common.code_under_test(),
        "config": {"hang_timeout_s": HANG_TIMEOUT, "stall_timeout_s": STALL_TIMEOUT,
                   "safety_timeout_s": SAFETY_TIMEOUT, "cell_limit_s": CELL_LIMIT, "flood_lines": FLOOD_LINES},
        "warmup": warmup,
        "summary": summary,
        "as_expected": sum(r["as_expected"] for r in records),
        "unexpected": sum(not r["as_expected"] for r in records),
        "leaked_rank_processes_at_return": sum(r["leaked_at_return"] for r in records),
        "leaked_rank_processes_after_10s": sum(r["leaked_after_10s"] for r in records),
        "cells_leaving_active_spark_jobs": sum(1 for r in records if r["active_spark_jobs"]),
        "resources": {"start": before, "end": after, "growth": {k: after[k] - before[k] for k in before},
                      "peak": peak},
        "records": records,
    }
    _common.write_json(out_path, report, indent=2)
    say(f"\nwrote {out_path} ({report['wall_s']:.0f} s wall); cell output in {log_path}")
    log.close()
    shutil.rmtree(stamps, ignore_errors=True)
    from hvdmagic.launch import spark_session as spark

    if spark._embedded is not None:
        with contextlib.suppress(Exception):
            spark._embedded.stop()
    clean = report["unexpected"] == 0 and report["leaked_rank_processes_at_return"] == 0
    return 0 if clean else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # The embedded Spark JVM and its threads can keep the interpreter waiting at exit.
    os._exit(code)
