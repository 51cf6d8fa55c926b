"""One run as the user sees it: the launcher core, a run record and a view, wired together.

The magic, ``hvdmagic.run`` and ``HorovodRunner`` all go through ``execute``.
"""

from __future__ import annotations

from pathlib import Path

from hvdmagic.errors import JobFailed, JobInterrupted
from hvdmagic.kernel.record import RunRecord, set_last
from hvdmagic.kernel.ui import make_view
from hvdmagic.launch import Elastic, ResultPolicy, UnsentResult, launch
from hvdmagic.protocol import Framework


def execute(payload: bytes, np: int, *, timeout: float | None = None, stall_timeout: float | None = None,
            timeline: str | None = None, data=None, spark=None, view=None, controller: str = "gloo",
            results: ResultPolicy = ResultPolicy.ALL, framework: Framework = Framework.HOROVOD,
            gpus: bool = False, session=None, command: str = "%%horovod", elastic: Elastic | None = None
            ) -> RunRecord:
    """Run a cloudpickled ``(fn, args, kwargs)`` on |np| ranks; return its record.

    ``timeline``: a path where rank 0 records a Horovod Timeline. ``results``: which
    ranks send their value back. Raises the job's error after the record and the
    view have been closed with it. Under ``ResultPolicy.ALL_OR_REPR`` an unpicklable
    rank-0 value is printed as a one-line warning with its repr, and the result is None.
    ``session``: a running ``launch.session.Session`` whose warm ranks run it instead of
    new ones (``np`` is then the session's). ``command`` names the run in its views.
    ``elastic``: Horovod elastic training (``launch.Elastic``); the record has a row per
    task (``max_np``) and lists the resets.
    """
    if session is not None:
        np = session.np
    if elastic is None:
        record = RunRecord(np, command)
    else:
        record = RunRecord(elastic.max_np if np > 0 else -elastic.max_np, command,
                           elastic=(elastic.min_np, abs(np), elastic.max_np))
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
        if session is not None:
            values = session.run_cell(payload, on_event, timeout=timeout, stall_timeout=stall_timeout)
        else:
            values = launch(payload, np, timeout=timeout, stall_timeout=stall_timeout, env=env, on_event=on_event,
                            spark=spark, data=data, controller=controller, results=results, framework=framework,
                            gpus=gpus, elastic=elastic).results
    except JobInterrupted as exc:
        record.finish(error=exc, cancelled=True)
        raise
    except BaseException as exc:
        if isinstance(exc, JobFailed):
            exc.quiet_output = {f.rank: record.ranks[f.rank].quiet for f in exc.failures
                                if 0 <= f.rank < record.np and record.ranks[f.rank].quiet}
        record.finish(error=exc)
        raise
    else:
        if values and isinstance(values[0], UnsentResult):
            print(values[0].warning(), flush=True)
            values = [None, *values[1:]]
        record.finish(results=values)
    finally:
        view.close()
    return record
