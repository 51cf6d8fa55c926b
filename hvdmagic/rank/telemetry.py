"""What code inside a rank calls to talk to the notebook.

``progress``, ``log_metrics`` and ``track`` only touch memory: a call appends to
typed columns (metrics, see ``metric_rows``) or overwrites the latest state
(progress), and a background thread flushes everything as one JSON line on the
event socket every ``FLUSH_INTERVAL`` seconds. No call waits for the network;
``deliver``, which an elastic commit calls, waits until the kernel has it all.
Outside a ``%%horovod`` run (no event socket) they are no-ops, so the same code
runs on a single node.
"""

from __future__ import annotations

import json
import os
import select
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from hvdmagic import protocol
from hvdmagic.metric_rows import GAP_ROW, MetricRows, pad
from hvdmagic.protocol import EVENT_FD_ENV, LEGACY_KERAS_SET_ENV, SYNC_WAIT, Event, Stage

FLUSH_INTERVAL = 0.1
HEARTBEAT_INTERVAL = 1.0  # tells the driver's watchdog this rank is alive even when it reports nothing
MAX_BUFFERED_METRICS = 1_000_000  # beyond this a caller waits for a flush: memory stays bounded, nothing is dropped

T = TypeVar("T")

_write_lock = threading.Lock()
_events = None  # the event socket, opened by the rank process
# The flusher swaps in fresh rows under this lock, so a call never writes into rows already sent.
_rows_lock = threading.Lock()
_rows = MetricRows()
_progress: dict = {}  # desc -> [step, total, time]: only the newest state matters
_progress_sent: dict = {}
# A bar that restarts (a step below its last: the next epoch) queues how every bar stood just
# before, then its restart, for the next flush to send first, in order: later steps overwrite
# ``_progress`` before the flush, and the kernel, which sees a restart only as a step going
# down, would miss an epoch shorter than a flush, and the epoch's last step.
_pending: list[dict] = []
_restarted: set = set()  # the bars that restarted since the last flush: one restart each is enough
_metric_steps = 0
_waited = 0.0  # seconds this rank has waited in collectives (rank.collective_wait), 0 where not timed
_flusher: threading.Thread | None = None
_wake = threading.Event()
_sync_lock = threading.Lock()
_syncs = 0  # how many syncs this rank has asked for: each answer names the one it answers
_answers = b""  # what the supervisor wrote back and no sync has read yet: a partial line


def open_events() -> None:
    """Called once by the rank process; everything else is a no-op before it."""
    global _events, _flusher
    fd = os.environ.get(EVENT_FD_ENV)
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
    """Report this rank's progress: ``step`` of ``total`` in the bar named ``desc``.

    The call only overwrites the bar's latest state in memory; the background flusher
    sends what changed. The dashboard shows each rank's most recently updated bar, with
    its rate and ETA; a ``step`` below the bar's last one restarts it (the next epoch).
    A no-op outside a ``%%horovod`` run, so the same code runs on a single node.

    Args:
        step: how far this rank has got, e.g. the number of batches done.
        total: the step at which the bar is full; None (the default) when unknown (no ETA).
        desc: the bar's name, e.g. "train" or f"epoch {epoch}"; None (the default) is the
            unnamed bar.

    Example::

        %%horovod --np 2
        for step in range(steps):
            train_step()
            hvdmagic.progress(step + 1, total=steps, desc="train")
    """
    if _events is not None:
        key = desc or ""
        # With the seconds waited in collectives so far, where they are timed (rank.collective_wait).
        state = [step, total, time.time(), _waited] if _waited else [step, total, time.time()]
        previous = _progress.get(key)
        if previous is not None and step < previous[0] and key not in _restarted:
            _restarted.add(key)
            _pending.append(dict(_progress))
            _pending.append({key: state})
        _progress[key] = state


