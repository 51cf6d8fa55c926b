"""The launcher core shared by the magic, the Python API and local mode.

A job starts the per-job services on the driver (the event channel and
horovod's rendezvous), hands a TaskSpec to a backend (Spark barrier stage or
local threads), then reads events until every rank has exited, one has failed,
the time is up, a rank stalls or the user interrupts. Whatever happens,
``_shutdown`` aborts the ranks, cancels the backend and closes the services.
"""

from __future__ import annotations

import base64
import contextlib
import queue
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from hvdmagic import blob_transfer, channel, protocol, rank_ranges
from hvdmagic.errors import ALIVE_GUESS, JobFailed, JobInterrupted, JobTimeout, LaunchError, RankFailure
from hvdmagic.launch import versions
from hvdmagic.launch.breakpoint_prompts import BreakpointPrompts, Console
from hvdmagic.launch.held_rank import HeldRank
from hvdmagic.launch.interrupts import before_launch, interruptible
from hvdmagic.launch.layout import compute_layout, visible_devices
from hvdmagic.launch.mpi import MpiDriver
from hvdmagic.launch.placement import Placement
from hvdmagic.launch.shipment import Shipment
from hvdmagic.launch.stall_clock import StallClock
from hvdmagic.protocol import Event, Framework, ResultPolicy, Slot, Stage, TaskSpec
from hvdmagic.task import rank_template

# The kernel's secret for its hosts' rank templates (task.rank_template): they outlive each job.
TEMPLATE_SECRET = channel.new_secret()
MPI_NOTE = ("hvdmagic: under --controller mpi, mpirun starts the ranks, so each imports its frameworks itself "
            "(no host template).")

ABORT_GRACE = 5.0  # seconds the other ranks get to report after the first failure
EXIT_GRACE = 3.0  # seconds a rank that reported its error gets to exit on its own before it is aborted too
# Seconds the ranks get to send their stacks: the fault handler's (task.rank_process's 2 s at most),
# then py-spy's native frames (task.native_stacks's 6 s at most). The wait ends once all answered.
STACKS_WAIT = 9.0
POLL = 0.1
RECENT_PROGRESS = 10.0  # a rank silent for longer than this is named as "stopped progressing"
# Seconds the job loop waits, once every task has ended, for rank ends still on their way before it calls the
# ranks lost: a task ends only after the kernel acknowledged its last event, so this is only the loop's own lag.
TASKS_ENDED_WAIT = 1.0
# Seconds a rank whose task's connection closed waits for the backend to say why (a Spark task's
# failure names its cause) before the rank fails with the closed connection as the reason.
CLOSED_WAIT = 10.0


@dataclass
class JobResult:
    results: list[Any]  # one per rank, in rank order
    slots: list[Slot]
    duration: float


@dataclass(frozen=True)
class UnsentResult:
    """A rank's value under ResultPolicy.ALL_OR_REPR that could not be pickled: what it was."""

    type_name: str
    repr: str
    reason: str

    def warning(self) -> str:
        return (f"hvdmagic: the cell finished, but rank 0's result ({self.type_name}) cannot be sent back to "
                f"the notebook ({self.reason}); the cell's result is None. Its repr: {self.repr}")


@dataclass
class JobState:
    np: int
    hellos: dict[int, tuple[Any, dict]] = field(default_factory=dict)  # by task index: (link, hello)
    slots: dict[int, Slot] = field(default_factory=dict)  # by task index
    hosts: dict[int, str] = field(default_factory=dict)  # by rank, for messages
    results: dict[int, Any] = field(default_factory=dict)
    exits: dict[int, int] = field(default_factory=dict)
    failures: list[RankFailure] = field(default_factory=list)
    go_at: float | None = None
    clock: StallClock | None = None  # from the go on: when each rank last moved
    last_heard: dict[int, float] = field(default_factory=dict)  # any event, heartbeats included
    rows: dict[int, tuple[int, int]] = field(default_factory=dict)  # --data: (rows, padding) by rank
    stacks: dict[int, str] = field(default_factory=dict)  # by rank: where it was when the watchdog fired
    ended_at: float | None = None  # when the backend's tasks had all ended, while some rank's end had not come
    # By rank: when its task's connection closed (a FIN: its process ended) before the rank's end came,
    # and the GONE event that said so. Its Spark task's failure usually explains it a moment later.
    closed: dict[int, tuple[float, dict]] = field(default_factory=dict)
    held: dict[int, float] = field(default_factory=dict)  # by rank: seconds it waits for %debug (--hold-on-error)
    # When the kernel began to end the job (a rank failed, a watchdog fired): a task that goes after it was sent away.
    aborted_at: float | None = None

    @property
    def clean(self) -> bool:
        return len(self.exits) == self.np and not self.failures and all(c == 0 for c in self.exits.values())

    def running(self) -> list[int]:
        return [r for r in range(self.np) if r not in self.exits]

    def lose(self, rank: int, why: str) -> None:
        """The rank ended without its end reaching the kernel: it failed, for ``why``."""
        self.exits[rank] = -1
        self.failures.append(RankFailure(rank, why, "", self.hosts.get(rank, "")))


