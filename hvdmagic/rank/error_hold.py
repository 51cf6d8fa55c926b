"""``--hold-on-error S``: a fresh cell's rank that failed waits S seconds, its traceback kept, for ``%debug``.

A fresh ``--np N`` cell's ranks end with it, and their frames with them. With
``HVDMAGIC_HOLD_ON_ERROR`` in its environment (the magic sets it from ``--hold-on-error`` or the
kernel's own variable), a rank whose cell raised reports its error as usual, says HELD, and
waits: for a DEBUG on its stdin (the kernel's ``%debug``, sent to this rank's task alone over
the job's authenticated channel), which runs pdb on the failure as a session's rank does
(``rank.debugger``); or for S seconds to pass; or for its supervisor to go. Then it exits with
the cell's failure code, and its task, and the job's channel, end.

Its stdin is read all along by the thread that ends the rank when its supervisor dies
(``relay_stdin``), so the frames written on it reach the rank through a pipe of its own.
"""

from __future__ import annotations

import os
import select
import threading
import time

from hvdmagic import protocol
from hvdmagic.protocol import Event
from hvdmagic.rank import telemetry

HOLD_ENV = "HVDMAGIC_HOLD_ON_ERROR"


def seconds() -> float:
    """How long this rank waits after its cell fails: 0 (not at all) unless the variable says more.
    Never under mpirun, which ends every rank once one fails."""
    if os.environ.get("OMPI_COMM_WORLD_SIZE"):
        return 0.0
    try:
        value = float(os.environ.get(HOLD_ENV) or 0)
    except ValueError:
        return 0.0
    return value if value > 0 else 0.0


def relay_stdin():
    """Read stdin on a thread: EOF (the supervisor is gone) ends the process at once, as for any
    one-shot rank; what comes before goes on through a pipe, returned as a binary stream."""
    read_end, write_end = os.pipe()

    def relay() -> None:
        # Raw reads on fd 0: a daemon thread blocked in the buffered reader would abort the
        # interpreter at shutdown while holding its lock.
        while data := os.read(0, 65536):
            os.write(write_end, data)
        os._exit(137)

    threading.Thread(target=relay, name="hvdmagic-parent-watch", daemon=True).start()
    return os.fdopen(read_end, "rb")


def hold(failure: BaseException, rank: int, wait: float, stdin) -> None:
    """Wait ``wait`` seconds for the kernel's DEBUG, and run pdb on ``failure`` when it comes."""
    # Imported once a cell has failed: pdb and the cell loop cost every rank's start nothing.
    from hvdmagic.rank import debugger, subset_guard
    from hvdmagic.rank.cell_loop import Interrupts

    interrupts = Interrupts()  # from here on, Stop's SIGINT reaches only what pdb evaluates
    telemetry.emit(protocol.held(wait))
    telemetry.flush()
    deadline = time.monotonic() + wait
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([stdin], [], [], left)[0]:
            return  # nobody came: the hold is over
        request = protocol.read_request(stdin)
        if request is None:
            return
        if isinstance(request, dict) and request.get("type") == Event.DEBUG:
            # The other ranks have ended: a collective in pdb would wait for them for ever.
            with subset_guard.engaged((rank,) if _size() > 1 else None, in_pdb=True):
                debugger.post_mortem(failure, None, stdin, interrupts)
            return


def _size() -> int:
    return int(os.environ.get("HOROVOD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
