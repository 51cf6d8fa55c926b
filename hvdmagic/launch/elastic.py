"""Elastic jobs: Horovod's own ElasticDriver, with Spark tasks as its hosts.

Horovod's elastic mode (``hvd.elastic.run``, ``State.commit()``/``restore()``,
the elastic Gloo rendezvous) needs three things from a launcher, and this module
gives them: host discovery, a way to start a worker on a host, and the worker's
exit code. Each Spark task is one Horovod host with one slot, named after its
partition and attempt (``t2.0``). Discovery lists the tasks that are connected;
starting a worker sends the task a go with the slot Horovod assigned; the task's
supervisor runs the rank and reports its exit, and stays for the next go.

Spark's barrier stage fails as a whole when one task fails, so an elastic job
runs a plain stage of ``max_np`` tasks instead: a lost executor takes only its
own task, Spark runs that task again elsewhere (spark.task.maxFailures), and its
new attempt joins as a new host; tasks waiting for a free slot join when they
get one. A rank that dies in a healthy task blacklists that task's host; after
Horovod's cooldown the host comes back and gets a rank at the next commit.

Everything Horovod's driver decides (when to reset, blacklists, the reset limit,
the minimum size) stays Horovod's; this module only watches the events to tell
the views who was lost, why, and which commit the survivors resumed from.
"""

from __future__ import annotations

import base64
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime

from hvdmagic import protocol
from hvdmagic.errors import JobFailed, JobTimeout, LaunchError, RankFailure
from hvdmagic.launch import versions
from hvdmagic.launch.job import POLL, STACKS_WAIT, Job, JobState, describe_exit, result_value, serve_requests
from hvdmagic.launch.placement import Elastic, Placement
from hvdmagic.launch.shipment import Shipment
from hvdmagic.launch.stall_clock import StallClock
from hvdmagic.protocol import Event, Slot, Stage

# A rank's notification service ends with its process, so the driver can find it gone just as the
# rank ends: the rank's result or error left before that, and its exit follows once its task's
# supervisor has reaped it. A rank whose end has not arrived this many seconds after is running,
# and unreachable.
ENDED_RANK_NEWS_WAIT = 30.0


@dataclass
class _Task:
    row: int
    host: str  # its name as a Horovod host: t<partition>.<attempt>
    hostname: str  # the machine, for messages
    link: object
    gpus: list[str]
    exit_code: int | None = None  # of its current rank
    rank: int | None = None  # the Horovod rank its current slot gave it; None while it has no rank
    gone: bool = False
    ended: threading.Event = field(default_factory=threading.Event)  # its current rank exited, or it is gone


@dataclass
class Reset:
    """One reset of an elastic run, as ``last_run().resets`` lists it."""

    time: datetime  # UTC, when the new rank 0 came back
    reason: str  # the losses since the last reset, or "slots added"
    size_before: int
    size_after: int
    commit: dict  # the plain values of the commit the ranks resumed from (epoch, batch, ...)

    def describe(self) -> str:
        where = ", ".join(f"{key} {value}" for key, value in self.commit.items()) or "the last commit"
        ranks = f"{self.size_after} rank{'s' if self.size_after != 1 else ''}"
        return f"resumed on {ranks} (from {self.size_before}) from the commit at {where}: {self.reason}"