def serve_requests(requests: queue.SimpleQueue, send: Callable[[dict], None]) -> None:
    """Pass on what the views asked for: the ranks' answers come back as events."""
    while True:
        try:
            request = requests.get_nowait()
        except queue.Empty:
            return
        if request == Event.STACKS:
            send(protocol.bare(Event.STACKS))


def _on_hosts(ranks: list[int], hosts: dict[int, str]) -> str:
    """", on <host>" for ranks on one host, ", on 16 hosts" for more: where to look among many."""
    where = {hosts[rank] for rank in ranks if hosts.get(rank)}
    if not where:
        return ""
    return f", on {where.pop()}" if len(where) == 1 else f", on {len(where)} hosts"


class ShippingReports:
    """The blob server's progress as SHIPPING events for the views: a few a second while bytes
    flow, then the last. A run whose hosts had every blob already sends none."""

    INTERVAL = 0.25

    def __init__(self, server: blob_transfer.BlobServer, on_event: Callable[[dict], None]):
        self._server = server
        self._on_event = on_event
        self._last: tuple[int, int] = (0, 0)
        self._at = 0.0

    def poll(self) -> None:
        progress = self._server.progress()
        now = time.monotonic()
        counts = (progress.requested, progress.sent)
        done = progress.sent >= progress.requested
        if counts == self._last or (not done and now - self._at < self.INTERVAL):
            return
        self._last, self._at = counts, now
        self._on_event(protocol.shipping(progress.describe(now), progress.requested, progress.sent,
                                         progress.hosts, done, progress.from_kernel))


