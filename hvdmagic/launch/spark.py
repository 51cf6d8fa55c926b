"""The Spark backend: the task supervisors as one barrier stage on the kernel's SparkSession.

Runs in the kernel. It takes its session from ``launch.spark_session`` (the active one,
or an embedded local one), checks that the session has the slots the stage needs
(``session_for``, counting with ``launch.slots``), runs the stage
(``hvdmagic.task.barrier``'s code, shipped in its closure) in a job group of its own,
watches it for failure and cancels it. It matches ``launch.backend.Backend``; its calls
into the JVM go through the Spark thread (``spark_session.on_spark_thread``). Imports
pyspark lazily.

A Spark Connect session (``launch.spark_connect``) runs the same stage through the same
backend; the seam is small. Its slots are counted from what Connect offers
(``connect_slots``), the stage is ``spark.range(n, numPartitions=n).mapInArrow(fn, schema,
barrier=True)`` (a Connect session has no RDDs), it carries an operation tag instead of a job
group (``spark.addTag``; ``spark.interruptTag`` cancels it), and the job's channel listens on
the kernel's address toward the Connect server instead of ``spark.driver.host``.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import uuid
from collections.abc import Callable

from hvdmagic.channel import DEFAULT_GRACE
from hvdmagic.errors import LaunchError
from hvdmagic.launch import settings, spark_connect, spark_session
from hvdmagic.launch import slots as slot_check
from hvdmagic.launch.backend import Backend
from hvdmagic.launch.spark_session import first_line, on_spark_thread
from hvdmagic.protocol import Stage, TaskSpec
from hvdmagic.task.barrier import (
    TASK_SCHEMA,
    UNREACHABLE,
    arrow_task,
    barrier_task,
    elastic_task,
    sharded_barrier_task,
)

RETAG_INTERVAL = 0.5  # seconds between a cancelled Connect stage's interrupts, until its collect() ends
held_slots: dict[object, int] = {}  # by session: the barrier slots its warm ranks occupy while it runs


def session_for(np: int, on_stage: Callable[[Stage], None] = lambda stage: None,
                notes: list[str] | None = None, embedded_slots: int | None = None,
                stop: threading.Event | None = None):
    """The active SparkSession, or an embedded local one with at least ``np`` slots
    (``embedded_slots`` when hvdmagic starts it: an elastic job's --max-np), with
    ``np`` barrier task slots free.

    Runs on the Spark thread. ``launch.spark_session`` finds, starts or replaces the
    session (``notes`` says when it replaced a broken one). An embedded session too
    small for ``np`` is restarted bigger; on any other, ``classic_slots`` checks.
    """
    session, new = spark_session.find_or_start(max(np, embedded_slots or 0), on_stage, notes)
    if new:
        return session
    if spark_session.is_embedded(session) and not held_slots:  # no stage of a session there: resize it freely
        if slot_check.available(session.sparkContext) < np:
            return spark_session.restart_embedded(max(np, embedded_slots or 0), on_stage)
        return session
    classic_slots(session, np, on_stage, notes, stop=stop)
    return session


def classic_slots(session, np: int, on_stage: Callable[[Stage], None] = lambda stage: None,
                  notes: list[str] | None = None, asked: str = "--np", stop: threading.Event | None = None) -> None:
    """The slot check on a classic session that is given (a DataFrame's, an estimator's): ``np``
    free barrier task slots, after waiting for those on their way (launch.slots) until ``stop``
    is set, or one paragraph. Runs on the Spark thread. ``asked``: how the user wrote np."""
    sc = session.sparkContext
    held = sum(held_slots.values())
    slots = slot_check.available(sc) - held
    if slots >= np:
        return
    on_stage(Stage.WAITING_FOR_SLOTS)
    waited = slot_check.wait(np, slots, held, lambda: slot_check.available(sc),
                             lambda now: slot_check.on_their_way(sc, now), slot_check.bound(session), stop)
    if waited.slots >= np:
        if notes is not None and (note := waited.note()):
            notes.append(note)
        return
    conf = sc.getConf()
    raise too_few_slots(np, waited, held, sc.master, conf.get("spark.task.cpus", "1"),
                        conf.get("spark.task.resource.gpu.amount", None), asked=asked)


def too_few_slots(np: int, waited: slot_check.Waited, held: int, master: str, task_cpus: str,
                  task_gpus: str | None, kind: str = "Spark", asked: str = "--np") -> LaunchError:
    """The one paragraph for a cluster without ``np`` free barrier task slots after the wait;
    ``asked``: how the user wrote np (``--np`` in a cell, an estimator's ``num_proc``)."""
    slots = waited.slots

    def wrote(n: int) -> str:
        return f"{asked} {n}" if asked.startswith("-") else f"{asked}={n}"

    if held:
        return LaunchError(
            f"{wrote(np)} needs {np} free barrier task slots at once, and the warm ranks of a session hold "
            f"{held} of this {kind} cluster's {slots + held} ({waited.reason(np)}): run the cell on the session "
            "(leave out --np), stop the session (%horovod stop), or use local mode (--np -N).")
    per_task = f"{task_cpus} core(s)" + (f" and {task_gpus} GPU(s)" if task_gpus else "")
    # An estimator's num_proc has no local mode; a cell's --np and HorovodRunner's np do.
    local = "" if asked == "num_proc" else f", or run on the driver in local mode with {wrote(-np)}"
    return LaunchError(
        f"{wrote(np)} needs {np} barrier task slots at once, but this {kind} cluster offers {slots} "
        f"(master {master}, {per_task} per task), {waited.reason(np)}. Spark would retry silently for "
        f"minutes, so hvdmagic stops here: use a smaller {asked}, add executors or cores{local}."
    )


def connect_slots(session, np: int, on_stage: Callable[[Stage], None], notes: list[str],
                  asked: str = "--np", stop: threading.Event | None = None) -> None:
    """The slot check on a Spark Connect session: ``np`` free barrier task slots, or one paragraph.

    Runs on the Spark thread. Connect offers no SparkContext, so the count is
    ``spark_connect.available``'s; what is on its way, its settings only. Where the count
    cannot be told, the stage is submitted anyway and ``notes`` says that a too-large --np
    then waits in Spark's queue, which --timeout bounds.
    """
    held = sum(held_slots.values())
    count = spark_connect.available(session)
    if count is None:
        notes.append("hvdmagic could not count this Spark Connect cluster's barrier task slots (it reads the "
                     "server's spark.master and defaultParallelism); if --np is more than it has, the stage "
                     "waits in Spark's queue: bound the cell with --timeout")
        return
    if count - held >= np:
        return
    master = spark_connect.conf(session, "spark.master", "?") or "?"
    if master.startswith("local"):  # a local master has all its slots from the start: nothing to wait for
        waited = slot_check.Waited(count - held, 0.0, None, None, False, 0.0)
        raise too_few_slots(np, waited, held, master, str(spark_connect.task_cpus(session)),
                            spark_connect.conf(session, "spark.task.resource.gpu.amount"), kind="Spark Connect",
                            asked=asked)
    on_stage(Stage.WAITING_FOR_SLOTS)

    def counted() -> int:
        return spark_connect.available(session) or 0

    waited = slot_check.wait(np, count - held, held, counted, lambda now: spark_connect.on_their_way(session, now),
                             slot_check.bound(session), stop)
    if waited.slots >= np:
        if note := waited.note():
            notes.append(note)
        return
    raise too_few_slots(np, waited, held, master, str(spark_connect.task_cpus(session)),
                        spark_connect.conf(session, "spark.task.resource.gpu.amount"), kind="Spark Connect",
                        asked=asked)


def check_slots(session, np: int, asked: str, on_stage: Callable[[Stage], None] = lambda stage: None) -> None:
    """The launch's slot check, now: for a caller with work to do before its launch (an estimator
    prepares and counts its DataFrame first), so that too few slots are what it reports first."""
    check = connect_slots if spark_connect.is_connect(session) else classic_slots
    SparkBackend._checking_slots(check, session, np, on_stage, [], asked)


def kernel_host(session) -> str:
    """The address the session's executors reach this kernel at: ``spark.driver.host`` on a classic
    session, the interface toward the server on Spark Connect (``spark_connect.kernel_address``)."""
    if spark_connect.is_connect(session):
        return spark_connect.kernel_address(session)
    return session.sparkContext.getConf().get("spark.driver.host", "127.0.0.1")


class SparkBackend(Backend):
    name = "spark"

    def __init__(self, np: int, session=None, data=None, on_stage: Callable[[Stage], None] = lambda stage: None,
                 gpus: bool = False, elastic_start: int | None = None, asked: str = "--np"):
        self.np = np
        self.asked = asked  # how the user wrote np, for the slot check's paragraph
        # Elastic (elastic_start given): a plain stage of np tasks, of which elastic_start need
        # slots for training to begin; the rest start as slots free up (launch.elastic).
        self.elastic_start = elastic_start
        self.data = data
        self.on_stage = on_stage
        self.notes: list[str] = []  # for the run's record, e.g. that a broken embedded session was replaced
        self.session = session or (data.sparkSession if data is not None else None)
        # The notebook's Connect session is found here, on the cell's thread: Connect keeps its
        # active session per thread, and the Spark thread has none.
        self.session = self.session or spark_connect.active_session()
        self.connect = spark_connect.is_connect(self.session)
        if self.connect:
            self.name = "spark connect"
            self._start_on_connect(elastic_start or np, gpus)
            return
        if spark_session.embedded_starting():  # a stopped cell's session is still starting: this cell waits for it
            on_stage(Stage.SPARK_STARTING)
        if self.session is None:
            self.session = self._checking_slots(session_for, elastic_start or np, on_stage, self.notes, np)
            # A session hvdmagic started on its Spark thread becomes the notebook's active one too.
            if note := spark_session.make_active_here(self.session):
                self.notes.append(note)
        else:  # a DataFrame's session (--data, an estimator's fit): counted too, never restarted under it
            self._checking_slots(classic_slots, self.session, elastic_start or np, on_stage, self.notes, asked)
        self.sc = self.session.sparkContext
        self.bind_host, self.master, task_gpus, self.reconnect_grace = on_spark_thread(lambda: (
            kernel_host(self.session), self.sc.master, self.sc.getConf().get("spark.task.resource.gpu.amount", None),
            settings.seconds(self.session, settings.RECONNECT_GRACE, DEFAULT_GRACE)))
        self._check_gpus(gpus, task_gpus)
        self.job_group = f"hvdmagic-{uuid.uuid4().hex[:12]}"
        self._thread = None
        self._error: str | None = None
        self.failure_details = ""  # the whole Spark error behind failure(), Java trace included
        # Spark's log of the stage's failed tasks kept out of the cell (spark_session.quiet_task_logs) until join().
        self._quieted = False

    def _start_on_connect(self, np: int, gpus: bool) -> None:
        """What __init__ does on a Spark Connect session: no JVM here, and no SparkContext to ask."""
        self.sc = None
        self.bind_host, self.master, task_gpus, self.reconnect_grace = on_spark_thread(lambda: (
            kernel_host(self.session), spark_connect.conf(self.session, "spark.master", "?"),
            spark_connect.conf(self.session, "spark.task.resource.gpu.amount"),
            settings.seconds(self.session, settings.RECONNECT_GRACE, DEFAULT_GRACE)))
        self._check_gpus(gpus, task_gpus)
        self._checking_slots(connect_slots, self.session, np, self.on_stage, self.notes, self.asked)
        # On Connect the job "group" is an operation tag: the name Spark cancels it by.
        self.job_group = f"hvdmagic-{uuid.uuid4().hex[:12]}"
        self._thread = None
        self._error = None
        self.failure_details = ""
        self._quieted = False  # the server's JVM logs elsewhere: nothing of it reaches the cell
        # Set by cancel(): a stage not yet sent is not sent, and one on its way is interrupted until it ends.
        self._cancelled = threading.Event()

    @staticmethod
    def _checking_slots(check: Callable, *args):
        """``check(*args, stop)`` on the Spark thread; an interrupt sets ``stop`` so that a slot
        check left waiting does not hold up every later cell's Spark calls."""
        stop = threading.Event()
        try:
            return on_spark_thread(check, *args, stop)
        except KeyboardInterrupt:
            stop.set()
            raise

    @staticmethod
    def _check_gpus(gpus: bool, task_gpus: str | None) -> None:
        if gpus and not task_gpus:
            raise LaunchError("a GPU per process was asked for (use_gpu=True), but this Spark session gives its "
                              "tasks none: set spark.task.resource.gpu.amount (and the executors' GPU "
                              "resources, docs/clusters.md), or pass use_gpu=False.")

    def describe(self) -> str:
        kind = "stage" if self.elastic_start else "barrier stage"
        if self.connect:
            host, port = spark_connect.server(self.session)
            return (f"Spark Connect {kind} of {self.np} tasks, tag {self.job_group} on {self.master} "
                    f"(server {host}:{port})")
        return f"Spark {kind} of {self.np} tasks, job group {self.job_group} on {self.master}"

    def start(self, spec: TaskSpec) -> None:
        self.on_stage(Stage.SUBMITTED)
        if self.connect:  # no py4j connection to release: a plain thread
            self._thread = threading.Thread(target=self._run, args=(spec,), name="hvdmagic-spark-job", daemon=True)
            self._thread.start()
            return
        if not spark_session.is_embedded(self.session):  # the embedded session's JVM already logs to a file
            on_spark_thread(spark_session.quiet_task_logs, self.sc)
            self._quieted = True
        on_spark_thread(self._start_job_thread, spec)

    def _start_job_thread(self, spec: TaskSpec) -> None:
        from pyspark import InheritableThread

        # InheritableThread releases its py4j connection when it ends: plain threads
        # would leave one behind per cell in pinned-thread mode. Its start() calls the
        # JVM, so it runs on the Spark thread too.
        self._thread = InheritableThread(target=self._run, args=(spec,), name="hvdmagic-spark-job", daemon=True)
        self._thread.start()

    def _run(self, spec: TaskSpec) -> None:
        try:
            if self.connect:
                # Connect keeps tags per client thread: every operation this thread starts carries it.
                self.session.addTag(self.job_group)
                if self._cancelled.is_set():  # Stop came before the stage was sent: send nothing
                    return
            else:
                self.sc.setJobGroup(self.job_group, f"hvdmagic %%horovod --np {self.np}", interruptOnCancel=True)
            self._stage(spec).collect()
        except Exception as exc:
            self.failure_details = str(exc)
            if UNREACHABLE in self.failure_details:
                self._error = self._unreachable(self.failure_details)
                return
            kind = "stage" if self.elastic_start else "barrier stage"
            line = first_line(exc)
            if self.connect and (missing := re.search(r"No module named '(hvdmagic|horovod|torch|pyarrow)\b", line)):
                # first_line's advice names this kernel's PYSPARK_PYTHON; on Connect the executors are the server's.
                line = (f"ModuleNotFoundError: No module named '{missing.group(1)}' on the Spark Connect server's "
                        "executors: start the server with PYSPARK_PYTHON (or spark.pyspark.python) naming a Python "
                        "that has hvdmagic, horovod, torch and pyarrow (docs/clusters.md#spark-connect)")
            self._error = (f"the Spark {kind} failed: {line} (the whole error is in "
                           "hvdmagic.last_run().error.details)")
        finally:
            if self.connect:
                with contextlib.suppress(Exception):
                    self.session.removeTag(self.job_group)

    def _stage(self, spec: TaskSpec):
        """The stage that runs the tasks: an RDD's barrier stage on a classic session; on Connect,
        which has no RDDs, ``mapInArrow`` over a range of one row per task, as pyspark's own
        TorchDistributor runs there. Either way the task reads its (Barrier)TaskContext as
        usual, and all it sends back through Spark is its index and exit code."""
        if self.data is not None:
            from pyspark.sql.pandas.types import to_arrow_schema

            task = sharded_barrier_task(spec, to_arrow_schema(self.data.schema))
            # repartition(np) is round-robin: the shards differ by a few rows at most.
            return self.data.repartition(self.np).mapInArrow(task, TASK_SCHEMA, barrier=True)
        task = elastic_task(spec) if self.elastic_start else barrier_task(spec)
        if self.connect:
            rows = self.session.range(self.np, numPartitions=self.np)
            return rows.mapInArrow(arrow_task(task), TASK_SCHEMA, barrier=not self.elastic_start)
        rdd = self.sc.parallelize(range(self.np), self.np)
        return rdd.mapPartitions(task) if self.elastic_start else rdd.barrier().mapPartitions(task)

    def _unreachable(self, details: str) -> str:
        line = next((line for line in details.splitlines() if UNREACHABLE in line), details)
        detail = line.split(UNREACHABLE, 1)[1].strip(" :")
        if self.connect:
            return spark_connect.unreachable(detail, self.bind_host, self.session)
        return (f"the Spark tasks could not connect back to this kernel ({detail}): the job's channel listens on "
                f"{self.bind_host} (spark.driver.host), which the executors cannot reach. Set spark.driver.host "
                "to an address of this machine that the executors reach, or open its ports to them.")

    def failure(self) -> str | None:
        return self._error

    def ended(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def cancel(self) -> None:
        if self.connect:
            self._cancelled.set()
            self._interrupt_tag()
            return
        try:
            on_spark_thread(self.sc.cancelJobGroup, self.job_group)
        except Exception:
            pass  # the context may already be stopped; nothing is left to cancel then

    def _interrupt_tag(self) -> None:
        try:
            # Any thread may interrupt a tag; no JVM here, so no need to queue behind the Spark thread.
            self.session.interruptTag(self.job_group)
        except Exception:
            pass  # the server may be gone; nothing is left to cancel then

    def join(self, timeout: float) -> None:
        try:
            self._join_thread(timeout)
        finally:
            if self._quieted:  # after cancel(), whose "Failed to cancel job group" is quieted too
                self._quieted = False
                on_spark_thread(spark_session.restore_task_logs)

    def _join_thread(self, timeout: float) -> None:
        if self._thread is None:
            return
        if not (self.connect and self._cancelled.is_set()):
            self._thread.join(timeout)
            return
        # A Stop just after start() can reach the server before the stage does: the tag then names
        # no operation yet, and the stage would wait for slots with nobody to run it for. Interrupt
        # again until the thread's collect() has ended, so the stage never outlives the cell.
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and (left := deadline - time.monotonic()) > 0:
            self._thread.join(min(left, RETAG_INTERVAL))
            if self._thread.is_alive():
                self._interrupt_tag()