class ElasticJob(Job):
    """A Job whose ranks come and go: ``backend`` runs ``max_np`` tasks, Horovod starts
    with ``np`` and keeps going while at least ``min_np`` remain."""

    elastic = True

    def __init__(self, backend, payload: Shipment, placement: Placement, **kwargs):
        super().__init__(backend, payload, placement, **kwargs)
        self.start_np = placement.np
        self.settings: Elastic = placement.elastic
        self._tasks: dict[str, _Task] = {}  # by Horovod host name
        self._by_link: dict[object, _Task] = {}
        self._lock = threading.Lock()
        self._driver = None
        self._outcome = None  # Horovod's Results, or the exception its driver raised
        self._done = threading.Event()
        self._losses: list[str] = []  # since the last reset
        self._all_losses: list[str] = []  # every loss of the run, for its error
        self._errors: list[RankFailure] = []  # exceptions raised in the cell: they fail the run
        self._size = 0
        self._world: dict[int, int] = {}  # row -> world rank
        self._ranks_started = False  # a go went out: a task that cannot run the cell no longer fails the run
        self._hosts_checked: set[str] = set()  # the hosts whose versions were compared with the kernel's
        self._stacks: dict[int, str] | None = None  # by row, while the --timeout collects where the ranks are
        # By row: Horovod's error from probing the rank's notification service, and until when the
        # rank's end may still explain it (ENDED_RANK_NEWS_WAIT).
        self._unreachable: dict[int, tuple[str, float]] = {}
        self._ended_news: set[int] = set()  # rows whose rank's result, error or exit came since it registered

    # -- the driver Horovod talks to --------------------------------------------
    def _make_rendezvous(self):
        from hvdmagic.launch.rendezvous import Rendezvous

        rendezvous = Rendezvous(self.backend.bind_host, start=False)
        settings = self.settings
        self._driver = _driver_class()(rendezvous, _TaskHosts(self), settings.min_np, settings.max_np,
                                     timeout=settings.timeout, reset_limit=settings.reset_limit,
                                     cooldown_range=settings.cooldown)
        rendezvous.start(_guarded_handler(self._driver))
        return rendezvous

    def available_hosts(self) -> dict[str, int]:
        with self._lock:
            return {name: 1 for name, task in self._tasks.items() if not task.gone}

    def _drive(self) -> None:
        try:
            if not self._driver.wait_for_first_slots(self.start_np):
                return  # stopped first (--timeout, Stop, the stage failed): the job loop says why
            self._driver.start(self.start_np, self._start_worker)
            self._outcome = self._driver.get_results()
        except BaseException as exc:  # reported by the job loop
            self._outcome = exc
        finally:
            self._done.set()

    def _start_worker(self, slot_info, events) -> tuple[int, float]:
        """Horovod's create_worker_fn: run a rank in the task named by ``slot_info.hostname``
        and return its exit code when it ends (Horovod calls this on a thread of its own)."""
        task = self._tasks[slot_info.hostname]
        self._ranks_started = True
        with self._lock:
            task.exit_code, task.rank = None, slot_info.rank
            if not task.gone:
                task.ended.clear()
        slot = Slot(slot_info.rank, slot_info.size, slot_info.local_rank, slot_info.local_size, slot_info.cross_rank,
                    slot_info.cross_size, slot_info.hostname)
        devices = [",".join(task.gpus), 0] if task.gpus else None
        try:
            task.link.send(protocol.go(slot, devices))
        except OSError:
            return 1, time.time()
        # Through the job loop, so that the views hear of it on the kernel's thread, in order.
        self.server.events.put((task.link, protocol.placed(task.row, task.hostname)))
        stop_sent = False
        while not task.ended.wait(POLL):
            if not stop_sent and any(event.is_set() for event in events):
                # Horovod is done with this worker (the job ended, or its host left).
                stop_sent = True
                try:
                    task.link.send(protocol.bare(Event.STOP_RANK))
                except OSError:
                    break
        with self._lock:
            task.rank = None
            return (1 if task.exit_code is None else task.exit_code), time.time()

    # -- the job loop --------------------------------------------------------------
    def _loop(self, server, rendezvous, state: JobState, started: float) -> None:
        threading.Thread(target=self._drive, name="hvdmagic-elastic-driver", daemon=True).start()
        deadline = started + self.timeout if self.timeout else None
        while not self._done.is_set():
            if deadline is not None and time.monotonic() > deadline:
                ranks = self._ranks_now()
                stacks = self._collect_stacks(server, state, ranks)  # before anything is stopped
                self._driver.stop(error_message="timeout")
                failed = self._failed(f"the run exceeded --timeout {self.timeout:g} s")
                raise JobTimeout(failed.failures, sorted(ranks.values()), note=failed.note, stacks=stacks)
            if error := self.backend.failure():
                self._driver.stop(error_message=error)
                break
            if unreachable := self._unreachable_running_rank():
                self._driver.stop(error_message=unreachable)
                raise self._failed(unreachable)
            serve_requests(self.requests, self.send)  # "where are the ranks?": the answers come back as events
            self._handle_next(server, state, wait=POLL)
        while self._handle_next(server, state, wait=None):
            pass  # the last results and exits, already sent
        if self._errors:
            raise self._failed("an exception in the cell fails an elastic run too: only lost processes and "
                               "executors are trained around", self._errors)
        outcome = self._outcome  # still None when the stage failed before Horovod's driver returned
        said = outcome if isinstance(outcome, BaseException) else outcome.error_message if outcome else None
        why = said or self.backend.failure()
        if not why and any(code != 0 for code, _ in outcome.worker_results.values()):
            # Horovod logs why it gave up waiting and ends its workers; the losses not yet recovered say why.
            why = (f"fewer than --min-np {self.settings.min_np} ranks were left, and no slot came back within "
                   f"--elastic-timeout {self.settings.timeout:g} s" if self._losses else "its ranks failed")
        if why:
            raise self._failed(f"Horovod's elastic driver stopped the run: {str(why).strip()}")

    def _register(self, rank: int, event: dict) -> None:
        """Register a rank's notification service with Horovod's driver, which probes it first."""
        from horovod.runner.common.util.network import NoValidAddressesFound

        host, _, local_rank = str(event.get("key", "")).rpartition(":")
        addresses = {nic: [tuple(address) for address in listed]
                     for nic, listed in (event.get("addresses") or {}).items()}
        try:
            self._driver.register_worker_server(host, int(local_rank), addresses, base64.b64decode(event["secret"]))
        except NoValidAddressesFound as unreachable:
            # The notification service ends with the rank's process: a rank whose cell raised (or
            # returned) at once can be gone before the probe. Then its result, error or exit is the
            # news, not Horovod's: the failure waits for it, and only a rank that goes on running
            # fails the run as unreachable (_unreachable_running_rank).
            with self._lock:
                if rank not in self._ended_news:
                    self._unreachable[rank] = (" ".join(str(unreachable).split()),
                                               time.monotonic() + ENDED_RANK_NEWS_WAIT)

    def _unreachable_running_rank(self) -> str | None:
        """Why the run cannot go on, when a rank whose notification service the driver could not
        reach still runs ENDED_RANK_NEWS_WAIT later: the driver could never tell it that hosts
        came, so the run would not grow back. That is the network, not a race with the rank's end."""
        if self._errors:
            return None  # an exception in a cell fails the run: the rank's own error is the news
        now = time.monotonic()
        with self._lock:
            unreachable = list(self._unreachable.items())
        for row, (horovod_says, news_by) in unreachable:
            if now > news_by:
                return (f"Horovod's elastic driver cannot reach the notification service of task {row}'s rank, "
                        f"which still runs, to tell it when hosts come or go: {horovod_says}")
        return None

    def _ranks_now(self) -> dict[int, int]:
        """By row, the Horovod rank of each task that runs one (``hvd.rank()``, what the cell's code
        knows: a reset's new rank, else its slot's); tasks that wait for a slot have none."""
        with self._lock:
            return {task.row: self._world.get(task.row, task.rank) for task in self._tasks.values()
                    if task.rank is not None and not task.gone}

    def _collect_stacks(self, server, state: JobState, ranks: dict[int, int]) -> dict[int, str]:
        """Where the ranks ``_ranks_now`` named are now, by Horovod rank."""
        self._stacks = {}
        server.broadcast(protocol.bare(Event.STACKS))
        deadline = time.monotonic() + STACKS_WAIT
        while set(ranks) - set(self._stacks) and time.monotonic() < deadline:
            self._handle_next(server, state, wait=POLL)
        stacks, self._stacks = self._stacks, None
        return {ranks[row]: text for row, text in stacks.items() if row in ranks}

    def _handle_next(self, server, state: JobState, wait: float | None) -> bool:
        """Handle the next event, waiting up to ``wait`` seconds for one (None: not at all)."""
        try:
            link, event = server.events.get(timeout=wait) if wait else server.events.get_nowait()
        except queue.Empty:
            return False
        self._handle(event, state, None, link)
        return True

    def _handle(self, event: dict, state: JobState, rendezvous, link) -> None:
        kind = event.get("type")
        if kind == Event.HELLO:
            self._hello(link, event, state)
            return
        if kind == Event.GONE:
            task = self._by_link.get(link)
            if task is not None:
                with self._lock:
                    task.gone = True
                task.ended.set()
                with self._lock:
                    self._unreachable.pop(task.row, None)  # its rank went with it
                if not self._done.is_set() and task.exit_code is None:
                    self._lose(task.row, "its Spark task or executor was lost")
            return
        rank = event.get("rank")
        if not isinstance(rank, int) or not 0 <= rank < self.np:
            return
        if kind in (Event.RESULT, Event.ERROR, Event.EXIT):
            # The rank's cell or process ended: the notification service that went with it is no news.
            with self._lock:
                self._unreachable.pop(rank, None)
                self._ended_news.add(rank)
        if kind == Event.WORKER:
            with self._lock:
                self._ended_news.discard(rank)  # a new rank of this task registers
            # Registering probes the rank's notification service, up to 3 × 20 s where packets are
            # dropped: on a thread of its own, so that this loop goes on reading every rank's events.
            threading.Thread(target=self._register, args=(rank, event), name="hvdmagic-elastic-register",
                             daemon=True).start()
            self._set_world(rank, event)
            return
        if kind == Event.RESET:
            self._set_world(rank, event)
            if event.get("world_rank") == 0:
                self._resumed(event)
            return
        if kind == Event.RESULT:
            state.results[int(event.get("world_rank", rank))] = result_value(event)
        elif kind == Event.STACKS and self._stacks is not None:
            self._stacks[rank] = str(event.get("text", ""))
        elif kind == Event.ERROR:
            # An exception in the cell is a bug to show, not a lost machine to train around:
            # the run fails as a fixed-size one would (Horovod's own errors never get here,
            # hvd.elastic.run handles them).
            stamp = event.get("time")
            summary = f"{event.get('exc_type')}: {event.get('message')}"
            self._errors.append(RankFailure(self._world.get(rank, rank), summary, event.get("traceback", ""),
                                            self._hostname(rank),
                                            stamp if isinstance(stamp, (int, float)) else float("inf")))
            self._driver.stop(error_message=f"task {rank}'s rank raised {event.get('exc_type')}")
        elif kind == Event.EXIT:
            code = int(event.get("code", -1))
            task = next((t for t in self._tasks.values() if t.row == rank and not t.gone), None)
            if task is not None:
                with self._lock:
                    task.exit_code = code
                task.ended.set()
            self._world.pop(rank, None)
            if code != 0 and not event.get("aborted") and not self._errors and not self._done.is_set():
                self._lose(rank, describe_exit(code))
                return
        self.on_event(event)

    def _hello(self, link, event: dict, state: JobState) -> None:
        row = event.get("task")
        if not isinstance(row, int) or not 0 <= row < self.np:
            return
        task = _Task(row, f"t{row}.{int(event.get('attempt') or 0)}", str(event.get("hostname", "")), link,
                     list(event.get("gpus") or []))
        if not self._versions_fit(task, event):
            return
        with self._lock:
            self._tasks[task.host] = task
            self._by_link[link] = task
        if state.go_at is None:
            state.go_at = time.monotonic()
            state.clock = StallClock(state.go_at)
            self.on_event(protocol.stage_reached(Stage.RANKS_STARTING))

    def _versions_fit(self, task: _Task, hello: dict) -> bool:
        """Compare the task's Python and packages with the kernel's, as a fixed-size run does for all
        its tasks at once (``launch.versions``); here each task as it joins, since tasks join late.

        A task that cannot unpickle the cell fails the run while no rank has started; after that the
        run goes on without it (it gets no slot), with a note: tasks that join later are replacements
        (a lost executor's task run again elsewhere), and the ranks that run should not pay for one.
        """
        problem, notices = versions.compare({task.row: (task.hostname or str(hello.get("host", "")),
                                                        hello.get("versions"))})
        if problem and not self._ranks_started:
            raise LaunchError(problem)  # no rank has started: the shutdown ends the tasks
        if problem:
            self.on_event(protocol.note(f"hvdmagic: task {task.row} was left out of the elastic run: {problem}"))
            try:
                task.link.send(protocol.bare(Event.ABORT))
            except OSError:
                pass  # gone already
            return False
        if task.hostname not in self._hosts_checked:  # one notice per host, not per task on it
            self._hosts_checked.add(task.hostname)
            for text in notices:
                self.on_event(protocol.note(text))
        return True

    def _set_world(self, row: int, event: dict) -> None:
        if isinstance(event.get("world_rank"), int):
            self._world[row] = event["world_rank"]
            self.on_event(protocol.world(row, event["world_rank"], event.get("size")))
        if not self._size and isinstance(event.get("size"), int):  # the first world's size
            self._size = event["size"]

    def _hostname(self, row: int) -> str:
        return next((t.hostname for t in self._tasks.values() if t.row == row), "")

    def _lose(self, row: int, reason: str) -> None:
        where = f" on {host}" if (host := self._hostname(row)) else ""
        self._losses.append(f"task {row}'s rank lost ({reason})")
        self._all_losses.append(f"task {row}'s rank{where} at {time.strftime('%H:%M:%S')} ({reason})")
        self.on_event(protocol.lost(row, reason))

    def _failed(self, why: str, failures: list[RankFailure] = ()) -> JobFailed:
        settings = self.settings
        limits = f"--min-np {settings.min_np}, --max-np {settings.max_np}" + (
            f", --reset-limit {settings.reset_limit}" if settings.reset_limit is not None else "")
        losses = f"; lost before that: {', '.join(self._all_losses)}" if self._all_losses else "; no rank was lost"
        return JobFailed(list(failures), [], note=f"{why} ({limits}){losses}")

    def _resumed(self, event: dict) -> None:
        size_after = int(event.get("size") or 0)
        reset = Reset(datetime.now(UTC), "; ".join(self._losses) or "slots added", self._size, size_after,
                      dict(event.get("commit") or {}))
        self._losses.clear()
        self._size = size_after
        self.on_event(protocol.resumed(reset))

    def _results_in_order(self, state: JobState) -> list:
        return [state.results[rank] for rank in sorted(state.results)]

    def _shutdown(self, server, rendezvous, state: JobState) -> None:
        if self._driver is not None and not self._driver.finished():
            self._driver.stop(error_message="the job was stopped")
        server.broadcast(protocol.bare(Event.ABORT))
        # Tasks still waiting for a slot never said hello: only cancelling the stage ends them.
        self.backend.cancel()
        self.backend.join(timeout=30)
        if self._driver is not None:
            self._driver.release_waiters()
        rendezvous.stop()
        server.close()