class Job:
    elastic = False  # launch.elastic.ElasticJob: Horovod's elastic driver decides which ranks run

    def __init__(self, backend, payload: Shipment, placement: Placement, *, timeout: float | None = None,
                 stall_timeout: float | None = None, env: dict[str, str] | None = None,
                 results: ResultPolicy = ResultPolicy.ALL, session: bool = False,
                 on_event: Callable[[dict], None] | None = None, requests: queue.SimpleQueue | None = None,
                 reconnect_grace: float | None = None, console: Console | None = None):
        self.backend = backend
        self.np = backend.np  # the tasks: an elastic run's max_np
        self.payload = payload
        self.timeout = timeout
        self.stall_timeout = stall_timeout
        self.env = tuple(sorted((env or {}).items()))
        self.controller = placement.controller
        self.results = results
        self.framework = placement.framework
        # A session's ranks outlive their cells: a cell's error is the session's business
        # (launch.warm_ranks), and only a rank that dies fails the job.
        self.session = session
        self.server: channel.ChannelServer | None = None  # while the job runs: send() reaches every task
        self._task_of: dict[int, Any] = {}  # by rank, its task's channel.Peer, once placed: send_to() reaches it
        self.blobs: blob_transfer.BlobServer | None = None  # while the job runs: the payloads' large buffers
        self.mpi: MpiDriver | None = None
        self.on_event = on_event or (lambda event: None)
        # What the views ask while the job runs (Event.STACKS: where is every rank now?).
        self.requests = requests if requests is not None else queue.SimpleQueue()
        self.job_id = uuid.uuid4().hex[:12]
        # How long a task whose connection broke may take to come back (task.kernel_link), both sides.
        self.reconnect_grace = backend.reconnect_grace if reconnect_grace is None else reconnect_grace
        # The ranks that stop at breakpoint(): their pdb's prompts asked on ``console`` (a session's cells
        # are served by launch.warm_ranks, which reads their events).
        self.breakpoints = BreakpointPrompts(self.send_to, console, self.on_event)
        self.held: HeldRank | None = None  # a failed rank left waiting for %debug, its task and channel with it

    def _template(self) -> dict:
        """The TaskSpec's rank template: none under mpirun, nor where HVDMAGIC_TEMPLATE=0."""
        if not rank_template.enabled():
            return {}
        if self.controller == "mpi":
            self.on_event(protocol.note(MPI_NOTE))
            return {}
        # torch.distributed's ranks import torch, whatever the code shows (a script run by the drop-in).
        torch = ("torch",) if self.framework == Framework.TORCH else ()
        modules = tuple(dict.fromkeys(("hvdmagic.rank.blobs", *torch, *self.payload.imports,
                                       *rank_template.extra_imports())))
        return {"template": modules, "template_secret": TEMPLATE_SECRET}

    def run(self) -> JobResult:
        with interruptible():
            return self._run()

    def _run(self) -> JobResult:
        started = time.monotonic()
        secret = channel.new_secret()
        with before_launch():
            server, rendezvous = self._open_services(secret)
        state = JobState(self.np)
        try:
            spec = TaskSpec(
                job_id=self.job_id, driver_host=self.backend.bind_host, channel_port=server.address[1],
                rendezvous_port=rendezvous.port, secret=secret, payload=self.payload.payload,
                blob_port=self.blobs.address[1], env=self.env,
                controller=self.controller, results=self.results, framework=self.framework,
                session=self.session, elastic=self.elastic, reconnect_grace=self.reconnect_grace,
                **self._template(),
            )
            self.on_event(protocol.launching(self.backend.describe(), self.backend.job_group, list(server.address),
                                             self.backend.name))
            self.backend.start(spec)
            self._loop(server, rendezvous, state, started)
        except KeyboardInterrupt:
            where = "while the ranks ran" if state.go_at is not None else "while the ranks were being started"
            cancelled = "" if self.backend.name == "local" else " and the Spark job cancelled"
            raise JobInterrupted(f"interrupted {where}: every rank was stopped{cancelled}.") from None
        finally:
            try:
                self._shutdown(server, rendezvous, state)
            finally:
                self.blobs.close()
        return JobResult(
            results=self._results_in_order(state),
            slots=sorted(state.slots.values(), key=lambda s: s.rank),
            duration=time.monotonic() - started,
        )

    def _open_services(self, secret: bytes):
        """The channel, the blob server and the rendezvous the tasks will reach (and mpirun's driver);
        a Stop while they open closes those that did."""
        with contextlib.ExitStack() as opened:
            server = self.server = channel.ChannelServer(self.backend.bind_host, secret, grace=self.reconnect_grace)
            opened.callback(server.close)
            self.blobs = blob_transfer.BlobServer(self.backend.bind_host, secret)
            opened.callback(self.blobs.close)
            self.blobs.publish(self.payload.buffers, self.payload.labels)
            self.shipping = ShippingReports(self.blobs, self.on_event)
            rendezvous = self._make_rendezvous()
            opened.callback(rendezvous.stop)
            if self.controller == "mpi":
                self.mpi = MpiDriver(self.np, server.address, secret)
            opened.pop_all()
        return server, rendezvous

    def _make_rendezvous(self):
        # Imported here, not at the top: importing hvdmagic (and %load_ext) must work
        # without horovod or torch, so that launch() can say how to install them.
        if self.framework == Framework.TORCH:
            from hvdmagic.launch.torch_store import TorchStore as Rendezvous
        else:
            from hvdmagic.launch.rendezvous import Rendezvous
        return Rendezvous(self.backend.bind_host, self.np)

    def _results_in_order(self, state: JobState) -> list:
        return [state.results.get(rank) for rank in range(self.np)]

    def _loop(self, server: channel.ChannelServer, rendezvous, state: JobState, started: float) -> None:
        deadline = started + self.timeout if self.timeout else None
        aborted_all = False  # the failed ranks too (they were left to exit on their own, _abort_others)
        verdict: str | None = None  # why the job was stopped without a rank failing
        while len(state.exits) < self.np:
            now = time.monotonic()
            if state.aborted_at is None:
                verdict = self._watchdog(state, now, deadline)
                if verdict and state.go_at is not None:
                    self._collect_stacks(server, state, rendezvous)
                    # Asked again once the stacks are in: a rank that fell silent a moment after the first
                    # to cross the limit (the one asleep, say, while the other waits for it) is named too.
                    verdict = self._watchdog(state, time.monotonic(), deadline) or verdict
                if state.failures or verdict:
                    self.breakpoints.stop()  # a rank in pdb would not see the abort's grace out
                    # Fail fast: stop the others now, then give them a moment to report.
                    aborted_all = not self._abort_others(server, state, None if verdict else
                                                         {f.rank for f in state.failures})
                    state.aborted_at = now
                elif error := self.backend.failure() or (self.mpi and self.mpi.failure()):
                    raise LaunchError(error, details=self.backend.failure_details)
                elif self._tasks_ended_unheard(server, state, now) or self._closed_unexplained(state, now):
                    continue  # failures recorded: the next turn stops the rest
            elif now - state.aborted_at > ABORT_GRACE:
                break
            elif not aborted_all and now - state.aborted_at > EXIT_GRACE:
                self._abort_unheld(server, state, set(state.held))  # a failed rank that does not end on its own
                aborted_all = True
            if not self.session:  # a session serves its cells' requests itself (launch.warm_ranks)
                self.shipping.poll()
                serve_requests(self.requests, self.send)
            try:
                link, event = server.events.get(timeout=POLL)
            except queue.Empty:
                continue
            self._handle(event, state, rendezvous, link)

        if state.failures or verdict:
            failed = {f.rank for f in state.failures}
            finished = sorted(r for r in state.results if r not in failed)
            stopped = sorted(r for r in range(self.np)
                             if r not in failed and r not in finished and state.exits.get(r) != 0)
            notes = [verdict] if verdict else []
            if finished:
                notes.append(f"rank(s) {rank_ranges.compress(finished)} had finished the cell; a rank that ends "
                             "while others still call collectives makes those fail")
            error = JobTimeout if verdict else JobFailed
            failed = error(state.failures, stopped, note="; ".join(notes), stacks=state.stacks)
            if not verdict:
                self.held = failed.held = self._hold(failed, state)
            raise failed

    def _abort_others(self, server: channel.ChannelServer, state: JobState, failed: set[int] | None) -> bool:
        """Abort every task, or with ``failed``, every task but those whose rank failed; say
        whether some were left out.

        A rank that reported its error is ending on its own: aborting it too would kill it in
        its last steps (atexit hooks, horovod's shutdown), and the user would see the abort's
        signal (-15) as its exit code instead of its own. One still there after ``EXIT_GRACE``
        is aborted too.
        """
        if not failed or len(state.slots) < self.np:
            server.broadcast(protocol.bare(Event.ABORT))
            return False
        for task, (link, _) in state.hellos.items():
            slot = state.slots.get(task)
            if slot is not None and slot.rank in failed:
                continue
            try:
                link.send(protocol.bare(Event.ABORT))
            except OSError:
                pass  # that task is gone; its missing exit ends the job
        return True

    def _hold(self, failed: JobFailed, state: JobState) -> HeldRank | None:
        """The rank left waiting for %debug: the first of those that said HELD, in the error's order (the
        root cause first); the others are aborted with the rest."""
        rank = next((f.rank for f in failed.failures if f.rank in state.held and f.rank in self._task_of), None)
        if rank is None:
            return None
        failure = next(f for f in failed.failures if f.rank == rank)
        return HeldRank(rank, state.held[rank], failure.summary, self.send_to)

    def _abort_unheld(self, server: channel.ChannelServer, state: JobState, held: set[int]) -> None:
        """Abort every task but those of the ``held`` ranks (waiting for %debug: ``_hold``)."""
        keep = [self._task_of[rank] for rank in held if rank in self._task_of]
        if not keep:
            server.broadcast(protocol.bare(Event.ABORT))
            return
        for link, _ in state.hellos.values():
            if all(link is not task for task in keep):
                try:
                    link.send(protocol.bare(Event.ABORT))
                except OSError:
                    pass  # that task is gone; its exit is not waited for

    def _collect_stacks(self, server: channel.ChannelServer, state: JobState, rendezvous) -> None:
        """Ask every running rank where it is, before the watchdog stops them: the answer to a hang."""
        server.broadcast(protocol.bare(Event.STACKS))
        deadline = time.monotonic() + STACKS_WAIT
        while set(state.running()) - set(state.stacks) and time.monotonic() < deadline:
            try:
                link, event = server.events.get(timeout=POLL)
            except queue.Empty:
                continue
            self._handle(event, state, rendezvous, link)

    def _watchdog(self, state: JobState, now: float, deadline: float | None) -> str | None:
        """Why the job must stop now (timeout, stall), or None. The time a rank spent in pdb at a
        breakpoint() is not counted against ``--timeout``."""
        if deadline is not None and now > deadline + (state.clock.in_debugger_for(now) if state.clock else 0.0):
            return f"the run exceeded --timeout {self.timeout:g} s{self._stuck(state, now)}"
        if self.stall_timeout and state.clock is not None:
            if stalled := state.clock.stalled(state.running(), now, self.stall_timeout):
                return (f"rank(s) {rank_ranges.compress(stalled)} made no progress for "
                        f"{self.stall_timeout:g} s (--stall-timeout){self._stuck(state, now)}")
        return None

    def _stuck(self, state: JobState, now: float) -> str:
        """Which running ranks went quiet, where, and whether they are still alive (heartbeats): one
        clause per kind of silence, so that 127 ranks waiting on a 128th read as one."""
        if state.go_at is None:
            return f": only {len(state.hellos)} of {self.np} tasks had started"
        # A stalled rank always counts as quiet: these clauses say where it is.
        threshold = min(RECENT_PROGRESS, (self.timeout or RECENT_PROGRESS) / 2, self.stall_timeout or RECENT_PROGRESS)
        quiet: dict[str, list[tuple[int, float]]] = {}
        for rank in state.running():
            silent = state.clock.silent_for(rank, now)
            if silent > threshold:
                heard = now - state.last_heard.get(rank, state.go_at)
                alive = ALIVE_GUESS if heard < 5 else f"no heartbeat for {heard:.0f} s"
                quiet.setdefault(alive, []).append((rank, silent))
        parts = []
        for alive, silences in quiet.items():
            ranks = [rank for rank, _ in silences]
            low, high = min(s for _, s in silences), max(s for _, s in silences)
            ago = f"{low:.0f}" if f"{low:.0f}" == f"{high:.0f}" else f"{low:.0f}{rank_ranges.DASH}{high:.0f}"
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges.compress(ranks)}"
            parts.append(f"{who} stopped progressing {ago} s ago{_on_hosts(ranks, state.hosts)} ({alive})")
        return "".join("; " + part for part in parts)

    def _tasks_ended_unheard(self, server: channel.ChannelServer, state: JobState, now: float) -> bool:
        """Whether the backend's tasks have all ended while some rank's end never reached the kernel:
        a task sends everything before it ends (through outages too), so that rank is lost, and the cell
        must not wait for it. A moment passes first, for events still on their way through this loop."""
        if not server.events.empty() or not self.backend.ended():
            return False
        if state.ended_at is None:
            state.ended_at = now
            return False
        if now - state.ended_at < TASKS_ENDED_WAIT:
            return False
        what = "the Spark stage" if self.backend.name != "local" else "the local tasks"
        wall = time.time() - now
        for rank in state.running():
            heard = state.last_heard.get(rank, state.go_at or now)
            state.lose(rank, f"{what} ended, but this rank's end never reached the kernel, which last heard from it "
                             f"at {datetime.fromtimestamp(wall + heard).strftime('%H:%M:%S')} ({now - heard:.0f} s "
                             "before): its task lost its connection to the kernel, or was ended")
        return True

    def _closed_unexplained(self, state: JobState, now: float) -> bool:
        """Fail the ranks whose task's connection closed CLOSED_WAIT ago while the backend has said
        nothing of it since (a task that ended without failing, a backend that cannot tell)."""
        due = [rank for rank, (at, _) in state.closed.items() if rank not in state.exits and now - at > CLOSED_WAIT]
        for rank in due:
            state.lose(rank, lost_contact(state.closed[rank][1]))
        return bool(due)

    def _contact(self, link, event: dict, state: JobState) -> None:
        """A task's connection broke or came back (CONTACT), or the task is gone (GONE): the first two
        are shown on its rank's row; the last fails that rank, unless its end had arrived; at once past
        the grace, after CLOSED_WAIT for a connection that closed (``_closed_unexplained``)."""
        task = next((task for task, (peer, _) in state.hellos.items() if peer is link), None)
        slot = state.slots.get(task) if task is not None else None
        if slot is None:
            # Not while the kernel ends the job: a --timeout that ran out before every task had said hello
            # (a loaded machine) sent this one away, and the verdict is the cell's error.
            if event.get("type") == Event.GONE and task is not None and state.aborted_at is None:
                raise LaunchError(f"Spark task {task} lost its connection to the kernel before its rank started "
                                  f"({lost_contact(event)}).")
            return
        rank = slot.rank
        if event.get("type") == Event.CONTACT:
            self.on_event({**event, **protocol.contact(rank=rank, host=state.hosts.get(rank, ""))})
        elif event.get("why") == "closed":  # its process ended: the backend says why in a moment
            state.closed.setdefault(rank, (time.monotonic(), event))
        elif rank not in state.exits:
            state.lose(rank, lost_contact(event))

    def _handle(self, event: dict, state: JobState, rendezvous, link) -> None:
        kind = event.get("type")
        if kind in (Event.CONTACT, Event.GONE):
            self._contact(link, event, state)
            return
        if kind == Event.HELLO:
            task = event.get("task")
            if isinstance(task, int) and 0 <= task < self.np and task not in state.hellos:
                state.hellos[task] = (link, event)
                if len(state.hellos) == self.np:
                    self._place(state, rendezvous)
            return
        if self.mpi is not None and kind in MpiDriver.EVENTS:
            self.mpi.handle(link, event)
            return
        rank = event.get("rank")
        if not isinstance(rank, int) or not 0 <= rank < self.np:
            return
        now = time.monotonic()
        if kind != Event.RESOURCES:  # sampled by the task's supervisor: says nothing of the rank's own life
            state.last_heard[rank] = now
        if state.clock is not None:
            state.clock.saw(event, now)
        if self.session and kind in (Event.RESULT, Event.ERROR):
            pass  # a session's cell outcome: launch.warm_ranks reads it from the event
        elif kind == Event.RESULT:
            state.results[rank] = result_value(event)
        elif kind == Event.ERROR:
            stamp = event.get("time")
            state.failures.append(RankFailure(rank, f"{event.get('exc_type')}: {event.get('message')}",
                                              event.get("traceback", ""), state.hosts.get(rank, ""),
                                              stamp if isinstance(stamp, (int, float)) else float("inf")))
        elif kind == Event.STACKS:
            if rank not in state.exits:  # a rank that had finished answers with nothing
                state.stacks[rank] = str(event.get("text", ""))
        elif kind == Event.HELD:  # it failed, and waits: the cell is over for it
            state.held[rank] = float(event.get("seconds", 0))
            state.exits.setdefault(rank, 1)
        elif kind == Event.EXIT:
            code = int(event.get("code", -1))
            state.exits[rank] = code
            if code != 0 and not event.get("aborted") and not any(f.rank == rank for f in state.failures):
                state.failures.append(RankFailure(rank, describe_exit(code), "", state.hosts.get(rank, "")))
        if kind != Event.HEARTBEAT:
            self.on_event(event)
        if not self.session:
            self.breakpoints.handle(event)  # after the views have the rank "in the debugger": it asks the user

    def send(self, event: dict) -> None:
        """``event`` to every task of the running job (a session's cells and interrupts)."""
        if self.server is not None:
            self.server.broadcast(event)

    def send_to(self, rank: int, event: dict) -> None:
        """``event`` to ``rank``'s task alone (a debugger's lines: what the user types reaches the rank
        it is for, and no other task of the job)."""
        task = self._task_of.get(rank)
        if task is not None:
            try:
                task.send(event)
            except OSError:
                pass  # that task is gone; its missing exit ends the job

    def _place(self, state: JobState, rendezvous) -> None:
        """Every task has said hello: check their environments, lay the ranks out and send each task its go."""
        hellos = [state.hellos[task][1] for task in range(self.np)]
        problem, notices = versions.compare({task: (h.get("hostname") or h.get("host", ""), h.get("versions"))
                                             for task, h in enumerate(hellos)})
        if problem:
            raise LaunchError(problem)  # no rank has started: the shutdown aborts the waiting tasks
        for text in notices:
            self.on_event(protocol.note(text))
        layout = compute_layout([h["host"] for h in hellos])
        gpus = [list(h.get("gpus") or []) for h in hellos]
        rows = [h.get("rows") for h in hellos]
        rows_per_rank = max(rows) if None not in rows else None  # every rank runs the same steps
        for task, slot in enumerate(layout):
            state.slots[task] = slot
            state.hosts[slot.rank] = hellos[task].get("hostname", slot.host)
            if rows_per_rank is not None:
                state.rows[slot.rank] = (int(rows[task]), rows_per_rank - rows[task])
        rendezvous.place(layout)  # before any rank can join it
        if self.mpi is not None:
            self.mpi.placed(layout, [state.hellos[task][0] for task in range(self.np)])
        for task, slot in enumerate(layout):
            link = self._task_of[slot.rank] = state.hellos[task][0]
            try:
                link.send(protocol.go(slot, visible_devices(layout, gpus, task), rows_per_rank))
            except OSError:
                pass  # that task is gone; its missing exit ends the job
        state.go_at = time.monotonic()
        state.clock = StallClock(state.go_at)
        self.on_event(protocol.stage_reached(Stage.RANKS_STARTING))
        if state.rows:
            self.on_event(protocol.note(_data_note(state.rows), rank=0))
        for slot in layout:
            self.on_event(protocol.placed(slot.rank, state.hosts[slot.rank]))

    def _shutdown(self, server: channel.ChannelServer, rendezvous, state: JobState) -> None:
        """Abort whatever still runs, cancel the backend, close the services.

        A second Ctrl-C while this runs only cuts the grace period short: the
        cancel and the closing still happen, so nothing is left behind.
        """
        try:
            if not state.clean:
                self._abort_unheld(server, state, {self.held.rank} if self.held is not None else set())
                grace_end = time.monotonic() + ABORT_GRACE
                while len(state.exits) < len(state.slots) and time.monotonic() < grace_end:
                    try:
                        _, event = server.events.get(timeout=POLL)
                    except queue.Empty:
                        continue
                    if event.get("type") == Event.EXIT and isinstance(event.get("rank"), int):
                        state.exits[event["rank"]] = int(event.get("code", -1))
        except KeyboardInterrupt:
            pass
        finally:
            if self.mpi is not None:
                self.mpi.stop(state.clean)
            if self.held is not None:  # its task and the channel outlive the cell: the HeldRank ends them
                rendezvous.stop()
                self.held.start(self.backend, server, self._task_of.get(self.held.rank))
            else:
                if not state.clean:
                    self.backend.cancel()
                self.backend.join(timeout=30)
                rendezvous.stop()
                server.close()


