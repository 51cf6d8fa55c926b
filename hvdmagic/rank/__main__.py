"""Entry point of one rank process: ``python -m hvdmagic.rank``.

The supervisor that started us writes a pickled bootstrap on stdin (a local pipe
from our own parent, so it is trusted) and keeps stdin open: EOF means the
supervisor is gone, and the rank exits rather than live on as an orphan holding
a GPU. Structured events (result, error) go to the supervisor as JSON lines on
the file descriptor named by ``HVDMAGIC_EVENT_FD``; stdout and stderr are
forwarded by the supervisor as they are.
"""

from __future__ import annotations

import base64
import os
import pickle
import sys
import threading
import time
import traceback
from pathlib import Path

from hvdmagic.protocol import Event, ResultPolicy, Stage
from hvdmagic.rank import report

_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)  # all of hvdmagic: its frames are not the user's


def _exit_when_supervisor_dies() -> None:
    # Raw reads on fd 0: a daemon thread blocked in the buffered reader would
    # abort the interpreter at shutdown while holding its lock.
    while os.read(0, 4096):
        pass
    os._exit(137)


def _user_traceback(exc: BaseException) -> str:
    """The traceback from the first frame of user code on, without our own frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        tb = tb.tb_next
    from hvdmagic.rank.cell import DISPLAY_NAMES

    return _name_cells("".join(traceback.format_exception(type(exc), exc, tb)), DISPLAY_NAMES)


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


def _shutdown_horovod() -> None:
    """Shut Horovod down, if the cell started it, before the process exits.

    Horovod's shutdown stops its timeline writer without draining the writer's
    queue, so on a slow machine a Timeline loses its last events or stays empty;
    stop_timeline() first blocks until the queue is written and the file closed.
    The result is reported before this: shutdown can block while others still train.
    """
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and hvd.is_initialized():
        if os.environ.get("HOROVOD_TIMELINE"):
            hvd.stop_timeline()
        hvd.shutdown()


def report_result(value, rank: int, policy: str, **fields) -> None:
    """Send the cell's value as the policy says; ``fields`` tag the event (a session's cell id)."""
    from hvdmagic import pickling

    event = {"type": Event.RESULT, "data": None, **fields}
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
    report.flush()  # every metric reaches the driver before the result does
    report.emit(event)


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


def error_event(exc: BaseException, **fields) -> dict:
    message = str(exc)
    if any(sign in message for sign in _BUILD_MISMATCH) and "horovod" in _user_traceback(exc):
        message = f"{message} ({_REBUILD})"
    return {
        "type": Event.ERROR,
        "time": time.time(),  # lets the driver tell the first failure from its fallout
        "exc_type": type(exc).__name__,
        "message": message,
        "traceback": _user_traceback(exc),
        **fields,
    }


def main() -> int:
    boot = pickle.load(sys.stdin.buffer)
    report.open_events()
    report.emit({"type": Event.STAGE, "stage": Stage.IMPORTING})
    if boot.get("session"):
        from hvdmagic.rank.session import serve

        return serve(boot["rank"], boot.get("results", ResultPolicy.ALL))
    threading.Thread(target=_exit_when_supervisor_dies, name="hvdmagic-parent-watch", daemon=True).start()
    if boot.get("elastic"):
        from hvdmagic.rank import elastic

        elastic.install()
    try:
        import cloudpickle

        fn, args, kwargs = cloudpickle.loads(boot["payload"])
        try:
            value = fn(*args, **kwargs)
        except SystemExit as exc:
            # sys.exit() inside the cell ends this rank; a zero code is a normal, result-less end.
            if exc.code in (None, 0):
                value = None
            else:
                raise
        rank, fields = boot["rank"], {}
        if boot.get("elastic"):  # ranks change at resets: rank 0 is whoever is rank 0 at the end
            from hvdmagic.rank.elastic import world

            rank = world().get("world_rank", int(os.environ.get("HOROVOD_RANK", "0")))
            fields["world_rank"] = rank
        report_result(value, rank, boot.get("results", ResultPolicy.ALL), **fields)
        _shutdown_horovod()
    except BaseException as exc:
        report.flush()
        report.emit(error_event(exc))
        sys.stdout.flush()
        sys.stderr.flush()
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


def _exit(code: int) -> None:
    """Exit without the interpreter's teardown.

    Tearing down a process that imported torch takes 0.5-0.7 s, and every cell
    waits for its slowest rank to exit. atexit hooks (the cell's own included)
    still run; only module and object finalisation is skipped, which frees
    nothing the operating system does not free anyway.
    """
    import atexit

    atexit._run_exitfuncs()
    for flush in (report.flush, sys.stdout.flush, sys.stderr.flush):
        try:
            flush()
        except (OSError, ValueError):
            pass  # the supervisor is gone; nobody is left to read it
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
