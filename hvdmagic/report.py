"""What code inside a rank calls to talk to the notebook.

``progress``, ``log_metrics`` and ``track`` only touch memory: a call appends to a
buffer (metrics) or overwrites the latest state (progress), and a background
thread flushes everything as one JSON line on the event pipe every
``FLUSH_INTERVAL`` seconds. No call waits for the network. Outside a
``%%horovod`` run (no event pipe) they are no-ops, so the same code runs on a
single node.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from typing import Iterable, Iterator, TypeVar

FLUSH_INTERVAL = 0.1
HEARTBEAT_INTERVAL = 1.0  # tells the driver's watchdog this rank is alive even when it reports nothing
MAX_BUFFERED_METRICS = 1_000_000  # beyond this a caller waits for a flush: memory stays bounded, nothing is dropped
ROWS_PER_WRITE = 2_000  # one flush encodes at most this many rows per lock hold, so a backlog never blocks a caller long

T = TypeVar("T")
_PLAIN = (int, float)

_write_lock = threading.Lock()
_events = None  # the event pipe, opened by the rank process
# Flat step, {name: value}, time, step, ... in call order. deque.extend of a tuple is
# one atomic step, so the buffer always holds whole triples, and no container per
# call outlives it (a list per row kept rank 0's garbage collector busy).
_metrics: deque = deque()
_progress: dict = {}  # desc -> [step, total, time]: only the newest state matters
_progress_sent: dict = {}
_metric_steps = 0
_flusher: threading.Thread | None = None
_wake = threading.Event()


def open_events() -> None:
    """Called once by the rank process; everything else is a no-op before it."""
    global _events, _flusher
    fd = os.environ.get("HVDMAGIC_EVENT_FD")
    if fd is None or _events is not None:
        return
    _events = os.fdopen(int(fd), "w", encoding="utf-8")
    _flusher = threading.Thread(target=_flush_loop, name="hvdmagic-report", daemon=True)
    _flusher.start()


def emit(event: dict) -> None:
    """Send one event to this rank's supervisor now (thread-safe)."""
    if _events is None:
        return
    line = json.dumps(event, separators=(",", ":")) + "\n"
    with _write_lock:
        _events.write(line)
        _events.flush()


def progress(step: int, total: int | None = None, desc: str | None = None) -> None:
    """Report this rank's progress: ``step`` of ``total`` in the bar named ``desc``."""
    if _events is not None:
        _progress[desc or ""] = [step, total, time.time()]


def log_metrics(step: int | None = None, **metrics: float) -> None:
    """Record numeric metrics (loss=..., accuracy=...) at ``step``; rank 0's are charted."""
    global _metric_steps
    if _events is None:
        return
    for name, value in metrics.items():
        if type(value) not in _PLAIN:
            # numpy scalars, 0-d tensors, Decimals...: plain floats for the JSON frame.
            try:
                metrics[name] = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"log_metrics({name}=...) needs a number, not {type(value).__name__}") from None
    if step is None:
        step = _metric_steps
    _metric_steps = step + 1
    _metrics.extend((step, metrics, time.time()))
    if len(_metrics) >= 3 * MAX_BUFFERED_METRICS:
        _wake.set()
        while len(_metrics) >= 3 * MAX_BUFFERED_METRICS and _events is not None:
            time.sleep(0.001)


def track(iterable: Iterable[T], desc: str | None = None, total: int | None = None) -> Iterator[T]:
    """``for batch in track(loader, desc="epoch 1")``: yields the items, reporting progress."""
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    progress(0, total, desc)
    step = 0
    for step, item in enumerate(iterable, start=1):
        yield item
        progress(step, total, desc)


def _metric_batch(rows: int) -> dict:
    """The oldest ``rows`` buffered metric calls as columns, which the driver's record appends as they are.

    Times travel as whole milliseconds after the batch's first one: the float
    repr of a full timestamp was most of the encoding cost.
    """
    pop = _metrics.popleft
    steps, stamps, dicts = [], [], []
    for _ in range(rows):
        steps.append(pop())
        dicts.append(pop())
        stamps.append(pop())
    t0 = stamps[0]
    names = dict.fromkeys(name for metrics in dicts for name in metrics) if len(dicts) > 1 else dicts[0]
    return {"steps": steps, "t0": t0, "ms": [round((t - t0) * 1000) for t in stamps],
            "values": {name: [metrics.get(name) for metrics in dicts] for name in names}}


def flush() -> None:
    """Send what is buffered now; the rank calls it before reporting its result."""
    global _progress_sent
    if _events is None:
        return
    with _write_lock:
        snapshot = dict(_progress)
        bars = {desc: state for desc, state in snapshot.items() if _progress_sent.get(desc) != state}
        _progress_sent = snapshot
    while True:
        with _write_lock:
            rows = min(len(_metrics) // 3, ROWS_PER_WRITE)
            if not rows and not bars:
                return
            batch = {"type": "report", "progress": bars}
            if rows:
                batch["metrics"] = _metric_batch(rows)
            _events.write(json.dumps(batch, separators=(",", ":")) + "\n")
            _events.flush()
            bars = {}
            if rows < ROWS_PER_WRITE:
                return


def _flush_loop() -> None:
    next_beat = time.monotonic()
    while True:
        _wake.wait(FLUSH_INTERVAL)
        _wake.clear()
        try:
            flush()
            if time.monotonic() >= next_beat:
                emit({"type": "heartbeat"})
                next_beat = time.monotonic() + HEARTBEAT_INTERVAL
        except (OSError, ValueError):
            return  # the pipe is gone: the supervisor ended the rank