def lost_contact(event: dict) -> str:
    """Why a task is gone, from its GONE event, in one clause."""
    if event.get("why") != "grace":
        return ("its task's connection to the kernel closed before the rank's end arrived: its Spark task, "
                "executor or host was lost")
    since = event.get("since")
    at = f" at {datetime.fromtimestamp(since).strftime('%H:%M:%S')}" if isinstance(since, (int, float)) else ""
    grace = event.get("grace", channel.DEFAULT_GRACE)
    return (f"the kernel lost contact with its task{at} and it did not come back within the reconnect grace of "
            f"{grace:g} s (--reconnect-grace): the rank was ended, its state is lost")


def _data_note(rows: dict[int, tuple[int, int]]) -> str:
    total = sum(r for r, _ in rows.values())
    per_rank = max(r + p for r, p in rows.values())
    padding = sum(p for _, p in rows.values())
    return (f"data: {total} rows over {len(rows)} ranks, {per_rank} per rank"
            + (f" ({padding} repeated as padding)" if padding else ""))


def result_value(event: dict) -> Any:
    if event.get("unpicklable"):
        return UnsentResult(str(event["unpicklable"]), str(event.get("repr", "")), str(event.get("reason", "")))
    if event.get("data") is None:  # a value the policy does not send back
        return None
    import cloudpickle

    # Safe to unpickle: the frame passed the per-job HMAC check in the channel.
    return cloudpickle.loads(base64.b64decode(event["data"]))


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exited with code {code}"
