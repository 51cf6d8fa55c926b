"""A transform's progress, from the executors' Python workers to the notebook's kernel.

Runs in the Python worker that runs a transform's pandas UDF (``task.batch_inference``). Each
task says when it starts, how many rows it has predicted (at most every ``REPORT_EVERY``
seconds) and when it ends, to the kernel's progress server (``spark.common.transform_progress``),
which shows them under the cell that runs the action. The frames go on one authenticated link
per worker (``channel``, under the server's secret), from a thread of the worker's own: a
prediction never waits for the kernel, and a kernel that cannot be reached costs only the
reports, which are then dropped.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass

from hvdmagic import channel, protocol

REPORT_EVERY = 0.5
_CONNECT_TIMEOUT = 5.0


@dataclass(frozen=True)
class ReportTo:
    """The kernel's progress server, as the UDF carries it."""

    address: tuple[str, int]
    secret: bytes


class _Sender:
    """This worker's link to one progress server, fed from a queue by a daemon thread."""

    def __init__(self, to: ReportTo):
        self._to = to
        self._frames: queue.SimpleQueue = queue.SimpleQueue()
        self.broken = False
        threading.Thread(target=self._send_all, name="hvdmagic-transform-reports", daemon=True).start()

    def put(self, frame: dict) -> None:
        if not self.broken:
            self._frames.put(frame)

    def _send_all(self) -> None:
        try:
            link = channel.connect(*self._to.address, self._to.secret, timeout=_CONNECT_TIMEOUT)
        except OSError:
            self.broken = True  # no progress line for this worker's tasks; their predictions are unaffected
            return
        with contextlib.closing(link):
            while True:
                frame = self._frames.get()
                try:
                    link.send(frame)
                except OSError:
                    self.broken = True
                    return


_senders: dict[ReportTo, _Sender] = {}
_senders_lock = threading.Lock()


def _sender(to: ReportTo) -> _Sender:
    with _senders_lock:
        sender = _senders.get(to)
        if sender is None or sender.broken:
            sender = _senders[to] = _Sender(to)
        return sender


def _task_name() -> str:
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is None:
        return f"local-{threading.get_ident()}"
    return f"{context.stageId()}.{context.partitionId()}.{context.attemptNumber()}"


class TaskReport:
    """One task's reports: ``add(rows)`` as its batches are predicted, ``end()`` when it stops."""

    def __init__(self, to: ReportTo):
        self._sender = _sender(to)
        self._task = _task_name()
        self._rows = 0
        self._sent_at = 0.0
        self._send("running")

    def add(self, rows: int) -> None:
        self._rows += rows
        if time.monotonic() - self._sent_at >= REPORT_EVERY:
            self._send("running")

    def end(self, failed: bool) -> None:
        self._send("failed" if failed else "done")

    def _send(self, state: str) -> None:
        self._sent_at = time.monotonic()
        self._sender.put(protocol.predicted(self._task, self._rows, state))
