"""A session's rank (``%horovod start``): one namespace for the session's life, cells as they come.

The supervisor writes each cell's payload to our stdin (``protocol.write_payload``;
it came over the job's authenticated channel); EOF means the session, or the
supervisor, ended. Stop (the kernel's interrupt) arrives as SIGINT and raises
KeyboardInterrupt in the cell's code only: between cells it is ignored, so an
interrupt that comes late cannot break the loop or a report.
"""

from __future__ import annotations

import os
import signal
import threading

from hvdmagic import protocol
from hvdmagic.rank import telemetry
from hvdmagic.rank.blobs import load_payload
from hvdmagic.rank.cell import CellFunction, session_filename
from hvdmagic.rank.outcome import mark_output_end, report_error, report_result

# Errors after which the ranks' collectives cannot be trusted: the session restarts its ranks.
_BROKEN_COLLECTIVES = ("HorovodInternalError", "DistBackendError", "DistNetworkError")


def serve(rank: int, policy: str, stdin) -> int:
    in_cell = threading.Event()

    def on_interrupt(_signum, _frame) -> None:
        if in_cell.is_set():
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    namespace: dict = {}
    telemetry.emit(protocol.idle(None, _rss()))
    while (request := protocol.read_payload(stdin)) is not None:
        cell, payload = request
        try:
            fn, args, kwargs = load_payload(payload)
            in_cell.set()
            try:
                if isinstance(fn, CellFunction):
                    value = fn(namespace=namespace, filename=session_filename(cell))
                else:
                    value = fn(*args, **kwargs)
            finally:
                in_cell.clear()
            report_result(value, rank, policy, cell=cell)
        except BaseException as exc:  # KeyboardInterrupt and SystemExit too: the session goes on
            in_cell.clear()
            report_error(exc, cell=cell, broken=_breaks_collectives(exc))
        mark_output_end()
        telemetry.emit(protocol.idle(cell, _rss()))
    return 0


def _breaks_collectives(exc: BaseException) -> bool:
    """Whether ``exc`` came from a collective that failed (Horovod shuts itself down for good
    then; Gloo's pairs with the peer are gone), rather than from the user's own code."""
    text = str(exc)
    return (type(exc).__name__ in _BROKEN_COLLECTIVES or "Horovod has been shut down" in text
            or "gloo/transport" in text)


def _rss() -> int:
    """This process's resident memory in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
