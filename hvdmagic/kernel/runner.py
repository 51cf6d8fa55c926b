"""One run as the user sees it: the launcher core, a run record and a view, wired together.

The magic, ``hvdmagic.run`` and ``HorovodRunner`` all go through ``execute``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hvdmagic import protocol
from hvdmagic.errors import JobFailed, JobInterrupted
from hvdmagic.kernel import breakpoint_console, rank_debugger
from hvdmagic.kernel.busy_status import kernel_stays_busy
from hvdmagic.kernel.cell_frames import CellFrames
from hvdmagic.kernel.record import RunRecord, set_last
from hvdmagic.kernel.ui import make_view
from hvdmagic.launch import Placement, ResultPolicy, UnsentResult, launch
from hvdmagic.launch.interrupts import before_launch
from hvdmagic.launch.shipment import Shipment
from hvdmagic.protocol import Stage
from hvdmagic.rank.cell import CELL_FILENAME, CellFunction, session_filename


def execute(payload: Shipment, placement: Placement | None, *, timeout: float | None = None,
            stall_timeout: float | None = None, timeline: str | None = None, data=None, spark=None, view=None,
            results: ResultPolicy = ResultPolicy.ALL, session=None, command: str = "%%horovod",
            captured: str = "", env: dict[str, str] | None = None, charts_expected: bool = False,
            bars_expected: bool = False, cell: CellFunction | None = None,
            reconnect_grace: float | None = None, prepare: Callable[[Callable[[Stage], None]], Any] | None = None,
            ranks: list[int] | None = None) -> RunRecord:
    """Run a packed ``(fn, args, kwargs)`` (``launch.shipment.pack``) where ``placement`` says; return its record.

    ``timeline``: a path where rank 0 records a Horovod Timeline. ``results``: which
    ranks send their value back. Raises the job's error after the record and the
    view have been closed with it. Under ``ResultPolicy.ALL_OR_REPR`` an unpicklable
    rank-0 value is printed as a one-line warning with its repr, and the result is None.
    ``session``: a running ``launch.warm_ranks.Session`` whose warm ranks run it instead of
    new ones (``placement`` is then the session's). ``command`` names the run in its views.
    An elastic placement's record has a row per task (``max_np``) and lists the resets.
    ``captured``: what the magic captured (``Capture.summary``), kept in the record.
    ``charts_expected``: the run will likely log metrics; its dashboard keeps room for the charts.
    ``bars_expected``: the ranks will likely drive progress bars; its dashboard keeps the overall bar's row.
    ``env``: variables for every rank's environment (``--stall-check``, ``--debug``); a new
    job's only, since a session's ranks run with the environment they started with.
    ``cell``: the %%horovod cell the payload runs, so that the ranks' stacks name its frames as the
    notebook does (``kernel.cell_frames``). ``reconnect_grace``: seconds a task whose connection
    to the kernel broke may take to come back (``--reconnect-grace``); a new job's only.
    ``prepare``: the caller's work before the launch, run with the dashboard already up and its stages
    shown (an estimator's checks and counts of its DataFrame take seconds of Spark jobs): called with an
    ``on_stage`` callback, it returns the ``data`` to launch with; what it raises is the run's error.
    ``ranks``: a session's cell on those ranks only (``--ranks``); the record's other rows stay "idle",
    and its ``results`` are the chosen ranks', in rank order.
    """
    if session is not None:
        placement = session.placement
        ranks = session.check_ranks(ranks)
    record = RunRecord(placement, command, ranks=ranks)
    record.capture = captured
    record.charts_expected = charts_expected
    record.bars_expected = bars_expected
    record.cell_frames = CellFrames(cell, session_filename(session.next_cell) if session is not None else CELL_FILENAME)
    env = dict(env or {})
    if timeline:
        record.timeline = str(Path(timeline).expanduser().resolve())
        Path(record.timeline).parent.mkdir(parents=True, exist_ok=True)
        env["HOROVOD_TIMELINE"] = record.timeline
    set_last(record)
    view = view or make_view(record)
    with kernel_stays_busy():
        return _run(payload, placement, record, view, timeout=timeout, stall_timeout=stall_timeout, env=env,
                    spark=spark, data=data, results=results, session=session, reconnect_grace=reconnect_grace,
                    prepare=prepare, ranks=ranks)


def _run(payload, placement, record, view, *, timeout, stall_timeout, env, spark, data, results, session,
         reconnect_grace, prepare, ranks):
    def on_event(event: dict) -> None:
        record.apply(event)
        view.on_event(event)

    def on_stage(stage: Stage) -> None:
        on_event(protocol.stage_reached(stage))

    generation = session.generation if session is not None else 0  # a restart during the cell takes its frames
    try:
        with before_launch():  # the view's start starts a thread, and waits for it to run
            view.start()
        if prepare is not None:
            try:
                with before_launch(lambda: record.stage):
                    data = prepare(on_stage)
            except BaseException:
                record.ended_before_launch = True
                raise
        if session is not None:
            values = session.run_cell(payload, on_event, timeout=timeout, stall_timeout=stall_timeout,
                                      requests=record.requests, ranks=ranks, console=breakpoint_console.console())
        else:
            values = launch(payload, placement, timeout=timeout, stall_timeout=stall_timeout, env=env,
                            on_event=on_event, spark=spark, data=data, results=results,
                            requests=record.requests, reconnect_grace=reconnect_grace,
                            console=breakpoint_console.console()).results
    except JobInterrupted as exc:
        exc.stacks = record.cell_frames.each_named(exc.stacks)
        record.stacks = exc.stacks
        exc.flight_records = dict(record.flight_records)
        record.finish(error=exc, cancelled=True)
        rank_debugger.remember(exc, session, generation)
        raise
    except BaseException as exc:
        if isinstance(exc, JobFailed):
            failed = [record.ranks[f.rank] for f in exc.failures if 0 <= f.rank < record.np]
            exc.quiet_output = {rank.rank: rank.quiet_before_failure for rank in failed if rank.quiet_before_failure}
            exc.after_failure = {rank.rank: rank.after_failure for rank in failed if rank.after_failure}
            exc.stacks = record.cell_frames.each_named(exc.stacks)  # the message, made when shown, reads them
            record.stacks = exc.stacks
            exc.flight_records = dict(record.flight_records)
            for failure in exc.failures:
                # A rank killed by a signal raised nothing; its fault handler's stacks say where it was.
                if not failure.traceback and 0 <= failure.rank < record.np:
                    failure.traceback = record.cell_frames.named(record.ranks[failure.rank].where_it_died())
                    if failure.traceback:  # last_run().stacks keeps it too, with its native frames
                        record.stacks = {**record.stacks, failure.rank: failure.traceback}
        record.finish(error=exc)
        rank_debugger.remember(exc, session, generation)
        raise
    else:
        if values and isinstance(values[0], UnsentResult):
            print(values[0].warning(), flush=True)
            values = [None, *values[1:]]
        record.finish(results=values)
    finally:
        view.close()
    return record
