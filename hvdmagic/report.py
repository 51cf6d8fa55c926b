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

T = TypeVar("T")
_PLAIN = (int, float)

_write_lock = threading.Lock()
_events = None  # the event pipe, opened by the rank process
# [step, {name: value}, time] in call order; deque append/popleft are atomic, so the
# flusher never loses an entry appended while it drains.
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
    _metrics.append([step, metrics, time.time()])
    if len(_metrics) >= MAX_BUFFERED_METRICS:
        _wake.set()
        while len(_metrics) >= MAX_BUFFERED_METRICS and _events is not None:
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


def flush() -> None:
    """Send what is buffered now; the rank calls it before reporting its result."""
    global _progress_sent
    if _events is None:
        return
    with _write_lock:
        metrics = [_metrics.popleft() for _ in range(len(_metrics))]
        snapshot = dict(_progress)
        bars = {desc: state for desc, state in snapshot.items() if _progress_sent.get(desc) != state}
        _progress_sent = snapshot
        if metrics or bars:
            batch = {"type": "report", "metrics": metrics, "progress": bars}
            _events.write(json.dumps(batch, separators=(",", ":")) + "\n")
            _events.flush()


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