class _TaskHosts:
    """Horovod's HostDiscovery: the job's connected tasks, one slot each."""

    def __init__(self, job: ElasticJob):
        self._job = job

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return self._job.available_hosts()


# What Horovod's worker registry raises in the threads still waiting at its barrier
# when the driver stops (the run ended or failed); the job reports the outcome itself.
_STOPPED = (threading.BrokenBarrierError, RuntimeError)


def _driver_class():
    from horovod.runner.elastic.driver import ElasticDriver

    class Driver(ElasticDriver):
        def wait_for_first_slots(self, np: int) -> bool:
            """Horovod's wait_for_available_slots without its timeout, for the run's first ``np``
            tasks: they are still being scheduled, and a fixed-size run waits for its tasks within
            --timeout only (too few slots are the slot check's to report, before the stage). Horovod's
            --elastic-timeout is for slots coming back after a loss: spent here, a short one failed
            runs whose tasks were a few seconds late. False if the run was stopped first."""
            with self._wait_hosts_cond:  # notified by Horovod's discovery as hosts join; stop() notifies nothing
                while self._host_manager.current_hosts.count_available_slots() < np:
                    if self._shutdown.is_set():
                        return False
                    self._wait_hosts_cond.wait(POLL)
            return True

        def _handle_worker_exit(self, slot_info, exit_code, timestamp):
            try:
                super()._handle_worker_exit(slot_info, exit_code, timestamp)
            except _STOPPED:
                if not self.finished():
                    raise

        def release_waiters(self) -> None:
            """Wake the rendezvous requests and worker threads still waiting at the registry's
            barrier of a stopped run, which nothing else would ever complete."""
            barrier = self._worker_registry._barrier
            if barrier is not None:  # None until the driver starts its first workers
                barrier.abort()

    return Driver


def _guarded_handler(driver):
    """Horovod's elastic rendezvous handler, minus the one request that unpickles what it
    receives (a worker's notification address): ranks send that over the job's channel."""
    from horovod.runner.elastic.rendezvous import PUT_WORKER_ADDRESSES, create_rendezvous_handler

    base = create_rendezvous_handler(driver)

    class GuardedHandler(base):
        def do_PUT(self):
            if self.path.split("/")[1:2] == [PUT_WORKER_ADDRESSES]:
                self.send_status_code(403)
                return
            super().do_PUT()

        def do_GET(self):
            try:
                super().do_GET()
            except _STOPPED:
                if not driver.finished():
                    raise
                self.send_status_code(503)  # the run is over: this rank is being stopped

    return GuardedHandler