def log_metrics(step: int | None = None, **metrics: float) -> None:
    """Record numeric metrics (loss=..., accuracy=...) at ``step``; rank 0's are charted.

    The call only appends to memory; the background flusher sends the rows in batches,
    and nothing is dropped (past 1,000,000 unsent rows a call waits for a flush). Every
    rank's rows reach ``hvdmagic.last_run().metrics``. A no-op (no checks either) outside
    a ``%%horovod`` run.

    Args:
        step: the x value of this row; None (the default) is the previous call's step + 1
            (0 for the first call).
        **metrics: name=value pairs; a value is an int, a float, a numpy scalar or a 0-d
            tensor, stored as a float. A metric left out of a call has no value at that step.

    Raises:
        TypeError: ``step`` or a value is not a number (e.g. a string or a multi-element
            tensor); the whole call is discarded.
        OverflowError: an int too large for a float; the whole call is discarded.

    Example::

        %%horovod --np 2
        for epoch in range(epochs):
            loss, acc = train_one_epoch()
            hvdmagic.log_metrics(step=epoch, loss=loss.item(), acc=acc)
    """
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


def _wait_for_flush() -> None:
    """Hold the logging thread until the flusher has taken the rows: memory stays bounded."""
    _wake.set()
    while len(_rows) >= MAX_BUFFERED_METRICS and _events is not None:
        time.sleep(0.001)


def track(iterable: Iterable[T], desc: str | None = None, total: int | None = None) -> Iterator[T]:
    """``for batch in track(loader, desc="epoch 1")``: yields the items, reporting progress.

    Like tqdm: reports step 0 before the first item, then the number of items done each
    time the loop asks for the next one, through ``progress``. Outside a ``%%horovod``
    run it only yields the items.

    Args:
        iterable: what to loop over, e.g. a DataLoader.
        desc: the bar's name (see ``progress``); None (the default) is the unnamed bar.
        total: the number of items; None (the default) takes ``len(iterable)`` when it has
            one, else the bar has no total (no ETA).

    Returns:
        An iterator over the items of ``iterable``.

    Example::

        %%horovod --np 2
        for epoch in range(epochs):
            for x, y in hvdmagic.track(loader, desc=f"epoch {epoch}"):
                train_step(x, y)
    """
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
    with _rows_lock:
        taken, _rows = _rows, MetricRows()
    return taken


def add_wait(seconds: float) -> None:
    """Count ``seconds`` spent waiting in a collective (``rank.collective_wait``)."""
    global _waited
    _waited += seconds


def report_line(bars: dict, rows: MetricRows) -> str:
    """The event line of one flush: the progress bars that changed and the rows taken."""
    return protocol.report_line(json.dumps(bars, separators=(",", ":")), rows.to_json() if rows else None)


def flush() -> None:
    """Send what is buffered now; the rank calls it before reporting its result."""
    global _progress_sent
    if _events is None:
        return
    send_horovod_stage()
    _note_keras_once()
    with _write_lock:  # take and write as one step, so two flushes cannot reorder batches
        pending = _pending[:]
        del _pending[: len(pending)]
        _restarted.clear()
        sent = _progress_sent
        for then in pending:  # a line each, before the bars' newest states
            if changed := {desc: state for desc, state in then.items() if sent.get(desc) != state}:
                _events.write(report_line(changed, MetricRows()))
                sent = {**sent, **changed}
        snapshot = dict(_progress)
        bars = {desc: state for desc, state in snapshot.items() if sent.get(desc) != state}
        _progress_sent = snapshot
        rows = _take_rows()
        if not rows and not bars:
            if pending:
                _events.flush()
            return
        _events.write(report_line(bars, rows))
        _events.flush()


