#!/usr/bin/env python
"""Benchmark of the in-rank reporting API: ``log_metrics``, ``progress`` and ``track``.

One command, from the repository root:

    .venv/bin/python benchmarks/bench_report.py           # the full run (about 12 minutes on 2 cores)
    .venv/bin/python benchmarks/bench_report.py --quick   # a smoke run in local mode (under a minute)

It prints a table and writes every figure to ``artifacts/bench_report.json``;
docs/performance.md explains the figures. What is measured:

1. Cost per call, inside a real rank (``hvdmagic.run(fn, np=-1)``, so the event
   pipe and the background flusher are live) and in this process, where no event
   pipe exists and the calls are no-ops. Each sample times ``--calls`` calls with
   ``time.perf_counter_ns``; the variants take turns within every round.
2. The cost of one metric event on each hop to the run record (rank encode,
   supervisor decode and re-send, driver receive, ``RunRecord.apply``), replayed
   in this process with the real code, the record's memory per row, and one
   widget dashboard redraw.
3. Training overhead: ``--np`` ranks each run a fixed CPU training step
   (Linear 256->256, ReLU, Linear 256->256, batch 64, SGD; one torch thread) for
   ``--duration`` seconds, with and without the reporting calls, alternating
   bare/report runs ``--pairs`` times per mode (local ``np=-N`` and Spark ``np=N``),
   then one ``--interleaved``-second run per mode made of blocks of three
   ``--segment``-second segments (bare, bare again, report) in random order: the
   report/bare ratio per block is the A/B, the bare-again/bare ratio is an A/A
   control that shows the noise of the same statistic.
   With reporting, rank 0 calls ``log_metrics`` after each step as many times as
   keeps it at ``--rate`` events per second, and every rank calls ``progress``
   once per step. The bare variant runs the same loop, pacing arithmetic included,
   without the calls. After each reporting run the driver's record must hold exactly
   the events rank 0 sent, each step once and in order.
4. Driver responsiveness during those runs: a thread in this process sleeps 10 ms
   at a time and records how late it wakes; a sampler records the CPU time of
   this process (minus the two measuring threads) and of its child processes, and
   a gc callback records this process's garbage-collection pauses.

Timings are never asserted; the only hard check is that no metric is lost (the
exit status is 1 if one was).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this repository, for benchmarks._common

os.environ["HVDMAGIC_NONINTERACTIVE"] = "1"  # the text view: no widgets in a benchmark
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

import cloudpickle
import psutil

import hvdmagic
from benchmarks import _common
from benchmarks._common import GcPauses, bootstrap_median_ci, paired_ratios, thread_cpu
from hvdmagic.launch.placement import Placement
from hvdmagic.metric_rows import MetricRows
from hvdmagic.rank import telemetry

# The rank-side functions below use thread_cpu and GcPauses: ship that module by value
# with them, since a rank cannot import this benchmark's package.
cloudpickle.register_pickle_by_value(_common)

ROOT = _common.ROOT


# ---------------------------------------------------------------------------
# Functions that run inside a rank. They are defined in __main__, so cloudpickle
# ships them by value; what they need is imported inside them, or comes from
# benchmarks._common, which is shipped by value too.
# ---------------------------------------------------------------------------

def call_costs(rounds: int, batch: int) -> dict:
    """Nanoseconds per call of each reporting call, one sample per ``batch`` calls.

    Every round takes one sample of each variant, in a rotating order, so slow
    phases of a shared machine hit all variants alike.
    """
    import time

    import hvdmagic
    from hvdmagic.rank import telemetry

    clock = time.perf_counter_ns
    log_metrics, progress, track = hvdmagic.log_metrics, hvdmagic.progress, hvdmagic.track
    x = 0.5

    def empty_loop():
        t = clock()
        for _i in range(batch):
            pass
        return clock() - t

    def log_metrics_loop():
        t = clock()
        for i in range(batch):
            log_metrics(step=i, loss=x)
        return clock() - t

    def progress_loop():
        t = clock()
        for i in range(batch):
            progress(i, total=batch)
        return clock() - t

    def track_loop():
        t = clock()
        for _ in track(range(batch)):
            pass
        return clock() - t

    variants = {"empty_loop": empty_loop, "log_metrics": log_metrics_loop,
                "progress": progress_loop, "track": track_loop}
    names = list(variants)
    samples = {name: [] for name in names}
    for _ in range(max(1, rounds // 20)):  # warm-up, not recorded
        for name in names:
            variants[name]()
    for r in range(rounds):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            samples[name].append(variants[name]() / batch)
    return {"live": telemetry._events is not None, "batch": batch, "rounds": rounds,
            "log_metrics_calls": batch * (rounds + max(1, rounds // 20)), "ns_per_call": samples}


def train(duration: float, batch: int, rate: float, reporting: bool, segment_s: float = 0.0) -> dict:
    """A fixed CPU training loop for ``duration`` seconds; returns this rank's throughput.

    With ``reporting``, every rank calls ``progress`` once per step and rank 0 calls
    ``log_metrics`` after each step as many times as keeps it at ``rate`` calls per
    second of training (the number per step follows the step time). Without
    ``reporting`` rank 0 still works out that number, so only the calls differ.

    ``segment_s`` > 0 makes this one run a series of blocks of three ``segment_s``
    segments, "bare", "bare again" and "report", in a fresh random order per block,
    and also returns each segment's throughput. The two bare segments of a block
    are an A/A control: their ratio shows how far two identical segments differ.
    """
    import gc
    import random
    import time

    import horovod.torch as hvd
    import torch

    import hvdmagic
    from hvdmagic.rank import telemetry

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(hvd.rank())
    rank = hvd.rank()
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 256), torch.randn(batch, 256)
    mse = torch.nn.functional.mse_loss

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    def flusher_seconds() -> float:
        """CPU seconds of the report flusher thread, from /proc (10 ms resolution); 0 with no flusher."""
        thread = telemetry._flusher
        if thread is None or not thread.is_alive():
            return 0.0
        cpu = thread_cpu(thread.native_id)
        return float("nan") if cpu is None else cpu

    pauses = GcPauses()  # this rank's garbage collections in the training window

    for _ in range(50):
        step()
    hvd.allreduce(torch.zeros(1), name="start")  # start together
    log_metrics, progress = hvdmagic.log_metrics, hvdmagic.progress
    is_rank0 = rank == 0
    steps = events = 0
    budget = 0.0
    segments = []  # [label, steps, seconds, main-thread CPU seconds]
    labels, shuffled, block, label = ("bare", "bare again", "report"), random.Random(20261122), [], None
    if segment_s:
        block = shuffled.sample(labels, 3)
        label = block.pop()
    on = label == "report" if segment_s else reporting
    gc.collect()  # both variants start from a collected heap (a first full collection would land in the window)
    pauses.start()
    wall_start = time.time()
    cpu_start = time.process_time()
    main_cpu_start = time.thread_time()
    flusher_cpu_start = flusher_seconds()
    start = now = seg_start = time.perf_counter()
    seg_steps, seg_cpu = 0, time.thread_time()
    deadline = start + duration
    while now < deadline:
        value = step()
        k = 0
        if is_rank0:  # the pacing runs in both variants, so that only the calls themselves are compared
            budget += rate * (time.perf_counter() - now)
            k = int(budget)
            budget -= k
        if on:
            progress(steps + 1)
            for j in range(k):
                log_metrics(step=events + j, loss=value)
            events += k
        else:
            for _ in range(k):
                pass
        steps += 1
        now = time.perf_counter()
        if segment_s:
            seg_steps += 1
            if now - seg_start >= segment_s:
                if on:  # send this segment's rows now: the next segment must not pay for them
                    telemetry.flush()
                    now = time.perf_counter()
                cpu_now = time.thread_time()
                segments.append([label, seg_steps, now - seg_start, cpu_now - seg_cpu])
                block = block or shuffled.sample(labels, 3)
                label = block.pop()
                on, seg_steps, seg_start, seg_cpu = label == "report", 0, now, cpu_now
    elapsed = now - start
    cpu = time.process_time() - cpu_start
    main_cpu = time.thread_time() - main_cpu_start
    flusher_cpu = flusher_seconds() - flusher_cpu_start
    wall_end = time.time()
    pauses.stop()
    return {"rank": rank, "steps": steps, "elapsed": elapsed, "steps_per_s": steps / elapsed,
            "cpu_s": cpu, "cpu_per_step_us": cpu / steps * 1e6, "main_thread_cpu_s": main_cpu,
            "main_thread_cpu_per_step_us": main_cpu / steps * 1e6, "flusher_cpu_s": flusher_cpu,
            "flusher_cpu_per_event_us": flusher_cpu / events * 1e6 if events else None, "events": events,
            "events_per_s": events / elapsed, "wall_start": wall_start, "wall_end": wall_end,
            "gc_ms": pauses.ms_by_generation(), "gc_count": pauses.summary()["collections"], "segments": segments,
            "live": telemetry._events is not None}


def nothing() -> int:
    return 0


# ---------------------------------------------------------------------------
# The driver side.
# ---------------------------------------------------------------------------

def summarise(values) -> dict:
    """n, median, p99, min and max."""
    return _common.describe(values, p99=99)


def ratio_summary(ratios: list, ci95: bool = False) -> dict:
    """The ratios and their summary (with ``ci95``, the median's 95 % bootstrap interval too)."""
    if not ratios:
        return {"ratios": []}
    out = {"ratios": ratios, **summarise(ratios)}
    if ci95:
        out["ci95"] = bootstrap_median_ci(ratios)
    return out


def _kind(proc: psutil.Process, me: int) -> str:
    """driver, rank, jvm, spark_python (Spark's Python workers: they host the supervisors) or other."""
    if proc.pid == me:
        return "driver"
    try:
        return _common.process_role(" ".join(proc.cmdline()), proc.name())
    except psutil.Error:
        return "other"


class DriverMonitor:
    """Measures this process while a run goes on: wake-up lateness, CPU time, GC pauses.

    The ticker sleeps ``tick`` seconds at a time and records how late each wake-up
    is; the sampler records, every ``interval`` seconds, the CPU time of this
    process and of each process below it, and the metric rows the run record holds.
    Both keep their own CPU time, so it can be taken out of the driver's. A gc
    callback records every garbage collection in this process.
    """

    def __init__(self, tick: float = 0.01, interval: float = 0.25):
        self.tick = tick
        self.interval = interval
        self.ticks: list[tuple[float, float]] = []  # (wall time, lateness in s)
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._ticker_cpu = 0.0
        self._kinds: dict[int, str] = {}
        self._me = psutil.Process()
        self.gc = GcPauses()
        self._threads = [threading.Thread(target=self._ticker, name="bench-ticker", daemon=True),
                         threading.Thread(target=self._sampler, name="bench-sampler", daemon=True)]

    def __enter__(self):
        self.gc.start()
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self.gc.stop()

    def _ticker(self) -> None:
        clock, sleep, wall = time.perf_counter, time.sleep, time.time
        while not self._stop.is_set():
            due = clock() + self.tick
            sleep(self.tick)
            self.ticks.append((wall(), clock() - due))
            self._ticker_cpu = time.thread_time()

    def _sampler(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval):
                self._sample()
                return

    def _sample(self) -> None:
        procs = {}
        for proc in _common.process_tree(self._me):
            try:
                times = proc.cpu_times()
                kind = self._kinds.get(proc.pid) or self._kinds.setdefault(proc.pid, _kind(proc, self._me.pid))
            except psutil.Error:
                continue
            procs[proc.pid] = (kind, times.user + times.system)
        record = hvdmagic.last_run()
        rows = len(record.history) if record is not None else 0
        now = time.time()
        lag = now - record.history.times[-1] if rows else None
        machine = psutil.cpu_times()
        idle = machine.idle + getattr(machine, "iowait", 0.0)
        self.samples.append({"t": now, "procs": procs, "rows": rows, "record": id(record), "lag": lag,
                             "driver_cpu": time.process_time(), "monitor_cpu": self._ticker_cpu + time.thread_time(),
                             "machine_busy": sum(machine) - idle, "machine_all": sum(machine)})

    def window(self, start: float, end: float) -> dict:
        """What happened between wall times start and end (the ranks' training window)."""
        ticks = [(t, late) for t, late in self.ticks if start <= t <= end]
        lateness = [late for _, late in ticks]
        samples = [s for s in self.samples if start <= s["t"] <= end]
        pauses = self.gc.within(start, end)
        out: dict = {"ticks": len(lateness)}
        if lateness:
            out["tick_late_ms"] = {k: v * 1e3 for k, v in summarise(lateness).items() if k != "n"}
            out["ticks_late_over_5ms"] = sum(late > 0.005 for late in lateness)
            # Did the worst wake-ups overlap a garbage collection in this process?
            worst = sorted(ticks, key=lambda tick: -tick[1])[:5]
            out["worst_ticks_ms"] = [round(late * 1e3, 1) for _, late in worst]
            out["worst_ticks_during_gc"] = sum(
                any(gt - gd <= t and gt >= t - late - self.tick for gt, gd, _ in pauses) for t, late in worst)
        out["gc"] = self.gc.summary(start, end)
        if len(samples) < 2:
            return out
        first, last = samples[0], samples[-1]
        dt = last["t"] - first["t"]
        cpu_by_kind: dict[str, float] = {}
        for pid, (kind, cpu_end) in last["procs"].items():
            if kind == "driver":
                continue  # from process_time below: psutil counts in 10 ms clock ticks
            cpu_begin = next((s["procs"][pid][1] for s in samples if pid in s["procs"]), cpu_end)
            cpu_by_kind[kind] = cpu_by_kind.get(kind, 0.0) + cpu_end - cpu_begin
        monitor = last["monitor_cpu"] - first["monitor_cpu"]
        cpu_by_kind["driver"] = last["driver_cpu"] - first["driver_cpu"] - monitor
        out["window_s"] = dt
        out["cpu_cores"] = {kind: cpu / dt for kind, cpu in sorted(cpu_by_kind.items())}
        out["monitor_cpu_cores"] = monitor / dt
        out["machine_busy_cores"] = ((last["machine_busy"] - first["machine_busy"])
                                     / (last["machine_all"] - first["machine_all"]) * psutil.cpu_count())
        same_run = [s for s in samples if s["record"] == last["record"]]
        if len(same_run) >= 2:
            out["delivered_events_per_s"] = (same_run[-1]["rows"] - same_run[0]["rows"]) / (
                same_run[-1]["t"] - same_run[0]["t"])
        lags = [s["lag"] for s in same_run if s["lag"] is not None]
        if lags:
            out["newest_row_age_ms"] = {k: v * 1e3 for k, v in summarise(lags).items() if k != "n"}
        return out


log = _common.Log()


def run_quiet(fn, np: int, *args):
    """hvdmagic.run with the text view's own lines kept out of the table (they still get written)."""
    with _common.captured(stderr=False):
        return hvdmagic.run(fn, np, *args)


def measure_call_costs(rounds: int, batch: int) -> dict:
    out = {}
    log(f"per-call cost: {rounds} rounds of {batch} calls, outside a run (no-op) ...")
    noop = call_costs(rounds, batch)
    assert not noop["live"]
    log(f"per-call cost: {rounds} rounds of {batch} calls in a rank (np=-1) ...")
    started = time.perf_counter()
    live = run_quiet(call_costs, -1, rounds, batch)[0]
    wall = time.perf_counter() - started
    assert live["live"], "the rank had no event pipe"
    record = hvdmagic.last_run()
    delivered = len(record.history)
    for where, result in (("rank", live), ("noop", noop)):
        samples = result["ns_per_call"]
        loop = statistics.median(samples["empty_loop"])
        out[where] = {
            "log_metrics": summarise(samples["log_metrics"]),
            "progress": summarise(samples["progress"]),
            "track_iter": summarise(samples["track"]),
            "range_iter": summarise(samples["empty_loop"]),
            # Net of the bare loop: what the call adds to a loop iteration.
            "track_overhead_median": statistics.median(samples["track"]) - loop,
            "log_metrics_net_median": statistics.median(samples["log_metrics"]) - loop,
            "progress_net_median": statistics.median(samples["progress"]) - loop,
        }
    out["rank_run_wall_s"] = wall
    out["rank_log_metrics_calls"] = live["log_metrics_calls"]
    out["rank_metric_rows_delivered"] = delivered
    out["rank_metrics_complete"] = delivered == live["log_metrics_calls"]
    out["rounds"], out["batch"] = rounds, batch
    return out


def driver_path_costs(batches: int, per_batch: int) -> dict:
    """Microseconds per metric event for each hop of its way to the run record, in this process.

    It replays what one flush carries (``per_batch`` log_metrics rows) through the
    same code the run uses: the rank's columnar batch and JSON encoding
    (telemetry.flush), the supervisor's text relay (lines.relayed, channel.Link.send_raw),
    the driver's authenticated receive (channel.Link.recv) and RunRecord.apply;
    the link runs over a socketpair instead of TCP. It also measures the record's
    memory per row with tracemalloc and one widget dashboard redraw (without a
    front end, so no message is sent) once the record holds every row.
    """
    import socket
    import tracemalloc

    from hvdmagic import channel
    from hvdmagic.kernel.record import RunRecord
    from hvdmagic.task.lines import relayed

    def buffer_rows(b: int) -> MetricRows:  # what log_metrics leaves in the rank's buffer
        rows, first, now = MetricRows(), b * per_batch, time.time()
        rows.steps.extend(range(first, first + per_batch))
        rows.times.extend(now + i * 1e-4 for i in range(per_batch))
        rows.columns["loss"] = array("d", (1.0 / (1 + s) for s in range(first, first + per_batch)))
        return rows

    def encode(b: int, rows: MetricRows) -> str:  # telemetry.flush
        return telemetry.report_line({"": [b * per_batch, batches * per_batch, time.time()]}, rows)

    def batch_event(b: int) -> dict:
        return json.loads(encode(b, buffer_rows(b)))

    secret, nonce = channel.new_secret(), b"n" * channel.NONCE_SIZE
    a, b_sock = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    b_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sender = channel.Link(a, secret, nonce, is_server=False)
    receiver = channel.Link(b_sock, secret, nonce, is_server=True)
    record = RunRecord(Placement.of(-2))
    record.apply({"type": "placed", "rank": 0, "host": "bench"})
    stages = {"rank_encode": [], "supervisor_decode": [], "supervisor_send": [], "driver_recv": [],
              "record_apply": []}
    clock = time.perf_counter_ns
    pauses = GcPauses()
    gc.collect()
    tracked_before = len(gc.get_objects())
    pauses.start()
    tail = b',"rank":0}'
    for b in range(batches):
        rows = buffer_rows(b)
        t0 = clock()
        line = encode(b, rows)
        t1 = clock()
        frame = relayed(line.encode(), tail)  # supervisor._relay_events
        t2 = clock()
        sender.send_raw(frame)
        t3 = clock()
        received = receiver.recv()  # channel.ChannelServer._read_loop
        t4 = clock()
        record.apply(received)  # runner.execute's on_event (the text view ignores reports)
        t5 = clock()
        for name, dt in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            stages[name].append(dt / per_batch / 1e3)
    pauses.stop()
    sender.close()
    receiver.close()
    out = {name: summarise(values) for name, values in stages.items()}
    # Collections the replay triggered in this process (the stage timings above include them).
    out["gc"] = pauses.summary()
    out["gc"]["per_event_us"] = out["gc"]["total_ms"] * 1e3 / (batches * per_batch)
    t = clock()
    gc.collect()
    out["full_gc_with_record_ms"] = (clock() - t) / 1e6
    out["tracked_objects_with_record"] = len(gc.get_objects())
    out["tracked_objects_before"] = tracked_before
    out["bytes_per_event_on_the_wire"] = len(line) / per_batch
    rows = len(record.history)
    # Memory the record keeps per row: apply fresh decoded events under tracemalloc.
    fresh = RunRecord(Placement.of(-2))
    lines = [json.dumps(batch_event(b), separators=(",", ":")) for b in range(min(batches, 100))]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for line in lines:  # decoded under tracing: the record keeps the decoded objects
        e = json.loads(line)
        e["rank"] = 0
        fresh.apply(e)
    del e  # the batch wrapper goes; what the record holds stays
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    out["record_bytes_per_row"] = (after - before) / len(fresh.history)
    try:
        from hvdmagic.kernel.ui.dashboard import Dashboard

        dash = Dashboard(record)
        draws = []
        for _ in range(20):
            record.version += 1
            t = clock()
            dash._draw()
            draws.append((clock() - t) / 1e6)
        out["dashboard_redraw_ms"] = summarise(draws)
        out["dashboard_rows"] = rows
    except Exception as exc:  # ipywidgets missing or changed: report, do not fail the benchmark
        out["dashboard_redraw_error"] = f"{type(exc).__name__}: {exc}"
    out["batches"], out["per_batch"] = batches, per_batch
    return out


def training_run(mode: str, np: int, variant: str, cfg: dict) -> dict:
    reporting = variant in ("report", "interleaved")
    segment_s = cfg["segment_s"] if variant == "interleaved" else 0.0
    np_arg = -np if mode == "local" else np
    load_before = os.getloadavg()[0]
    cpu_before = time.process_time()
    started = time.perf_counter()
    gc.collect()  # the previous run's record is gone; every run starts from the same driver heap
    with DriverMonitor() as monitor:
        results = run_quiet(train, np_arg, cfg["duration"], cfg["batch"], cfg["rate"], reporting, segment_s)
    wall = time.perf_counter() - started
    cpu_run = time.process_time() - cpu_before
    record = hvdmagic.last_run()
    t = time.perf_counter()
    gc.collect()  # what one full collection costs the kernel while this run's record is alive
    full_gc_ms = (time.perf_counter() - t) * 1e3
    assert all(r["live"] for r in results), "a rank had no event pipe"
    start = max(r["wall_start"] for r in results)
    end = min(r["wall_end"] for r in results)
    out = {
        "mode": mode, "variant": variant, "ranks": results, "run_wall_s": wall,
        "driver_cpu_whole_run_s": cpu_run, "loadavg_1min_before": load_before,
        "rank0_steps_per_s": results[0]["steps_per_s"],
        "all_ranks_steps_per_s": sum(r["steps_per_s"] for r in results),
        "rank0_cpu_per_step_us": results[0]["cpu_per_step_us"],
        "rank0_main_cpu_per_step_us": results[0]["main_thread_cpu_per_step_us"],
        "rank0_flusher_cpu_pct": results[0]["flusher_cpu_s"] / results[0]["elapsed"] * 100,
        "rank0_flusher_cpu_per_event_us": results[0]["flusher_cpu_per_event_us"],
        "rank0_events_sent": results[0]["events"], "rank0_events_per_s": results[0]["events_per_s"],
        "rank0_gc_ms_per_s": sum(results[0]["gc_ms"]) / results[0]["elapsed"],
        "rank0_gc_full_collections": results[0]["gc_count"][2],
        "driver": monitor.window(start, end),
        "full_gc_after_run_ms": full_gc_ms, "tracked_objects_after_run": len(gc.get_objects()),
    }
    if segment_s:
        out["segment_ratios"] = segment_ratios(results[0]["segments"])
    rows = record.history
    rank0_steps = [step for rank, step in zip(rows.ranks, rows.steps) if rank == 0]
    out["metric_rows"] = len(rows)
    out["rank0_metric_rows"] = len(rank0_steps)
    sent = results[0]["events"]
    # Exactly what rank 0 sent: the same count, every step once, in order.
    out["metrics_complete"] = len(rows) == sent and rank0_steps == list(range(sent))
    if reporting:
        # The flush interval's worth of events is in flight at any moment; the
        # record reaches the full count once the rank has flushed before its result.
        out["delivered_events_per_s_whole_run"] = len(rows) / results[0]["elapsed"] if sent else 0.0
    return out


def segment_ratios(segments: list) -> dict:
    """Per block, report/bare (A/B) and bare again/bare (A/A), with the median's 95 % interval.

    For steps/s and for the main thread's CPU time per step; the latter does not
    count time the thread spent descheduled, so it is less exposed to other load.
    The interval is a bootstrap over blocks: the A/A row shows what the same
    statistic reads when nothing differs.
    """
    blocks = [dict((seg[0], seg[1:]) for seg in segments[i:i + 3]) for i in range(0, len(segments) - 2, 3)]
    out = {"blocks": len(blocks)}
    for key, value in (("steps_per_s", lambda steps, seconds, cpu: steps / seconds),
                       ("main_cpu_per_step", lambda steps, seconds, cpu: cpu / steps)):
        for test, label in (("ab", "report"), ("aa", "bare again")):
            ratios = paired_ratios([value(*b[label]) for b in blocks], [value(*b["bare"]) for b in blocks])
            out[f"{key}_{test}"] = ratio_summary(ratios, ci95=True)
    return out


def compare(runs: list[dict]) -> dict:
    """Ratios report/bare per pair (a pair is one bare run and the report run after it)."""
    runs = [r for r in runs if r["variant"] in ("bare", "report")]
    bare = [r for r in runs if r["variant"] == "bare"]
    rep = [r for r in runs if r["variant"] == "report"]
    out = {}
    for key in ("rank0_steps_per_s", "all_ranks_steps_per_s", "rank0_cpu_per_step_us", "rank0_main_cpu_per_step_us"):
        out[key] = ratio_summary(paired_ratios([r[key] for r in rep], [b[key] for b in bare]))
    return out


def fmt_stats(stats: dict, scale: float = 1e-3) -> str:
    return f"{stats['median'] * scale:7.3f} / {stats['p99'] * scale:7.3f}"


def print_tables(result: dict) -> None:
    calls = result["call_costs"]
    print()
    print(f"Per-call cost, microseconds per call: median / p99 over {calls['rounds']} samples "
          f"of {calls['batch']} calls each")
    print(f"{'call':34} {'in a rank (live pipe)':>22} {'outside a run (no-op)':>24}")
    rows = [("log_metrics(step=i, loss=x)", "log_metrics"), ("progress(i, total=n)", "progress"),
            ("for _ in track(range(n)): /iter", "track_iter"), ("for _ in range(n): /iter", "range_iter")]
    for label, key in rows:
        print(f"{label:34} {fmt_stats(calls['rank'][key]):>22} {fmt_stats(calls['noop'][key]):>24}")
    print(f"{'track() overhead per iteration':34} {calls['rank']['track_overhead_median'] / 1e3:>12.3f} (median)"
          f" {calls['noop']['track_overhead_median'] / 1e3:>14.3f} (median)")
    print(f"metric rows delivered by the per-call rank: {calls['rank_metric_rows_delivered']} of "
          f"{calls['rank_log_metrics_calls']} sent ({'complete' if calls['rank_metrics_complete'] else 'LOST SOME'})")

    path = result["driver_path"]
    print()
    print(f"Cost per metric event on its way to the record, microseconds: median / p99 over "
          f"{path['batches']} batches of {path['per_batch']} "
          f"({path['bytes_per_event_on_the_wire']:.0f} B/event as JSON)")
    where = {"rank_encode": "rank (flusher thread)", "supervisor_decode": "supervisor: driver in local mode",
             "supervisor_send": "supervisor: driver in local mode", "driver_recv": "driver (channel reader)",
             "record_apply": "driver (job loop)"}
    total = 0.0
    for name, label in (("rank_encode", "base64 columns, one line (telemetry.flush)"),
                        ("supervisor_decode", "text relay (lines.relayed)"),
                        ("supervisor_send", "channel.Link.send_raw (HMAC + send)"),
                        ("driver_recv", "channel.Link.recv (HMAC + JSON)"),
                        ("record_apply", "RunRecord.apply")):
        total += path[name]["median"]
        print(f"  {label:42} {fmt_stats(path[name], 1):>18}   {where[name]}")
    print(f"  {'sum of medians':42} {total:7.3f}")
    g = path["gc"]
    print(f"  garbage collections during the replay: {g['collections']} (gen 0/1/2), {g['total_ms']:.0f} ms in all "
          f"({g['per_event_us']:.2f} us/event), longest {g['max_pause_ms']:.0f} ms")
    print(f"  a full collection with that record alive: {path['full_gc_with_record_ms']:.0f} ms "
          f"({path['tracked_objects_with_record']} tracked objects; "
          f"{path['tracked_objects_before']} before the replay)")
    print(f"  run record memory per metric row (tracemalloc): {path['record_bytes_per_row']:.0f} B")
    if "dashboard_redraw_ms" in path:
        d = path["dashboard_redraw_ms"]
        print(f"  widget dashboard redraw with {path['dashboard_rows']} rows, no front end: "
              f"{d['median']:.2f} ms median, {d['max']:.2f} ms max (it redraws at most 10 times a second)")

    cfg = result["config"]
    print()
    print(f"Training overhead: np={cfg['np']}, {cfg['duration']:g} s per run, batch {cfg['batch']}; with reporting "
          f"rank 0 sends {cfg['rate']:g} log_metrics events/s and every rank calls progress once per step")
    header = (f"{'mode':6} {'run':>3} {'variant':7} {'r0 step/s':>9} {'all step/s':>10} {'r0 cpu/step us':>14} "
              f"{'flusher %':>9} {'gc ms/s':>7} "
              f"{'ev/s sent':>9} {'ev/s drv':>8} {'rows ok':>7} {'tick max/p99 ms':>15} "
              f"{'drv cpu %':>9} {'spk py %':>8} {'jvm %':>6} {'load':>5}")
    print(header)
    for mode, block in result["training"].items():
        runs = [(str(i // 2 + 1), run) for i, run in enumerate(block["runs"])]
        if "interleaved" in block:
            runs.append(("-", block["interleaved"]))
        for label, run in runs:
            drv = run["driver"]
            late = drv.get("tick_late_ms", {})
            cores = drv.get("cpu_cores", {})
            ok = "yes" if run["metrics_complete"] else "NO"
            variant = "altern." if run["variant"] == "interleaved" else run["variant"]
            print(f"{mode:6} {label:>3} {variant:7} {run['rank0_steps_per_s']:9.1f} "
                  f"{run['all_ranks_steps_per_s']:10.1f} {run['rank0_cpu_per_step_us']:14.1f} "
                  f"{run['rank0_flusher_cpu_pct']:9.1f} {run['rank0_gc_ms_per_s']:7.2f} "
                  f"{run['rank0_events_per_s']:9.0f} {drv.get('delivered_events_per_s', 0):8.0f} {ok:>7} "
                  f"{late.get('max', float('nan')):7.1f}/{late.get('p99', float('nan')):<7.1f} "
                  f"{cores.get('driver', 0) * 100:9.1f} {cores.get('spark_python', 0) * 100:8.1f} "
                  f"{cores.get('jvm', 0) * 100:6.1f} {run['loadavg_1min_before']:5.1f}")
    print()
    print("Ratios report/bare per pair: median [min, max]")
    for mode, block in result["training"].items():
        for key, label in (("rank0_steps_per_s", "rank 0 steps/s"), ("all_ranks_steps_per_s", "all ranks steps/s"),
                           ("rank0_cpu_per_step_us", "rank 0 CPU time per step"),
                           ("rank0_main_cpu_per_step_us", "rank 0 main-thread CPU/step")):
            s = block["ratios"][key]
            if not s["ratios"]:
                continue
            each = ", ".join(f"{r:.3f}" for r in s["ratios"])
            print(f"  {mode:6} {label:28} {s['median']:.3f} [{s['min']:.3f}, {s['max']:.3f}]   ({each})")
    for mode, block in result["training"].items():
        segs = block.get("interleaved", {}).get("segment_ratios", {})
        if segs.get("blocks"):
            print(f"Interleaved run, {mode}: {segs['blocks']} blocks of three {result['config']['segment_s']:g} s "
                  "segments (bare, bare again, report) in random order; median per block [95 % interval]")
        for key, label in (("steps_per_s", "rank 0 steps/s"), ("main_cpu_per_step", "rank 0 main-thread CPU/step")):
            for test, what in (("ab", "report / bare"), ("aa", "bare again / bare (A/A control)")):
                seg = segs.get(f"{key}_{test}", {})
                if seg.get("ratios"):
                    low, high = seg["ci95"]
                    print(f"  {mode:6} {label:28} {what:32} {seg['median']:.3f} [{low:.3f}, {high:.3f}]")
    print()
    print("Driver during the training window, median over runs (report | bare):")
    for mode, block in result["training"].items():
        for key, label in (("tick_max_ms", "ticker lateness max, ms"), ("tick_p99_ms", "ticker lateness p99, ms"),
                           ("driver_cpu_pct", "driver process CPU, % of a core"),
                           ("spark_python_cpu_pct", "Spark Python workers CPU, %"),
                           ("jvm_cpu_pct", "Spark JVM CPU, %"),
                           ("gc_max_pause_ms", "driver GC: longest pause, ms"),
                           ("gc_total_ms", "driver GC: total in window, ms"),
                           ("full_gc_after_run_ms", "one full GC after the run, record alive, ms"),
                           ("newest_row_age_ms", "age of newest metric row, ms"),
                           ("driver_cpu_whole_run_s", "driver CPU, whole run incl. launch, s")):
            rep, bare = block["driver_summary"]["report"].get(key), block["driver_summary"]["bare"].get(key)
            if rep is None and bare is None:
                continue
            print(f"  {mode:6} {label:40} {_common.num(rep):>8} | {_common.num(bare):<8}")


def driver_summary(runs: list[dict]) -> dict:
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    out = {}
    for variant in ("report", "bare"):
        sel = [r for r in runs if r["variant"] == variant]
        drv = [r["driver"] for r in sel]
        out[variant] = {
            "tick_max_ms": med(d.get("tick_late_ms", {}).get("max") for d in drv),
            "tick_p99_ms": med(d.get("tick_late_ms", {}).get("p99") for d in drv),
            "full_gc_after_run_ms": med(r["full_gc_after_run_ms"] for r in sel),
            "gc_max_pause_ms": med(d.get("gc", {}).get("max_pause_ms") for d in drv),
            "gc_total_ms": med(d.get("gc", {}).get("total_ms") for d in drv),
            "driver_cpu_pct": med(d.get("cpu_cores", {}).get("driver", 0) * 100 for d in drv),
            "spark_python_cpu_pct": med(d["cpu_cores"]["spark_python"] * 100 for d in drv
                                        if "spark_python" in d.get("cpu_cores", {})),
            "jvm_cpu_pct": med(d["cpu_cores"]["jvm"] * 100 for d in drv if "jvm" in d.get("cpu_cores", {})),
            "newest_row_age_ms": med(d.get("newest_row_age_ms", {}).get("median") for d in drv)
            if variant == "report" else None,
            "driver_cpu_whole_run_s": med(r["driver_cpu_whole_run_s"] for r in sel),
        }
    return out


def environment() -> dict:
    import torch

    return {"hvdmagic": _common.code_under_test(), **_common.machine(), **_common.versions("torch"),
            "gpu": torch.cuda.is_available(), "flush_interval_s": telemetry.FLUSH_INTERVAL,
            "driver_gc_tracked_objects": len(gc.get_objects()), "gc_thresholds": gc.get_threshold(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short smoke run (< 60 s); figures are rough")
    parser.add_argument("--np", type=int, default=2, help="ranks for the training runs (default 2)")
    parser.add_argument("--duration", type=float, help="seconds of training per run (default 20; quick 2)")
    parser.add_argument("--pairs", type=int, help="bare/report pairs per mode (default 4; quick 1)")
    parser.add_argument("--rate", type=float, default=10_000, help="metric events per second on rank 0 (10000)")
    parser.add_argument("--batch", type=int, default=64, help="training batch size (default 64)")
    parser.add_argument("--rounds", type=int, help="per-call samples per variant (default 400; quick 20)")
    parser.add_argument("--calls", type=int, default=1000, help="calls per per-call sample (default 1000)")
    parser.add_argument("--modes", help="comma-separated: local, spark (default both; quick: local only, "
                        "since starting Spark alone takes 20-35 s)")
    parser.add_argument("--segment", type=float, help="seconds per segment of the interleaved run "
                        "(default 0.1; 0 skips that run, as --quick does)")
    parser.add_argument("--interleaved", type=float, default=90.0,
                        help="seconds of the interleaved run per mode (default 90)")
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench_report.json"))
    args = parser.parse_args(argv)
    duration = args.duration or (2.0 if args.quick else 20.0)
    pairs = args.pairs if args.pairs is not None else (1 if args.quick else 4)
    rounds = args.rounds or (20 if args.quick else 400)
    segment_s = args.segment if args.segment is not None else (0.0 if args.quick else 0.1)
    modes = [m.strip() for m in (args.modes or ("local" if args.quick else "local,spark")).split(",") if m.strip()]
    for mode in modes:
        if mode not in ("local", "spark"):
            parser.error(f"unknown mode {mode!r}")

    began = time.perf_counter()
    result: dict = {"environment": environment(), "command": _common.command_line(),
                    "config": {"np": args.np, "duration": duration, "pairs": pairs, "rate": args.rate,
                               "segment_s": segment_s, "interleaved_s": args.interleaved,
                               "batch": args.batch, "rounds": rounds, "calls": args.calls, "modes": modes,
                               "quick": args.quick}}
    log("driver-side cost per metric event (in this process) ...")
    result["driver_path"] = driver_path_costs(40 if args.quick else 400, 1000)
    result["call_costs"] = measure_call_costs(rounds, args.calls)
    cfg = {"duration": duration, "batch": args.batch, "rate": args.rate, "segment_s": segment_s}
    result["training"] = {}
    for mode in modes:
        if mode == "spark" and not args.quick:  # quick: the first run starts Spark (outside its window)
            log("starting Spark (embedded local session) with a warm-up run ...")
            t = time.perf_counter()
            run_quiet(nothing, args.np)
            result["spark_warmup_s"] = time.perf_counter() - t
        runs = []
        for pair in range(pairs):
            for variant in ("bare", "report"):
                log(f"{mode}: pair {pair + 1}/{pairs}, {variant}, {duration:g} s ...")
                run = training_run(mode, args.np, variant, cfg)
                runs.append(run)
                if not run["metrics_complete"]:
                    log(f"  metrics NOT complete: {run['metric_rows']} rows for {run['rank0_events_sent']} sent")
        block = {"runs": runs, "ratios": compare(runs), "driver_summary": driver_summary(runs)}
        if cfg["segment_s"]:
            log(f"{mode}: one interleaved run, {args.interleaved:g} s in blocks of 3 x {cfg['segment_s']:g} s ...")
            block["interleaved"] = training_run(mode, args.np, "interleaved", {**cfg, "duration": args.interleaved})
            if not block["interleaved"]["metrics_complete"]:
                log("  metrics NOT complete in the interleaved run")
        result["training"][mode] = block
    result["total_s"] = time.perf_counter() - began

    out = _common.write_json(args.out, result)
    print_tables(result)
    print(f"\nwrote {out} in {result['total_s']:.0f} s")
    lost = [r for block in result["training"].values() for r in block["runs"] + [block.get("interleaved")]
            if r is not None and not r["metrics_complete"]]
    if lost or not result["call_costs"]["rank_metrics_complete"]:
        print("METRICS WERE LOST in at least one run (see the JSON)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
