"""A session's rank (``%horovod start``): one namespace for the session's life, cells as they come.

The supervisor writes each cell to our stdin as a length-prefixed pickle (its payload
came over the job's authenticated channel); EOF means the session, or the
supervisor, ended. Stop (the kernel's interrupt) arrives as SIGINT and raises
KeyboardInterrupt in the cell's code only: between cells it is ignored, so an
interrupt that comes late cannot break the loop or a report.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from hvdmagic.protocol import Event
from hvdmagic.rank import report
from hvdmagic.rank.cell import CellFunction

# Errors after which the ranks' collectives cannot be trusted: the session restarts its ranks.
_BROKEN_COLLECTIVES = ("HorovodInternalError", "DistBackendError", "DistNetworkError")


def serve(rank: int, policy: str) -> int:
    import cloudpickle

    from hvdmagic.rank.__main__ import error_event, report_result

    in_cell = threading.Event()

    def on_interrupt(_signum, _frame) -> None:
        if in_cell.is_set():
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    namespace: dict = {}
    report.emit({"type": Event.IDLE, "cell": None, "rss": _rss()})
    while (request := _next_cell(sys.stdin.buffer)) is not None:
        cell = request["id"]
        try:
            fn, args, kwargs = cloudpickle.loads(request["payload"])
            in_cell.set()
            try:
                if isinstance(fn, CellFunction):
                    value = fn(namespace=namespace, filename=f"<horovod-cell-{cell}>")
                else:
                    value = fn(*args, **kwargs)
            finally:
                in_cell.clear()
            report_result(value, rank, policy, cell=cell)
        except BaseException as exc:  # KeyboardInterrupt and SystemExit too: the session goes on
            in_cell.clear()
            report.flush()
            report.emit(error_event(exc, cell=cell, broken=_breaks_collectives(exc)))
        sys.stdout.flush()
        sys.stderr.flush()
        report.emit({"type": Event.IDLE, "cell": cell, "rss": _rss()})
    return 0


def _next_cell(stdin) -> dict | None:
    import pickle

    header = _read(stdin, 4)
    if header is None:
        return None
    body = _read(stdin, int.from_bytes(header, "big"))
    return None if body is None else pickle.loads(body)


def _read(stdin, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = stdin.read(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


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
