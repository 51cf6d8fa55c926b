"""What code inside a rank calls to talk to the notebook.

``progress``, ``log_metrics`` and ``track`` only touch memory: a call appends to
typed columns (metrics, see ``metric_rows``) or overwrites the latest state
(progress), and a background thread flushes everything as one JSON line on the
event pipe every ``FLUSH_INTERVAL`` seconds. No call waits for the network.
Outside a ``%%horovod`` run (no event pipe) they are no-ops, so the same code
runs on a single node.

``log_metrics`` is the C function of ``_rowlog.c`` where the package was built
with a compiler, and ``_log_metrics`` below otherwise (or with
``HVDMAGIC_PURE_PYTHON=1``): the same rows and the same errors.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Iterable, Iterator, TypeVar

from hvdmagic.metric_rows import GAP_ROW, MetricRows, pad

try:  # log_metrics in C (_rowlog.c): the same rows and errors at a fraction of the cost per call
    from hvdmagic import _rowlog
except ImportError:  # built without a C compiler
    _rowlog = None
if os.environ.get("HVDMAGIC_PURE_PYTHON") == "1":
    _rowlog = None

FLUSH_INTERVAL = 0.1
HEARTBEAT_INTERVAL = 1.0  # tells the driver's watchdog this rank is alive even when it reports nothing
MAX_BUFFERED_METRICS = 1_000_000  # beyond this a caller waits for a flush: memory stays bounded, nothing is dropped

T = TypeVar("T")

_write_lock = threading.Lock()
_events = None  # the event pipe, opened by the rank process
# The flusher swaps in fresh rows under this lock, so a call never writes into rows already sent.
_rows_lock = threading.Lock()
_rows = MetricRows()
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
    if _rowlog is not None:
        _rowlog.enable(True, MAX_BUFFERED_METRICS, _wait_for_flush, GAP_ROW[0], 0)
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


def _log_metrics(step: int | None = None, **metrics: float) -> None:
    """Record numeric metrics (loss=..., accuracy=...) at ``step``; rank 0's are charted."""
    global _metric_steps
    if _events is None:
        return
    if step is None:
        step = _metric_steps
    _rows_lock.acquire()  # not ``with``: its __exit__ call cost as much as the lock here
    try:
        rows = _rows
        row = len(rows.steps)
        columns = rows.columns
        name = "step"
        try:
            rows.steps.append(step)
            for name, value in metrics.items():
                column = columns.get(name)
                if column is None:
                    column = columns[name] = GAP_ROW * row
                elif len(column) != row:  # the metric skipped the rows since its last value
                    pad(column, row)
                column.append(value)  # array converts numpy scalars and 0-d tensors, and refuses the rest
        except Exception as exc:
            rows.drop_row(row)
            if isinstance(exc, OverflowError):  # an int beyond a double's range
                raise OverflowError(f"log_metrics({name}=...) is too large for a float") from exc
            kind = type(step if name == "step" else metrics[name]).__name__
            raise TypeError(f"log_metrics({name}=...) needs a number, not {kind}") from exc
        rows.times.append(time.time())
    finally:
        _rows_lock.release()
    _metric_steps = step + 1
    if row >= MAX_BUFFERED_METRICS:
        _wait_for_flush()


log_metrics = _log_metrics if _rowlog is None else _rowlog.log_metrics


def _pending() -> int:
    return len(_rows) if _rowlog is None else _rowlog.pending()


def _wait_for_flush() -> None:
    """Hold the logging thread until the flusher has taken the rows: memory stays bounded."""
    _wake.set()
    while _pending() >= MAX_BUFFERED_METRICS and _events is not None:
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


def _take_rows() -> MetricRows:
    global _rows
    if _rowlog is not None:
        return MetricRows.from_bytes(*_rowlog.take())
    with _rows_lock:
        taken, _rows = _rows, MetricRows()
    return taken


def report_line(bars: dict, rows: MetricRows) -> str:
    """The event line of one flush: the progress bars that changed and the rows taken."""
    metrics = f',"metrics":{rows.to_json()}' if rows else ""
    return f'{{"type":"report","progress":{json.dumps(bars, separators=(",", ":"))}{metrics}}}\n'


def flush() -> None:
    """Send what is buffered now; the rank calls it before reporting its result."""
    global _progress_sent
    if _events is None:
        return
    with _write_lock:  # take and write as one step, so two flushes cannot reorder batches
        snapshot = dict(_progress)
        bars = {desc: state for desc, state in snapshot.items() if _progress_sent.get(desc) != state}
        _progress_sent = snapshot
        rows = _take_rows()
        if not rows and not bars:
            return
        _events.write(report_line(bars, rows))
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
