"""The record of one run, built from job events; what ``hvdmagic.last_run()`` returns.

Both views (the widget dashboard and the text twin) read from it, so they
always agree, and it outlives them: the full metrics history, every log line,
timings and the result stay reachable after the cell ends.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from hvdmagic import metric_rows, rank_ranges, stacks
from hvdmagic.kernel.cell_frames import CellFrames
from hvdmagic.kernel.hang_notices import HangNotice, HangNotices
from hvdmagic.kernel.history import MetricHistory
from hvdmagic.kernel.noise import is_startup_noise
from hvdmagic.kernel.stragglers import Straggler, StragglerDetector
from hvdmagic.launch.placement import Placement
from hvdmagic.protocol import STAGE_ORDER, Event, Stage

ENDED = ("finished", "failed", "stopped")  # a rank's states once its exit is in


@dataclass
class Bar:
    step: float
    total: float | None
    first_step: float
    first_time: float
    time: float
    restarts: int = 0  # how many times a step below the last one started this bar over (a new epoch)

    @property
    def rate(self) -> float | None:
        elapsed = self.time - self.first_time
        return (self.step - self.first_step) / elapsed if elapsed > 0 and self.step > self.first_step else None

    @property
    def eta(self) -> float | None:
        rate = self.rate
        if rate and self.total is not None:
            return max(0.0, (self.total - self.step) / rate)
        return None


@dataclass
class RankRecord:
    rank: int
    host: str = ""
    # launching, running, finished, failed, stopped; ready: a session's, still up; idle: a session's rank
    # that the cell does not run on (--ranks)
    state: str = "launching"
    bars: dict[str, Bar] = field(default_factory=dict)
    last_bar: str | None = None
    last_line: str = ""
    logs: list[tuple[str, str]] = field(default_factory=list)  # (stream, line)
    exit_code: int | None = None
    stage: Stage | None = None  # the furthest start-up stage this rank reached
    quiet: list[str] = field(default_factory=list)  # start-up chatter kept out of the views (kernel.noise)
    # How many of its logs came before the run's first failure, and before its own error: what came
    # after (its own error's, or else the run's) is the stop's fallout (Gloo's "Connection reset by
    # peer"). None while nothing failed. Its own error's count wins: a rank's lines and the others'
    # errors reach the kernel in any order, its own error after its lines.
    logs_at_failure: int | None = None
    logs_at_error: int | None = None
    # Where it was when the run failed or was stopped, if known: "in the cell (Cell In[15], line 6)",
    # "in `allreduce` (Cell In[4], line 9)" (its stacks), "while training" (its stage).
    ended_in: str = ""
    stage_since: float | None = None  # when it reached that stage, on the kernel's clock
    # The framework it imports now, as it says (rank.framework_imports): "tensorflow"; "" when none; and since when.
    importing: str = ""
    importing_since: float | None = None
    world_rank: int | None = None  # elastic: its Horovod rank now (rows are tasks; ranks change at resets)
    lost: str = ""  # elastic: why its last rank was lost, e.g. "killed by SIGKILL"
    # Since when (time.time()) its task's connection to the kernel has been broken, while it is; None while
    # in contact. Its rank trains on meanwhile, and what it sends waits in its task (task.kernel_link).
    out_of_contact_since: float | None = None
    in_debugger: bool = False  # stopped at breakpoint(), in pdb (rank.debugger), from its prompt until it runs again
    # Every bar's advances added up (a restarted bar's from 0), and the rank's clock at the latest:
    # kernel.stragglers turns them into step rates.
    steps: float = 0.0
    steps_time: float = 0.0
    steps_waited: float = 0.0  # its seconds waited in collectives by then, where timed (rank.collective_wait)
    step_rate: float | None = None  # its steps a second in the latest straggler window it took part in
    straggler: Straggler | None = None  # its flag while it is a straggler (kernel.stragglers), else None
    # Sampled by its supervisor each second while it runs (task.resources): CPU % of one core and
    # RSS (bytes) of its process tree, the most RSS seen, and each GPU it uses (a dict per GPU).
    cpu: float | None = None
    rss: int | None = None
    peak_rss: int = 0
    gpus: list = field(default_factory=list)

    @property
    def logs_cut(self) -> int | None:
        """How many of its logs came before its failure (its own error's, or else the run's)."""
        return self.logs_at_error if self.logs_at_error is not None else self.logs_at_failure

    @property
    def quiet_before_failure(self) -> list[str]:
        """Its start-up chatter (``quiet``) from before its failure."""
        return [line for _, line in self.logs[:self.logs_cut] if is_startup_noise(line)]

    @property
    def after_failure(self) -> list[str]:
        """The lines it printed after its failure, hidden ones too."""
        return [line for _, line in self.logs[self.logs_cut:]] if self.logs_cut is not None else []

    def where_it_died(self) -> str:
        """Where a crash signal killed the rank (its fault handler's stacks), or ""."""
        return stacks.where_it_died([line for stream, line in self.logs if stream == "stderr"])

    @property
    def bar(self) -> Bar | None:
        return self.bars.get(self.last_bar) if self.last_bar is not None else None


class RunRecord:
    """One run as the views show it: a row per rank (an elastic run's: per task, ``max_np`` of them)."""

    def __init__(self, placement: Placement, command: str = "%%horovod", ranks: list[int] | None = None):
        self.np = placement.tasks
        elastic = placement.elastic
        # (min_np, start np, max_np) of an elastic run
        self.elastic = (elastic.min_np, placement.np, elastic.max_np) if elastic else None
        self.world_size = placement.np  # the ranks training now
        self.resets: list = []  # elastic: each reset (launch.elastic.Reset): when, why, sizes, the commit
        self.mode = placement.where.value
        self.command = command  # how the run was asked for: "%%horovod", "%%torchrun", "hvdmagic.run", ...
        self.state = "launching"
        self.description = ""
        self.job_group: str | None = None
        self.started = time.time()
        self.ended: float | None = None
        # The run ended in its caller's preparation (an estimator's checks of its DataFrame), before its
        # launch: no rank ever started, and its error says all there is (views add nothing they have not shown).
        self.ended_before_launch = False
        # A session's cell on some ranks (--ranks) leaves the others idle, their rows too.
        self.only = ranks
        self.ranks = [RankRecord(r, state="launching" if ranks is None or r in ranks else "idle")
                      for r in range(self.np)]
        self.history = MetricHistory()
        # The merged log, kept incrementally so a redraw never rescans every rank's.
        self.all_logs: list[tuple[int, str, str]] = []  # (rank, stream, line) in arrival order
        # How many of all_logs came before the first error or failed exit; None while nothing failed.
        self.all_logs_at_failure: int | None = None
        self.result: Any = None
        self.results: list[Any] = []
        self.error: BaseException | None = None
        self.timeline: str | None = None  # where rank 0 wrote a Horovod Timeline (--timeline)
        self.notes: list[str] = []  # sentences from the ranks, e.g. a scaled learning rate
        # A ranked note's text: where its sentence is in notes, and the ranks that sent it.
        self._ranked_notes: dict[str, tuple[int, list[int]]] = {}
        # The payload's large values on their way to the hosts (a SHIPPING event: text, bytes by
        # host), or None when every host had them already.
        self.shipping: dict | None = None
        self.capture = ""  # the magic's capture summary: the globals it shipped, their types and sizes
        # Whether the cell looks like it logs metrics (kernel.magic reads its source): the dashboard
        # keeps room for the charts from its first frame, so that nothing below them jumps.
        self.charts_expected = False
        self.bars_expected = False  # likewise, whether the ranks look like they drive progress bars
        # metric -> "linear" or "log": the scale its live chart had last, which the snapshot keeps.
        self.chart_scales: dict[str, str] = {}
        # By rank: where each running rank was (its Python stacks) when a watchdog stopped the run.
        self.stacks: dict[int, str] = {}
        # What the views ask of the live job (Event.STACKS: "where are the ranks?"); the job reads it.
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        # By rank: where it was when last asked (ask_where), trimmed to the user's frames; and when.
        self.where: dict[int, str] = {}
        # How its stacks name the notebook cells (Cell In[5]): the runner gives it the run's own cell.
        self.cell_frames = CellFrames()
        self.where_asked: float | None = None
        # By rank: the digest of its NCCL flight recorder's latest dump (hvdmagic.flight_records).
        self.flight_records: dict[int, dict] = {}
        self._hangs = HangNotices()  # Horovod's stall reports, read from the ranks' stderr
        self._stragglers = StragglerDetector()
        # Start-up: the stage the run is in (for rank stages, the slowest rank's), and when
        # the run reached each stage, on the kernel's clock.
        self.stage: Stage | None = None
        self.stage_reached: dict[Stage, float] = {}
        self.version = 0  # bumped on every change, so views redraw only when needed
        self._lock = threading.Lock()

    # -- fed by the launcher ------------------------------------------------
    def ask_where(self) -> None:
        """Ask every running rank where it is now; the answers fill ``where`` as they come."""
        with self._lock:
            self.where = {}
            self.where_asked = time.time()
        self.requests.put(Event.STACKS)

    def shipping_note(self) -> str | None:
        """What went to the hosts and how fast, once it all went; None while sending or when nothing was."""
        shipping = self.shipping
        return str(shipping["text"]) if shipping and shipping.get("done") and shipping.get("sent") else None

    def apply(self, event: dict) -> None:
        kind = event.get("type")
        with self._lock:
            self.version += 1
            if kind == Event.LAUNCHING:
                self.description = event.get("description", "")
                self.job_group = event.get("job_group")
                self.mode = event.get("backend") or self.mode  # "spark connect" on a Connect session
                return
            if kind == Event.STAGE and "rank" not in event:
                self._reach(Stage(event["stage"]))
                return
            if kind == Event.NOTE and "rank" not in event:  # the driver's own, e.g. a replaced Spark session
                self.notes.append(str(event.get("text", "")))
                return
            if kind == Event.SHIPPING:
                self.shipping = event
                return
            if kind == Event.RESUMED:
                reset = event["reset"]
                self.resets.append(reset)
                self.world_size = reset.size_after
                self.notes.append(reset.describe())
                return
            rank = event["rank"]  # the job passes on only events whose rank it checked
            record = self.ranks[rank]
            if kind == Event.RESOURCES:
                record.cpu, record.rss, record.gpus = event.get("cpu"), event.get("rss"), event.get("gpus") or []
                record.peak_rss = max(record.peak_rss, record.rss or 0)
                return
            if kind == Event.STACKS:
                self.where[rank] = self.cell_frames.named(stacks.user_stacks(str(event.get("text", "")).splitlines()))
                if self._hangs.notices and self._hangs.notices[-1].first_seen <= (self.where_asked or 0):
                    self._hangs.notices[-1].where = stacks.summary(self.where)
                return
            if kind == Event.FLIGHT_RECORD:
                self.flight_records[rank] = event.get("digest") or {}
                return
            if kind == Event.WORLD:
                record.world_rank = event.get("world_rank")
                return
            if kind == Event.LOST:
                record.state, record.lost, record.world_rank = "lost", str(event.get("reason", "")), None
                return
            if kind in (Event.DEBUG_PROMPT, Event.DEBUG_END):
                record.in_debugger = kind == Event.DEBUG_PROMPT
                return
            if kind == Event.CONTACT:
                if record.state in ENDED:
                    # Its exit is in, so the row is final: the connection of a task that is ending may still
                    # break (a close with the kernel's last frames unread resets it), and that is no news.
                    return
                since = event.get("since")
                record.out_of_contact_since = (since if isinstance(since, (int, float)) else time.time()) \
                    if event.get("lost") else None
                return
            if kind == Event.STAGE:
                if "importing" in event:
                    record.importing = str(event["importing"] or "")
                    record.importing_since = time.time() if record.importing else None
                self._rank_reached(record, Stage(event["stage"]))
            elif record.stage is not Stage.TRAINING and _the_cell_at_work(event):
                self._rank_reached(record, Stage.TRAINING)
            if kind == Event.PLACED:
                record.host = event.get("host", "")
                record.state = "running"
                record.stage = None if self.elastic else record.stage  # an elastic task's new rank starts over
                self.state = "running"
            elif kind == Event.OUTPUT:
                lines = list(event.get("lines") or [])
                stream = event.get("stream", "stdout")
                record.logs.extend((stream, line) for line in lines)
                record.quiet.extend(line for line in lines if is_startup_noise(line))
                if stream == "stderr":  # Horovod's stall reports: a notice says them, the live lines need not
                    notices = len(self._hangs.notices)
                    lines = self._hangs.read(rank, lines, size=self.world_size, now=time.time())
                    if len(self._hangs.notices) > notices:  # a new stall: its notice says where the ranks are
                        self.where, self.where_asked = {}, time.time()
                        self.requests.put(Event.STACKS)
                lines = [line for line in lines if not is_startup_noise(line)]
                self.all_logs.extend((rank, stream, line) for line in lines)
                shown = event.get("transient") or (lines[-1] if lines else None)
                if shown is not None:
                    record.last_line = shown
            elif kind == Event.NOTE and event.get("ranked"):
                self._ranked_note(str(event.get("text", "")), rank)
            elif kind == Event.NOTE:
                once = event.get("once")
                text = str(event.get("text", ""))
                # Once per kernel (the Keras 2 note), and each text once per run (every rank's own "spawned").
                if (once is None or once not in _SAID_ONCE) and text not in self.notes:
                    _SAID_ONCE.add(once)
                    self.notes.append(text)
            elif kind == Event.REPORT:
                self._apply_report(rank, record, event)
            elif kind == Event.ERROR:
                record.state, record.in_debugger = "failed", False
                self._mark_failure(rank)
            elif kind == Event.EXIT:
                record.exit_code, record.in_debugger = event.get("code"), False
                if record.state != "failed":
                    record.state = "finished" if event.get("code") == 0 else (
                        "stopped" if event.get("aborted") else "failed")
                    if record.state == "failed":
                        self._mark_failure(rank)

    def _ranked_note(self, text: str, rank: int) -> None:
        """One note for every rank that sent ``text``, naming them: "ranks 0, 2 on vm were spawned"."""
        if text not in self._ranked_notes:
            self._ranked_notes[text] = (len(self.notes), [])
            self.notes.append("")
        place, ranks = self._ranked_notes[text]
        ranks.append(rank)
        self.notes[place] = text.replace("{ranks}", rank_ranges.label(ranks))

    def _mark_failure(self, rank: int) -> None:
        """A rank's error: what it prints from now on follows it; and at the run's first, what the others
        print follows the run's failure, as they are stopped. An elastic run goes on after a rank's
        failure, so nothing it prints is fallout."""
        if self.elastic:
            return
        failed = self.ranks[rank]
        if failed.logs_at_error is None:
            failed.logs_at_error = len(failed.logs)
        if self.all_logs_at_failure is None:
            self.all_logs_at_failure = len(self.all_logs)
            for record in self.ranks:
                record.logs_at_failure = len(record.logs)

    def _reach(self, stage: Stage) -> None:
        self.stage = stage
        self.stage_reached.setdefault(stage, time.time())

    def _rank_reached(self, record: RankRecord, stage: Stage) -> None:
        if record.stage is None or STAGE_ORDER[stage] > STAGE_ORDER[record.stage]:
            record.stage = stage
            record.stage_since = time.time()
        # An elastic run's tasks that wait for a slot, or lost their rank, do not hold the run's stage back,
        # nor do the ranks a session's cell does not run on.
        ranks = [r for r in self.ranks if r.state == "running"] if self.elastic else \
            [r for r in self.ranks if r.state != "idle"]
        if ranks and all(r.stage is not None for r in ranks):
            slowest = min((r.stage for r in ranks), key=STAGE_ORDER.__getitem__)
            if self.stage is None or STAGE_ORDER[slowest] > STAGE_ORDER[self.stage]:
                self._reach(slowest)

    def _apply_report(self, rank: int, record: RankRecord, event: dict) -> None:
        batch = event.get("metrics")
        if batch:
            try:
                # An elastic run's metrics are its Horovod ranks', so "rank 0" is whoever is rank 0 then.
                as_rank = record.world_rank if self.elastic and record.world_rank is not None else rank
                self.history.extend(as_rank, *metric_rows.decode(batch))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                # A dashboard problem must not end the training run; say what was dropped instead.
                self.notes.append(f"rank {rank} sent a malformed metrics batch, which was dropped: {exc}")
        for desc, (step, total, stamp, *waited) in (event.get("progress") or {}).items():
            bar = record.bars.get(desc)
            if bar is None or step < bar.step:  # a new bar, or the same name restarted (next epoch)
                record.bars[desc] = Bar(step, total, step, stamp, stamp, bar.restarts + 1 if bar else 0)
                record.steps += step  # it counts from 0: its steps so far were made since the last report
            else:
                record.steps += step - bar.step
                bar.step, bar.total, bar.time = step, total, stamp
            record.last_bar = desc
            if stamp >= record.steps_time:
                record.steps_time = stamp
                record.steps_waited = waited[0] if waited else record.steps_waited
        if event.get("progress"):
            now = time.time()
            if self._stragglers.due(now):
                self._check_stragglers(now)

    def _check_stragglers(self, now: float) -> None:
        """Close the straggler window, from the steps of the ranks that train now (kernel.stragglers)."""
        training, open_ended = {}, set()
        for record in self.ranks:
            bars = record.bars.values()
            finished = all(bar.total is not None and bar.step >= bar.total for bar in bars)
            if record.state == "running" and bars and not finished:
                training[record.rank] = (record.steps, record.steps_time, record.steps_waited)
                if (bar := record.bar) is not None and bar.total is None:
                    open_ended.add(record.rank)
        self._stragglers.check(now, training, {record.rank: record.host for record in self.ranks}, open_ended)
        for rank, rate in self._stragglers.rates.items():
            self.ranks[rank].step_rate = rate
        flagged = {flag.rank: flag for flag in self._stragglers.current}
        for record in self.ranks:
            record.straggler = flagged.get(record.rank)

    def finish(self, results: list | None = None, error: BaseException | None = None, cancelled: bool = False,
               ready: bool = False) -> None:
        """The run ended: with ``results``, an ``error``, or ``cancelled``. ``ready``: the ranks stay up
        (a session's start, ``%horovod start``), so the record and its running ranks read "ready"."""
        with self._lock:
            self.version += 1
            self.ended = time.time()
            self.results = list(results or [])
            self.result = self.results[0] if self.results else None
            self.error = error
            done = "ready" if ready else "finished"
            self.state = "cancelled" if cancelled else "failed" if error is not None else done
            for record in self.ranks:
                if record.state == "launching" and self.elastic:
                    record.state = "unused"  # an elastic task that never got a slot or a rank
                elif record.state in ("launching", "running"):
                    record.state = "stopped" if error is not None or cancelled else done
            if error is not None:
                self._say_where_each_ended(error)

    def _say_where_each_ended(self, error: BaseException) -> None:
        """Each failed rank's line of the cell its exception came from; each stopped rank's place
        in its stacks, taken before the stop, or else "while training" once past hvd.init and before its
        first report (a row that reported shows its bar or its last line instead)."""
        failures = {failure.rank: failure for failure in getattr(error, "failures", ())}
        taken = getattr(error, "stacks", None) or {}
        for record in self.ranks:
            failure = failures.get(record.rank)
            if failure is not None and (line := stacks.raised_at(failure.traceback)):
                record.ended_in = f"in the cell ({line})"
            elif record.state == "stopped" and (place := stacks.place(taken.get(record.rank, ""))):
                record.ended_in = place
            elif record.state == "stopped" and record.stage is Stage.FIRST_STEP:
                record.ended_in = "while training"  # past hvd.init, before a report (a row that trained says so)

    # -- read by views and users --------------------------------------------
    @property
    def elapsed(self) -> float:
        return (self.ended or time.time()) - self.started

    @property
    def stragglers(self) -> list[Straggler]:
        """Every rank flagged as a straggler in this run, in the order flagged: its ``rank`` (row),
        ``host``, how far below the median step rate it was (``slower``, 0.35 for 35 %; ``worst``),
        its ``rate`` and the ``median``'s in steps a second, and ``since``/``until`` (epoch seconds;
        ``until`` None: it lagged to the end). See ``kernel.stragglers`` for the rule."""
        with self._lock:
            return list(self._stragglers.flags)

    @property
    def flag_count(self) -> int:
        """How many straggler flags the run has raised: a view's cheap test for a new one."""
        return len(self._stragglers.flags)

    @property
    def hang_notices(self) -> list[HangNotice]:
        """Horovod's stall reports in the user's terms, one per stall in the order they came
        (``kernel.hang_notices.HangNotice``): ``text()`` ("rank 1 has not submitted
        `allreduce.grad` for 60 s; ranks 0, 2 are waiting"), ``missing`` (Horovod rank -> tensor
        names), ``waiting``, ``seconds``, ``reports`` and ``first_seen``/``last_seen``."""
        with self._lock:
            return list(self._hangs.notices)

    def latest_metrics(self) -> dict[str, tuple[int | float, float]]:
        """name -> (step, value): the newest value of each of rank 0's metrics."""
        return self.history.latest()

    @property
    def rank0_series(self) -> dict:
        """name -> (steps, values) arrays of rank 0's full history of that metric."""
        return self.history.rank0

    @property
    def metrics(self):
        """The full metrics history of every rank as a pandas DataFrame (one row per call;
        metric values are floats, NaN where a call did not log that metric)."""
        return self.history.frame()

    @property
    def logs(self) -> dict[int, str]:
        """Every output line of every rank, by rank."""
        return {r.rank: "".join(line + "\n" for _, line in r.logs) for r in self.ranks}

    @property
    def timings(self) -> dict:
        """Epoch seconds ``started`` and ``ended``, ``elapsed`` seconds, and ``stages``: the seconds
        spent in each start-up stage the run went through, in order (a rank stage ends when the
        slowest rank leaves it; ``training`` runs to the end)."""
        reached = sorted(self.stage_reached.items(), key=lambda item: item[1])
        ends = [t for _, t in reached[1:]] + [self.ended or time.time()]
        stages = {str(stage): max(0.0, end - t) for (stage, t), end in zip(reached, ends)}
        return {"started": self.started, "ended": self.ended or float("nan"), "elapsed": self.elapsed,
                "stages": stages}

    def __repr__(self) -> str:
        size = f"np={self.np}" if not self.elastic else f"elastic {self.world_size} of {self.np} tasks"
        return (f"<RunRecord {self.state} {size} ({self.mode}) elapsed={self.elapsed:.1f}s "
                f"metrics={len(self.history)} rows>")


def _the_cell_at_work(event: dict) -> bool:
    """Whether a rank's event shows its cell at work, which ends its start-up stages: progress, or
    output other than a framework's start-up chatter (TensorFlow's notices, printed while it imports)."""
    if event.get("type") == Event.REPORT:
        return True
    return event.get("type") == Event.OUTPUT and bool(
        event.get("transient") or not all(map(is_startup_noise, event.get("lines") or [])))


_last: RunRecord | None = None
_SAID_ONCE: set = set()


def last_run() -> RunRecord | None:
    """The record of the most recent %%horovod cell or hvdmagic.run call in this kernel.

    The record is set when the run starts, so it is there while the run is live and
    after it failed or was interrupted, and it outlives the dashboard.

    Returns:
        A ``RunRecord``, or None before the first run. Its ``state`` is one of "launching",
        "running", "finished", "failed", "cancelled"; ``metrics`` is every rank's metrics
        history as a pandas DataFrame; ``logs[rank]`` every output line of that rank;
        ``result`` and ``results`` rank 0's and every returned value; ``error`` the
        exception the run ended with; ``timings`` and ``notes`` (e.g. a scaled learning rate).
        ``hang_notices`` holds Horovod's stall reports, in the user's terms ("rank 1 has not
        submitted `allreduce.grad` for 60 s; ranks 0, 2 are waiting").
        ``stragglers`` lists the ranks flagged as slower than the median (``Straggler``: rank,
        host, how much slower, since when); each of ``ranks`` has its ``step_rate``, and its
        ``cpu`` (%), ``rss`` and ``peak_rss`` (bytes) and ``gpus`` as its supervisor last sampled them.
        An elastic run's ``resets`` lists every reset: ``time``, ``reason``, ``size_before``,
        ``size_after`` and the ``commit`` it resumed from; ``world_size`` is its size now.

    Example::

        run = hvdmagic.last_run()
        print(run.state, run.timings["elapsed"])
        run.metrics.query("rank == 0").plot(x="step", y="loss")
    """
    return _last


def set_last(record: RunRecord) -> None:
    global _last
    _last = record
