"""A session's rank (``%horovod start``): one namespace for the session's life, cells as they come.

The supervisor writes each cell's payload to our stdin (``protocol.write_payload``;
it came over the job's authenticated channel); EOF means the session, or the
supervisor, ended. Stop (the kernel's interrupt) arrives as SIGINT and raises
KeyboardInterrupt in the cell's code only: between cells it is ignored, so an
interrupt that comes late cannot break the loop or a report.

A cell may run on some of the ranks only (``--ranks``): the others never see it, and on
those that run it ``subset_guard`` refuses the collectives the others would never join.

A cell that fails leaves its exception here, with its frames, until the next failure (as
IPython keeps ``sys.last_traceback``): ``%debug`` sends DEBUG, between cells, and
``rank.debugger`` runs pdb on it, its lines read from the same stdin. A ``breakpoint()`` in a
cell reads its lines there too, while the cell runs: nothing else comes on stdin until the cell
ends, since the kernel sends the next cell only then.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

from hvdmagic import protocol
from hvdmagic.protocol import Event
from hvdmagic.rank import debugger, subset_guard, telemetry
from hvdmagic.rank.blobs import load_payload
from hvdmagic.rank.cell import CellFunction, session_filename
from hvdmagic.rank.outcome import mark_output_end, report_error, report_result

# Errors after which the ranks' collectives cannot be trusted: the session restarts its ranks.
_BROKEN_COLLECTIVES = ("HorovodInternalError", "DistBackendError", "DistNetworkError")


class Interrupts:
    """When SIGINT (Stop) raises KeyboardInterrupt: while a cell's code or a debugger's command runs,
    never between cells or while a frame is read from stdin."""

    def __init__(self):
        self._allowed = threading.Event()
        signal.signal(signal.SIGINT, self._on_interrupt)

    def _on_interrupt(self, _signum, _frame) -> None:
        if self._allowed.is_set():
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def allowed(self, allowed: bool = True):
        before = self._allowed.is_set()
        (self._allowed.set if allowed else self._allowed.clear)()
        try:
            yield
        finally:
            (self._allowed.set if before else self._allowed.clear)()

    def held(self):
        return self.allowed(False)


def serve(rank: int, policy: str, stdin) -> int:
    interrupts = Interrupts()
    namespace: dict = {}
    failed: tuple[BaseException, int | None] | None = None  # the last failed cell's exception, and the cell
    debugger.install_breakpoint_hook(rank, lambda: protocol.read_request(stdin), interrupts)
    telemetry.emit(protocol.idle(None, _rss()))
    while (request := protocol.read_request(stdin)) is not None:
        if isinstance(request, dict):  # a control message between cells
            if request.get("type") == Event.DEBUG:
                exc, cell = failed or (None, None)
                # What the user evaluates in pdb runs on this rank alone: a collective there would wait for ever.
                with subset_guard.engaged((rank,) if _session_size() > 1 else None, in_pdb=True):
                    if not debugger.post_mortem(exc, cell, stdin, interrupts):
                        break  # stdin closed while pdb waited for a line: the session ended
            continue
        cell = request.cell
        try:
            fn, args, kwargs = load_payload(request.payload)
            with subset_guard.engaged(request.ranks), interrupts.allowed():
                if isinstance(fn, CellFunction):
                    value = fn(namespace=namespace, filename=session_filename(cell))
                else:
                    value = fn(*args, **kwargs)
            report_result(value, rank, policy, cell=cell)
        except BaseException as exc:  # KeyboardInterrupt and SystemExit too: the session goes on
            failed = (exc, cell)
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


def _session_size() -> int:
    """How many ranks the session has, from the variables its supervisor set (Horovod's or torchrun's)."""
    return int(os.environ.get("HOROVOD_SIZE") or os.environ.get("WORLD_SIZE") or 1)


def _rss() -> int:
    """This process's resident memory in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
