"""How a rank tells the driver that its cell ended: the value it returned, or the exception it raised.

Used by the one-shot rank (``rank.__main__``) and the session's cell loop
(``rank.cell_loop``) alike.
"""

from __future__ import annotations

import base64
import bdb
import os
import sys
import sysconfig
import time
import traceback
from pathlib import Path

from hvdmagic import protocol
from hvdmagic.protocol import ResultPolicy
from hvdmagic.rank import telemetry

_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)  # all of hvdmagic: its frames are not the user's
_LIBRARY_DIRS = tuple({sysconfig.get_paths()[name] for name in ("stdlib", "purelib", "platlib")})


def report_result(value, rank: int, policy: str, **fields) -> None:
    """Send the cell's value as the policy says; ``fields`` tag the event (a session's cell id)."""
    from hvdmagic import pickling

    # The rows first: pickling a value can take seconds (a Keras History holds its model), and the
    # rank's last steps must not wait for it.
    telemetry.flush()
    event = protocol.result(None, **fields)
    if policy != ResultPolicy.RANK0 or rank == 0:  # under RANK0 the others' values would be thrown away
        try:
            event["data"] = base64.b64encode(pickling.dumps(value)).decode("ascii")
        except Exception as exc:
            kind = f"{type(value).__module__}.{type(value).__qualname__}"
            if policy != ResultPolicy.ALL_OR_REPR:
                raise TypeError(f"the result ({kind}) cannot be pickled to send it back to the notebook: "
                                f"{exc}") from None
            # The training has finished: a value only the notebook would have displayed must not fail it.
            event.update(unpicklable=kind, repr=_short_repr(value), reason=f"{type(exc).__name__}: {exc}"[:300])
    telemetry.flush()  # anything the pickling logged, before the result
    telemetry.emit(event)


def report_error(exc: BaseException, **fields) -> None:
    """Send the exception the cell raised, after all it printed before it (``mark_output_end``):
    the driver tells the lines that came after it, the stop's noise, from those that explain it."""
    telemetry.flush()
    mark_output_end()
    telemetry.emit(error_event(exc, **fields))


def mark_output_end() -> None:
    """Flush what the rank printed and mark the spot on both streams (``protocol.CELL_END_MARK``),
    on the file descriptors the supervisor reads, whatever the cell did to sys.stdout. The
    supervisor relays the next event (the cell's idle, or an error) once both marks have passed."""
    for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
        try:
            os.write(fd, protocol.CELL_END_MARK)
        except OSError:
            pass  # a closed stream: the supervisor's wait for the mark is bounded


def _short_repr(value, limit: int = 500) -> str:
    try:
        text = repr(value)
    except Exception as exc:
        text = f"<repr failed: {type(exc).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


# What horovod says when its build does not fit this host's frameworks (not built for one, another version).
_BUILD_MISMATCH = ("has not been built", "Reinstall Horovod", "undefined symbol", "was built without")
_REBUILD = ("this host's horovod does not match its frameworks: rebuild it here with python -m "
            "hvdmagic.build_horovod --frameworks pytorch,tensorflow (docs/frameworks.md)")


def error_event(exc: BaseException, **fields) -> protocol.Error:
    if isinstance(exc, bdb.BdbQuit):  # q at a breakpoint()'s pdb: the user ended the cell, no traceback to read
        return protocol.error("BdbQuit", "q in pdb at breakpoint() ended the cell", "", time.time(), **fields)
    message, trace = str(exc), _user_traceback(exc)
    if any(sign in message for sign in _BUILD_MISMATCH) and "horovod" in trace:
        message = f"{message} ({_REBUILD})"
    # The rank-side time lets the driver tell the first failure from its fallout.
    return protocol.error(type(exc).__name__, message, trace, time.time(), **fields)


def _user_traceback(exc: BaseException) -> str:
    """The traceback from the first frame of user code on, without our own frames: the ones that
    run the cell, and the ones in between that instrument the frameworks (``collective_wait``'s
    timing wrapper sits between the user's ``synchronize`` call and horovod's)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        tb = tb.tb_next
    from hvdmagic.rank.cell import DISPLAY_NAMES

    shown = traceback.TracebackException(type(exc), exc, tb)
    frames = [frame for frame in shown.stack if not frame.filename.startswith(_PACKAGE_DIR)]
    if getattr(exc, "ends_at_the_users_call", False):  # hvdmagic refused a library call (rank.subset_guard)
        users = [i for i, frame in enumerate(frames) if not in_library(frame.filename)]
        frames = frames[:users[-1] + 1] if users else frames
    shown.stack = traceback.StackSummary.from_list(frames)
    return _name_cells("".join(shown.format()), DISPLAY_NAMES)


def in_library(filename: str) -> bool:
    """Whether a frame of ``filename`` is a library's (the standard library, an installed package, hvdmagic),
    not the user's."""
    return filename.startswith((_PACKAGE_DIR, *_LIBRARY_DIRS))


def _name_cells(text: str, names: dict[str, str]) -> str:
    """Name a frame in a notebook cell as IPython does: ``Cell In[3], line 5, in f``.

    ``names`` maps a file (``/tmp/ipykernel_1234/567.py``, which exists only in the
    kernel) to its cell's name; the source line under the header is linecache's,
    which ``CellFunction`` filled. Other frames, and exception groups' ``|`` margins, stay.
    """
    import re

    def rename(match: re.Match) -> str:
        name = names.get(match["file"])
        return match[0] if name is None else f"{match['margin']}{name}, line {match['line']}"

    if not names:
        return text
    return re.sub(r'^(?P<margin>[ |]*)File "(?P<file>[^\n]*)", line (?P<line>\d+)', rename, text, flags=re.M)
