"""The Spark backend: the task supervisors as one barrier stage on the kernel's SparkSession.

Runs in the kernel. It takes its session from ``launch.spark_session`` (the active one,
or an embedded local one), checks that the session has the slots the stage needs
(``session_for``, counting with ``launch.slots``), runs the stage
(``hvdmagic.task.barrier``'s code, shipped in its closure) in a job group of its own,
watches it for failure and cancels it. It matches ``launch.backend.Backend``; its calls
into the JVM go through the Spark thread (``spark_session.on_spark_thread``). Imports
pyspark lazily.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

from hvdmagic.errors import LaunchError
from hvdmagic.launch import slots as slot_check
from hvdmagic.launch import spark_session
from hvdmagic.launch.backend import Backend
from hvdmagic.launch.spark_session import first_line, on_spark_thread
from hvdmagic.protocol import Stage, TaskSpec
from hvdmagic.task.barrier import barrier_task, elastic_task, sharded_barrier_task

held_slots: dict[object, int] = {}  # by session: the barrier slots its warm ranks occupy while it runs


def session_for(np: int, on_stage: Callable[[Stage], None] = lambda stage: None,
                notes: list[str] | None = None, embedded_slots: int | None = None,
                stop: threading.Event | None = None):
    """The active SparkSession, or an embedded local one with at least ``np`` slots
    (``embedded_slots`` when hvdmagic starts it: an elastic job's --max-np), with
    ``np`` barrier task slots free.

    Runs on the Spark thread. ``launch.spark_session`` finds, starts or replaces the
    session (``notes`` says when it replaced a broken one). An embedded session too
    small for ``np`` is restarted bigger; on any other, too few slots wait for those
    on their way (launch.slots) until ``stop`` is set, then fail in one paragraph.
    """
    session, new = spark_session.find_or_start(max(np, embedded_slots or 0), on_stage, notes)
    if new:
        return session
    sc = session.sparkContext
    held = sum(held_slots.values())
    slots = slot_check.available(sc) - held
    if slots < np and spark_session.is_embedded(session) and not held:  # a session's stage runs there: keep it
        return spark_session.restart_embedded(max(np, embedded_slots or 0), on_stage)
    if slots >= np:
        return session
    on_stage(Stage.WAITING_FOR_SLOTS)
    waited = slot_check.wait(np, slots, held, lambda: slot_check.available(sc),
                             lambda now: slot_check.on_their_way(sc, now), slot_check.bound(session), stop)
    if waited.slots >= np:
        if notes is not None and (note := waited.note()):
            notes.append(note)
        return session
    slots = waited.slots
    if held:
        raise LaunchError(
            f"--np {np} needs {np} free barrier task slots at once, and the warm ranks of a session hold "
            f"{held} of this Spark cluster's {slots + held} ({waited.reason(np)}): run the cell on the session "
            "(leave out --np), stop the session (%horovod stop), or use local mode (--np -N).")
    conf = sc.getConf()
    gpus = conf.get("spark.task.resource.gpu.amount", None)
    per_task = f"{conf.get('spark.task.cpus', '1')} core(s)" + (f" and {gpus} GPU(s)" if gpus else "")
    raise LaunchError(
        f"--np {np} needs {np} barrier task slots at once, but this Spark cluster offers {slots} "
        f"(master {sc.master}, {per_task} per task), {waited.reason(np)}. Spark would retry silently for "
        f"minutes, so hvdmagic stops here: use a smaller --np, add executors or cores, "
        f"or run on the driver in local mode with --np -{np}."
    )


class SparkBackend(Backend):
    name = "spark"

    def __init__(self, np: int, session=None, data=None, on_stage: Callable[[Stage], None] = lambda stage: None,
                 gpus: bool = False, elastic_start: int | None = None):
        self.np = np
        # Elastic (elastic_start given): a plain stage of np tasks, of which elastic_start need
        # slots for training to begin; the rest start as slots free up (launch.elastic).
        self.elastic_start = elastic_start
        self.data = data
        self.on_stage = on_stage
        self.notes: list[str] = []  # for the run's record, e.g. that a broken embedded session was replaced
        if spark_session.embedded_starting():  # a stopped cell's session is still starting: this cell waits for it
            on_stage(Stage.SPARK_STARTING)
        self.session = session or (data.sparkSession if data is not None else None)
        if self.session is None:
            stop = threading.Event()
            try:
                self.session = on_spark_thread(session_for, elastic_start or np, on_stage, self.notes, np, stop)
            except KeyboardInterrupt:
                stop.set()  # a slot check left waiting would hold up every later cell's Spark calls
                raise
            # A session hvdmagic started on its Spark thread becomes the notebook's active one too.
            if note := spark_session.make_active_here(self.session):
                self.notes.append(note)
        self.sc = self.session.sparkContext
        self.bind_host, self.master, task_gpus = on_spark_thread(lambda: (
            self.sc.getConf().get("spark.driver.host", "127.0.0.1"), self.sc.master,
            self.sc.getConf().get("spark.task.resource.gpu.amount", None)))
        if gpus and not task_gpus:
            raise LaunchError("a GPU per process was asked for (use_gpu=True), but this Spark session gives its "
                              "tasks none: set spark.task.resource.gpu.amount (and the executors' GPU "
                              "resources, docs/clusters.md), or pass use_gpu=False.")
        self.job_group = f"hvdmagic-{uuid.uuid4().hex[:12]}"
        self._thread = None
        self._error: str | None = None
        self.failure_details = ""  # the whole Spark error behind failure(), Java trace included

    def describe(self) -> str:
        kind = "stage" if self.elastic_start else "barrier stage"
        return f"Spark {kind} of {self.np} tasks, job group {self.job_group} on {self.master}"

    def start(self, spec: TaskSpec) -> None:
        self.on_stage(Stage.SUBMITTED)
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
            self.sc.setJobGroup(self.job_group, f"hvdmagic %%horovod --np {self.np}", interruptOnCancel=True)
            if self.elastic_start:
                self.sc.parallelize(range(self.np), self.np).mapPartitions(elastic_task(spec)).collect()
            elif self.data is None:
                self.sc.parallelize(range(self.np), self.np).barrier().mapPartitions(barrier_task(spec)).collect()
            else:
                from pyspark.sql.pandas.types import to_arrow_schema

                task = sharded_barrier_task(spec, to_arrow_schema(self.data.schema))
                # repartition(np) is round-robin: the shards differ by a few rows at most.
                self.data.repartition(self.np).mapInArrow(task, "task int, code int", barrier=True).collect()
        except Exception as exc:
            self.failure_details = str(exc)
            kind = "stage" if self.elastic_start else "barrier stage"
            self._error = (f"the Spark {kind} failed: {first_line(exc)} (the whole error is in "
                           "hvdmagic.last_run().error.details)")

    def failure(self) -> str | None:
        return self._error

    def cancel(self) -> None:
        try:
            on_spark_thread(self.sc.cancelJobGroup, self.job_group)
        except Exception:
            pass  # the context may already be stopped; nothing is left to cancel then

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