def deliver(wait: float = 2 * SYNC_WAIT) -> bool:
    """Send what is buffered, and wait until the kernel has it and everything this rank sent before.

    The supervisor answers once the kernel's end of the channel has acknowledged those events (it
    waits for that while its connection is up, ``protocol.SYNC_WAIT`` seconds at most, and not at all
    while it is down); ``wait`` bounds this side's wait, should the supervisor not answer at all.
    True when the kernel has them; False when it did not (the network is down, or the kernel was
    too slow: they stay in the task's buffer and go when it can take them), or outside a run.
    An elastic commit calls it (``rank.elastic``): the steps it keeps are never
    trained again, so their rows must be in the kernel before a lost worker can take them along.
    """
    global _syncs
    if _events is None:
        return False
    flush()
    with _sync_lock:
        _syncs += 1
        emit(protocol.sync(_syncs))
        return _await_answer(_syncs, time.monotonic() + wait)


def _await_answer(number: int, deadline: float) -> bool:
    """Read the supervisor's answers until the one to sync ``number``; earlier ones came too late."""
    global _answers
    fd = _events.fileno()
    while True:
        while b"\n" in _answers:
            line, _answers = _answers.split(b"\n", 1)
            try:
                answer = json.loads(line)
            except ValueError:
                continue
            if answer.get("id") == number:
                return bool(answer.get("delivered"))
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return False
        chunk = os.read(fd, 4096)
        if not chunk:  # the supervisor is gone
            return False
        _answers += chunk


HOROVOD_MODULES = ("horovod.torch", "horovod.tensorflow", "horovod.tensorflow.keras", "horovod.keras")


def send_horovod_stage() -> None:
    """The stage horovod is at, when it moved on since it was last sent: so a rank that fails or
    reports just after ``hvd.init`` is known to have got past it (a flush precedes each), and one
    stopped in its first collective (``rank.collective_wait`` sends it there)."""
    global _stage_sent
    if _stage_sent is not Stage.FIRST_STEP and (now := _horovod_stage()) is not None and now != _stage_sent:
        _stage_sent = now
        emit(protocol.stage_reached(now))


_stage_sent: Stage | None = None


def _horovod_stage() -> Stage | None:
    """HVD_INIT once the cell has imported horovod, FIRST_STEP once it has initialised it.

    Read from the outside, every flush: the user's code does not call us to say so.
    """
    loaded = [m for m in map(sys.modules.get, HOROVOD_MODULES) if m is not None and hasattr(m, "is_initialized")]
    if not loaded:
        return None
    try:
        initialised = any(m.is_initialized() for m in loaded)
    except Exception:  # a module still half-imported
        return None
    return Stage.FIRST_STEP if initialised else Stage.HVD_INIT


_KERAS_NOTE = ("hvdmagic: the ranks run Keras 2 (tf_keras, TF_USE_LEGACY_KERAS=1): under Keras 3, "
               "horovod.tensorflow.keras does not average gradients (docs/frameworks.md)")


def _keras_note_due() -> bool:
    """Rank 0, once it has imported TensorFlow, when hvdmagic (not the user) chose Keras 2 for it."""
    return ("tensorflow" in sys.modules and os.environ.get(LEGACY_KERAS_SET_ENV) == "1"
            and os.environ.get("HOROVOD_RANK", os.environ.get("RANK", "0")) == "0")


def _note_keras_once() -> None:
    """The Keras 2 note, once, as soon as it is due: from the flusher, or from the last flush of a rank
    whose cell ended sooner than the flusher looked (TensorFlow imported ahead, in its host's template)."""
    global _keras_noted
    if not _keras_noted and _keras_note_due():
        _keras_noted = True
        emit(protocol.note(_KERAS_NOTE, once="keras"))


_keras_noted = False


def _flush_loop() -> None:
    next_beat = time.monotonic()
    while True:
        _wake.wait(FLUSH_INTERVAL)
        _wake.clear()
        try:
            flush()
            if time.monotonic() >= next_beat:
                emit(protocol.bare(Event.HEARTBEAT))
                next_beat = time.monotonic() + HEARTBEAT_INTERVAL
        except (OSError, ValueError):
            # The socket is gone, so is the supervisor that read it (a killed kernel, a lost task):
            # nobody will read this rank again, and a session's rank mid-cell would otherwise live on.
            os._exit(137)
