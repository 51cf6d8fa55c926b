"""Warm ranks: one job whose ranks stay up between cells, each keeping its own namespace.

``%horovod start`` (or ``hvdmagic.session``) starts a Job in session mode on a
thread of the kernel: its ranks run ``hvdmagic.rank.cell_loop`` and wait. A cell is
one ``cell`` message over the job's authenticated channel, relayed by every
task's supervisor to its rank's stdin; the ranks answer with the usual events,
tagged with the cell's id, and ``idle`` when done. No Spark stage, no process
start and no import lie on a cell's path: a few messages on sockets already open.

Stop sends ``interrupt``: each supervisor signals its rank, whose cell code sees
KeyboardInterrupt. Ranks that do not come back within ``INTERRUPT_GRACE`` (stuck in
a collective, where no signal reaches Python) and ranks whose collectives broke
make the session restart its ranks, and say that their state is lost. A rank
that dies ends the job; the session restarts its ranks the same way.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hvdmagic import protocol, rank_ranges
from hvdmagic.errors import JobFailed, JobInterrupted, JobTimeout, LaunchError, RankFailure
from hvdmagic.launch import make_backend, preflight
from hvdmagic.launch.breakpoint_prompts import BreakpointPrompts, Console
from hvdmagic.launch.interrupts import interruptible
from hvdmagic.launch.job import STACKS_WAIT, Job, ShippingReports, result_value, serve_requests
from hvdmagic.launch.pdb_relay import PdbRelay
from hvdmagic.launch.placement import Placement, PlacementError
from hvdmagic.launch.shipment import Shipment
from hvdmagic.launch.stall_clock import StallClock
from hvdmagic.protocol import Event, Payload, ResultPolicy

INTERRUPT_GRACE = 5.0  # seconds the ranks get to leave a cell after Stop, before they are restarted
FAILURE_GRACE = 5.0  # seconds the other ranks get to finish a cell after one rank's error
POLL = 0.05
_JOB_ENDED: dict = {}  # put in the inbox, after the last event, when the job has ended
LOST_STATE = "the session's ranks were restarted, and what they held (models, data, variables) is lost"


@dataclass
class RankStatus:
    rank: int
    host: str
    busy: bool
    rss: int | None  # bytes, at the rank's last idle
    idle_since: float | None  # the kernel's monotonic clock


class Session:
    """Ranks that stay up between cells. See the module doc; ``hvdmagic.session`` is the Python API.

    Args:
        placement: the ranks (``Placement.of``): a Spark barrier stage or processes on the
            driver, Horovod's or torch.distributed's, under Gloo or mpirun; not elastic.
        start_timeout: seconds the ranks get to come up.
        idle_timeout: stop the session, freeing its slots and GPUs, after this many idle seconds.
    """

    def __init__(self, placement: Placement, *, start_timeout: float | None = None,
                 idle_timeout: float | None = None, spark=None):
        if placement.elastic is not None:
            raise PlacementError("a session runs a fixed number of ranks; elastic training runs in a cell "
                                 "of its own (give it --np N with --min-np/--max-np).")
        preflight(placement)
        self.placement = placement
        self.size = placement.np
        self.framework = placement.framework
        self.start_timeout = start_timeout
        self.idle_timeout = idle_timeout
        self.spark = spark
        self.ended: str | None = "not started"  # why the session is not running, or None while it runs
        self.generation = 0  # how many times its ranks were started: a restart's new ranks hold no old frames
        self._job: Job | None = None
        self._thread: threading.Thread | None = None
        self._job_error: BaseException | None = None
        self._inbox: queue.Queue[dict] = queue.Queue()
        self._lock = threading.Lock()  # one cell at a time
        self._cells = 0
        self._busy = False
        self._hosts: dict[int, str] = {}
        self._launching: dict | None = None  # the job's LAUNCHING event: where the ranks run, told again to each cell
        self._rss: dict[int, int] = {}
        self._idle_since: dict[int, float] = {}
        self._watcher: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.ended is None and self._thread is not None and self._thread.is_alive()

    def start(self, on_event: Callable[[dict], None] | None = None) -> None:
        """Bring the ranks up and wait until every one is idle in its namespace."""
        on_event = on_event or (lambda event: None)
        backend = make_backend(self.placement, on_event, spark=self.spark)
        if not self.placement.local:
            from hvdmagic.launch import spark

            spark.held_slots[self] = self.size  # a one-shot cell beside this session must not wait for them
        self._inbox = queue.Queue()
        self._job_error = None
        self._job = Job(backend, Shipment(Payload(b"")), self.placement, session=True, results=ResultPolicy.ALL_OR_REPR,
                        on_event=self._inbox.put)
        self._thread = threading.Thread(target=self._run_job, name="hvdmagic-session", daemon=True)
        self._thread.start()
        self.ended = None
        self.generation += 1
        idle: set[int] = set()
        deadline = time.monotonic() + self.start_timeout if self.start_timeout else None
        try:
            with interruptible():
                while len(idle) < self.size:
                    event = self._next_event(deadline, "start")
                    if event is None:
                        continue
                    if event.get("type") == Event.IDLE:
                        idle.add(event["rank"])
                        self._note_idle(event)
                    elif event.get("type") == Event.PLACED:
                        self._hosts[event["rank"]] = event.get("host", "")
                    elif event.get("type") == Event.LAUNCHING:
                        self._launching = event
                    if event.get("type") != Event.IDLE:
                        on_event(event)
        except BaseException:
            self.stop()
            raise
        if self.idle_timeout and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_idle, name="hvdmagic-session-idle", daemon=True)
            self._watcher.start()

    def stop(self, reason: str = "stopped") -> None:
        """End the ranks and the Spark job; nothing is left behind. Idempotent."""
        if self.ended is None:
            self.ended = reason  # first: the job thread's own "its ranks exited" must not replace it
        job, thread = self._job, self._thread
        if job is not None:
            job.send(protocol.bare(Event.ABORT))
        if thread is not None:
            thread.join(timeout=60)
        self._job = self._thread = None
        if not self.placement.local:
            from hvdmagic.launch import spark

            spark.held_slots.pop(self, None)

    def restart(self, on_event: Callable[[dict], None] | None = None) -> None:
        self.stop("restarting")
        self.ended = None
        self.start(on_event)

    @property
    def where(self) -> str:
        """Where the ranks run, as a run's header names it: "spark", "spark connect" or "local"."""
        return (self._launching or {}).get("backend") or self.placement.where.value

    @property
    def busy(self) -> bool:
        return self._busy

    def status(self) -> list[RankStatus]:
        return [RankStatus(rank, self._hosts.get(rank, ""), self._busy, self._rss.get(rank),
                           None if self._busy else self._idle_since.get(rank)) for rank in range(self.size)]

    def __enter__(self) -> Session:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # -- cells ------------------------------------------------------------------
    def run_cell(self, payload: Shipment, on_event: Callable[[dict], None], *, timeout: float | None = None,
                 stall_timeout: float | None = None, requests=None, ranks: list[int] | None = None,
                 console: Console | None = None) -> list:
        """Run a packed ``(fn, args, kwargs)`` (a CellFunction runs in the ranks' namespaces);
        return every rank's value, raising as a one-shot job would. ``ranks``: run it on those ranks
        only, and return their values in rank order; the others stay idle and keep their state.
        ``console``: where a rank's ``breakpoint()`` asks the user (``launch.breakpoint_prompts``)."""
        ranks = self.check_ranks(ranks)
        if not self.running:
            raise LaunchError(f"the session is not running ({self.ended or 'its ranks have exited'}): start one "
                              "with %horovod start --np N (or hvdmagic.session), or give the cell --np.")
        if not self._lock.acquire(blocking=False):
            raise LaunchError("the session is running another cell; sessions run one cell at a time.")
        try:
            with interruptible():
                return self._run_cell(payload, on_event, timeout, stall_timeout, requests, ranks,
                                      BreakpointPrompts(self._job.send_to, console, on_event))
        finally:
            if self._job is not None and self._job.blobs is not None:
                self._job.blobs.withdraw(payload.buffers)
            self._busy = False
            self._lock.release()

    def debug(self, rank: int, ask: Callable[[str], str | None], show: Callable[[str], None],
              on_start: Callable[[dict], None] | None = None) -> bool:
        """pdb in ``rank``, at the frame where its last failed cell raised (the rank keeps that exception:
        ``rank.cell_loop``), its I/O relayed by a ``PdbRelay`` (``ask``, ``show``, ``on_start``) until the
        user quits. The session is busy meanwhile, as during a cell. False when the rank holds no
        traceback. Stop ends pdb and raises JobInterrupted; the ranks and their state stay, unless the
        rank does not end its pdb within ``INTERRUPT_GRACE`` (then they are restarted, and it says so).
        """
        self.check_ranks([rank])
        if not self.running:
            raise LaunchError(f"the session is not running ({self.ended or 'its ranks have exited'}).")
        if not self._lock.acquire(blocking=False):
            raise LaunchError("the session is running a cell; debug once it has ended.")
        relay = PdbRelay(rank, lambda event: self._job.send_to(rank, event), ask, show, on_start)
        self._busy = True
        try:
            with interruptible():
                relay.begin()
                try:
                    while not relay.handle(self._next_event(None, "cell") or {}):
                        pass
                except KeyboardInterrupt:
                    relay.stop()
                    if not self._await_end(relay):
                        self._restart_after(lambda event: None)
                        raise JobInterrupted(f"interrupted: rank {rank}'s debugger did not end within "
                                             f"{INTERRUPT_GRACE:g} s of Stop (stuck in C?), so {LOST_STATE}.") from None
                    raise JobInterrupted(f"interrupted: Stop ended the debugger on rank {rank}; the session keeps its "
                                         "ranks and their state.") from None
            return relay.kept
        finally:
            self._busy = False
            self._idle_since[rank] = time.monotonic()
            self._lock.release()

    def _await_end(self, relay: PdbRelay) -> bool:
        """Whether the rank's pdb ends within ``INTERRUPT_GRACE`` of ``relay.stop()``; a second Stop gives up."""
        deadline = time.monotonic() + INTERRUPT_GRACE
        try:
            while not relay.ended and time.monotonic() < deadline:
                event = self._next_event(None, "cell")
                if event is not None and event.get("type") != Event.DEBUG_PROMPT:  # asked no more: EOF went
                    relay.handle(event)
        except KeyboardInterrupt:
            pass
        return relay.ended

    def check_ranks(self, ranks) -> list[int] | None:
        """``ranks`` as a cell takes them: sorted, without repeats; None (every rank) for None or all of them.
        A PlacementError (a ValueError) in one sentence for a rank the session does not have."""
        if ranks is None:
            return None
        chosen = sorted(set(ranks))
        if not chosen or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < self.size
                                 for r in chosen):
            raise PlacementError(f"ranks must name some of the session's {self.size} ranks "
                                 f"({rank_ranges.compress(range(self.size))}), not {list(ranks)!r}.")
        return None if len(chosen) == self.size else chosen

    @property
    def next_cell(self) -> int:
        """The number the next cell gets: its ranks compile it as ``rank.cell.session_filename`` of it."""
        return self._cells + 1

    def _run_cell(self, payload, on_event, timeout, stall_timeout, requests, ranks,
                  breakpoints: BreakpointPrompts) -> list:
        self._cells += 1
        cell = self._cells
        self._busy = True
        chosen = ranks if ranks is not None else list(range(self.size))
        if self._launching is not None:  # the cell's record and header name the session's backend, not the placement's
            on_event(self._launching)
        for rank in chosen:
            on_event(protocol.placed(rank, self._hosts.get(rank, "")))
        # Its blobs are served while the cell runs; a host that has one from an earlier cell
        # (the same content) does not ask for it again.
        self._job.blobs.publish(payload.buffers, payload.labels)
        self._job.blobs.reset_progress()
        shipping = ShippingReports(self._job.blobs, on_event)
        self._job.send(protocol.cell(cell, payload.payload, ranks))
        started = time.monotonic()
        pending = set(chosen)
        values: dict[int, object] = {}
        failures: list[RankFailure] = []
        broken = False
        clock = StallClock(started)
        first_failure_at: float | None = None
        try:
            while pending:
                now = time.monotonic()
                if first_failure_at is not None and now - first_failure_at > FAILURE_GRACE:
                    # The others wait in a collective for the failed rank: interrupt them, or restart.
                    breakpoints.stop()  # a rank in pdb reads its lines with SIGINT held: EOF ends its pdb
                    stuck = self._interrupt(pending, on_event)
                    if stuck:
                        broken = True
                    break
                verdict = self._watchdog(started, now, clock, pending, timeout, stall_timeout)
                if verdict:
                    breakpoints.stop()
                    stacks = self._stacks(pending, on_event)
                    verdict = self._watchdog(started, time.monotonic(), clock, pending, timeout, stall_timeout) \
                        or verdict  # as a one-shot job does (launch.job): the ranks silent by now
                    self._interrupt(pending, on_event)
                    self._restart_after(on_event)
                    raise JobTimeout(failures, sorted(pending), note=f"{verdict}; {LOST_STATE}", stacks=stacks)
                shipping.poll()
                if requests is not None:
                    serve_requests(requests, self._job.send)
                event = self._next_event(None, "cell", wait=POLL)
                if event is None:
                    continue
                kind, rank = event.get("type"), event.get("rank")
                if event.get("cell", cell) != cell and kind != Event.DEBUG_PROMPT:  # a breakpoint's names no cell
                    continue  # a late answer to an earlier, interrupted cell
                clock.saw(event, time.monotonic())
                if kind == Event.IDLE:
                    pending.discard(rank)
                    self._note_idle(event)
                    breakpoints.handle(event)
                    continue
                if kind == Event.RESULT:
                    values[rank] = result_value(event)
                elif kind == Event.ERROR:
                    failures.append(RankFailure(rank, f"{event.get('exc_type')}: {event.get('message')}",
                                                event.get("traceback", ""), self._hosts.get(rank, ""),
                                                event.get("time") or float("inf")))
                    broken |= bool(event.get("broken"))
                    first_failure_at = first_failure_at or time.monotonic()
                on_event(event)
                breakpoints.handle(event)  # after the views have the rank "in the debugger": it asks the user
        except KeyboardInterrupt:
            breakpoints.stop()
            stuck = self._interrupt(pending, on_event)
            if stuck:
                try:
                    stacks = self._stacks(set(stuck), on_event)  # what they are stuck in
                except KeyboardInterrupt:
                    stacks = {}  # Stop pressed again: restart without them
                self._restart_after(on_event)
                raise JobInterrupted(f"interrupted: rank(s) {rank_ranges.compress(stuck)} did not stop within "
                                     f"{INTERRUPT_GRACE:g} s (stuck in a collective?), so {LOST_STATE}.",
                                     stacks=stacks) from None
            raise JobInterrupted("interrupted: every rank stopped the cell; the session keeps its ranks and "
                                 "their state.") from None
        if failures:
            if broken:
                self._restart_after(on_event)
            note = LOST_STATE if broken else "the session keeps its ranks and their state"
            raise JobFailed(failures, sorted(pending), note=note)
        return [values.get(rank) for rank in chosen]

    def _stacks(self, pending: set[int], on_event) -> dict[int, str]:
        """Where the ranks still in the cell are, from their fault handlers, before they are stopped."""
        self._job.send(protocol.bare(Event.STACKS))
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + STACKS_WAIT
        while pending - stacks.keys() and time.monotonic() < deadline:
            event = self._next_event(None, "cell", wait=POLL)
            if event is not None and event.get("type") == Event.STACKS:
                if event["rank"] in pending:  # the others are idle in the cell loop: nothing to see
                    stacks[event["rank"]] = str(event.get("text", ""))
            elif event is not None:
                on_event(event)
        return stacks

    def _interrupt(self, pending: set[int], on_event) -> list[int]:
        """Stop (SIGINT) the ranks still in the cell; the ranks that did not get back to idle."""
        self._job.send(protocol.bare(Event.INTERRUPT))
        deadline = time.monotonic() + INTERRUPT_GRACE
        while pending and time.monotonic() < deadline:
            try:
                event = self._next_event(deadline, "cell", wait=POLL)
            except (JobFailed, LaunchError):
                break  # a rank died: the caller restarts
            except KeyboardInterrupt:
                break  # Stop pressed again: do not wait any longer
            if event is None:
                continue
            if event.get("type") == Event.IDLE:
                pending.discard(event.get("rank"))
                self._note_idle(event)
            elif event.get("type") != Event.ERROR:
                on_event(event)
        return sorted(pending)

    def _restart_after(self, on_event) -> None:
        on_event(protocol.note(f"hvdmagic: {LOST_STATE}"))
        self.restart(on_event)

    @staticmethod
    def _watchdog(started, now, clock: StallClock, pending, timeout, stall_timeout) -> str | None:
        if timeout and now - started - clock.in_debugger_for(now) > timeout:  # pdb's time is the user's
            return f"the cell exceeded --timeout {timeout:g} s"
        if stall_timeout:
            if stalled := clock.stalled(pending, now, stall_timeout):
                return (f"rank(s) {rank_ranges.compress(stalled)} made no progress for {stall_timeout:g} s "
                        "(--stall-timeout)")
        return None

    # -- the job's events -------------------------------------------------------
    def _run_job(self) -> None:
        try:
            self._job.run()
        except BaseException as exc:  # a rank died: reported to the cell that waits, if any
            self._job_error = exc
        finally:
            if self.ended is None:
                self.ended = "its ranks exited"
            self._inbox.put(_JOB_ENDED)

    def _next_event(self, deadline: float | None, during: str, wait: float = POLL) -> dict | None:
        """The next event from the job; raises once the job has ended (a rank died)."""
        if deadline is not None and time.monotonic() > deadline:
            self.stop()
            raise LaunchError(f"the session's ranks did not come up within {self.start_timeout:g} s (--timeout).")
        try:
            event = self._inbox.get(timeout=wait)
        except queue.Empty:
            return None
        if event is not _JOB_ENDED:
            return event
        error = self._job_error
        if isinstance(error, JobFailed):
            if during == "cell":
                # The caller's cell fails with the lost rank named; the ranks come back for the next cell.
                self.restart()
                raise JobFailed(error.failures, error.stopped, note=LOST_STATE) from None
            raise error
        raise LaunchError(f"the session's job ended: {error or 'its ranks exited'}") from None

    def _note_idle(self, event: dict) -> None:
        rank = event["rank"]
        if event.get("rss"):
            self._rss[rank] = int(event["rss"])
        self._idle_since[rank] = time.monotonic()

    def _watch_idle(self) -> None:
        while self.ended is None or self.ended == "restarting":
            time.sleep(1.0)  # a coarse clock for a limit in seconds; nothing waits on this loop
            idle_since = max(self._idle_since.values(), default=time.monotonic())
            if self.running and not self._busy and time.monotonic() - idle_since > self.idle_timeout:
                self.stop(f"stopped after {self.idle_timeout:g} s idle (--idle-timeout)")
        self._watcher = None
