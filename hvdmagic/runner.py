"""One run as the user sees it: the launcher core, a run record and a view, wired together.

The magic, ``hvdmagic.run`` and ``HorovodRunner`` all go through ``execute``.
"""

from __future__ import annotations

from pathlib import Path

from hvdmagic.errors import JobInterrupted
from hvdmagic.launcher import launch
from hvdmagic.record import RunRecord, set_last
from hvdmagic.ui import make_view


def execute(payload: bytes, np: int, *, timeout: float | None = None, stall_timeout: float | None = None,
            timeline: str | None = None, data=None, session=None, view=None, controller: str = "gloo") -> RunRecord:
    """Run a cloudpickled ``(fn, args, kwargs)`` on |np| ranks; return its record.

    ``timeline``: a path where rank 0 records a Horovod Timeline. Raises the job's
    error after the record and the view have been closed with it.
    """
    record = RunRecord(np)
    env = {}
    if timeline:
        record.timeline = str(Path(timeline).expanduser().resolve())
        Path(record.timeline).parent.mkdir(parents=True, exist_ok=True)
        env["HOROVOD_TIMELINE"] = record.timeline
    set_last(record)
    view = view or make_view(record)

    def on_event(event: dict) -> None:
        record.apply(event)
        view.on_event(event)

    view.start()
    try:
        result = launch(payload, np, timeout=timeout, stall_timeout=stall_timeout, env=env, on_event=on_event,
                        session=session, data=data, controller=controller)
    except JobInterrupted as exc:
        record.finish(error=exc, cancelled=True)
        raise
    except BaseException as exc:
        record.finish(error=exc)
        raise
    else:
        record.finish(results=result.results)
    finally:
        view.close()
    return record
