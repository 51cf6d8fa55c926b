"""The Spark side: find or start a session, check its slots (launch.slots), run one barrier stage.

Every call into the JVM that hvdmagic makes for the kernel runs on one thread of
its own (``on_spark_thread``), never on the kernel's main thread. Ctrl-C (the
notebook's Stop) raises KeyboardInterrupt in the main thread; had it landed inside
a Py4J call there, the call's half-read answer would be left on its connection, and
pyspark's own SIGINT handler would make a second, reentrant call on it
(``cancelAllJobs``): the gateway, and sometimes the JVM, broke for the rest of the
kernel's life. On its own thread a call always finishes; the main thread only
waits for it, and an interrupted wait leaves it to finish in the background. One
thread, not one per call, because in pinned-thread mode every Python thread that
calls the JVM holds a connection of its own.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hvdmagic.errors import LaunchError
from hvdmagic.launch import slots as slot_check
from hvdmagic.protocol import Stage, TaskSpec
from hvdmagic.task.barrier import barrier_task, elastic_task, sharded_barrier_task

_LOG4J = Path(__file__).with_name("log4j2.properties")
_embedded = None  # the session hvdmagic started itself, which it may resize or replace
_spark_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hvdmagic-spark")
held_slots: dict[object, int] = {}  # by session: the barrier slots its warm ranks occupy while it runs
_starting = threading.Event()  # the Spark thread is starting an embedded session (maybe for a cell that was stopped)


def on_spark_thread(fn: Callable, *args):
    """``fn(*args)`` on hvdmagic's Spark thread; the main thread only waits (see the module doc)."""
    return _spark_thread.submit(fn, *args).result()


def jvm_log() -> Path:
    """Where the embedded Spark's JVM writes its own output: never into a cell."""
    return Path(tempfile.gettempdir()) / f"hvdmagic-spark-{os.getpid()}.log"


@contextlib.contextmanager
def _jvm_output_to_log():
    """Point this process's stdout and stderr at jvm_log() while the JVM is started.

    The JVM inherits them, so its start-up notices ("Using incubator modules",
    "Setting default log level") and its later chatter stay out of the notebook,
    where the kernel would show them as a red block. Python's own sys.stdout is
    the kernel's stream, not fd 1, so prints are unaffected.
    """
    saved = [os.dup(1), os.dup(2)]
    log = os.open(jvm_log(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (log, *saved):
            os.close(fd)


def _java_check() -> None:
    from shutil import which

    if not (os.environ.get("JAVA_HOME") or which("java")):
        raise LaunchError(
            "Spark needs Java 17 or newer, and no 'java' was found on PATH (JAVA_HOME is not set either). "
            "Install it, e.g. 'apt-get install -y openjdk-17-jre-headless', or run the set-up command "
            "from the README; or use local mode (--np -N), which needs no Spark."
        )


def _start_embedded(slots: int):
    from pyspark.sql import SparkSession

    _java_check()
    # Spark binds to the machine's external-looking address unless told otherwise;
    # an embedded session serves only this kernel, so loopback is the right place.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    _starting.set()
    try:
        with _jvm_output_to_log():
            session = (
                SparkSession.builder.master(f"local[{slots}]")
                .appName("hvdmagic")
                .config("spark.driver.host", "127.0.0.1")
                .config("spark.driver.bindAddress", "127.0.0.1")
                .config("spark.ui.showConsoleProgress", "false")
                .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={_LOG4J}")
                .getOrCreate()
            )
    except Exception as exc:
        raise LaunchError(f"could not start an embedded local Spark session: {first_line(exc)} "
                          f"(the JVM's own output is in {jvm_log()})", details=str(exc)) from None
    finally:
        _starting.clear()
    session.sparkContext.setLogLevel("ERROR")
    return session


def _unusable(session) -> str | None:
    """Why ``session`` cannot run a job (its context stopped, its JVM gone), or None."""
    try:
        if session.sparkContext._jsc.sc().isStopped():
            return "its SparkContext was stopped"
    except Exception as exc:  # Py4JError, ConnectionRefusedError: the gateway or the JVM is gone
        return first_line(exc)
    return None


def _forget_embedded() -> None:
    """Drop a broken embedded session so that a new one can start in this kernel."""
    global _embedded
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    gateway = SparkContext._gateway
    with contextlib.suppress(Exception):
        _embedded.stop()
    with contextlib.suppress(Exception):
        gateway.shutdown()
    proc = getattr(gateway, "proc", None)
    if proc is not None and proc.poll() is None:
        proc.kill()
    SparkContext._active_spark_context = SparkContext._gateway = SparkContext._jvm = None
    SparkSession._instantiatedSession = SparkSession._activeSession = None
    _embedded = None


def session_for(np: int, on_stage: Callable[[Stage], None] = lambda stage: None,
                notes: list[str] | None = None, embedded_slots: int | None = None,
                stop: threading.Event | None = None):
    """The active SparkSession, or an embedded local one with at least ``np`` slots
    (``embedded_slots`` when hvdmagic starts it: an elastic job's --max-np).

    Runs on the Spark thread. An embedded session that broke (its JVM died) is
    replaced by a new one, and ``notes`` says so; a broken session of the user's
    own is an error, since it may hold their state. Too few slots wait for those on
    their way (launch.slots) until ``stop`` is set.
    """
    global _embedded
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    if session is None and SparkContext._active_spark_context is not None:
        session = SparkSession.builder.getOrCreate()
    if session is not None and (problem := _unusable(session)):
        if session is not _embedded:
            raise LaunchError(f"the active SparkSession cannot run a job ({problem}). Stop it with spark.stop() "
                              "and create a new one, or restart the kernel; or use local mode (--np -N).")
        _forget_embedded()
        session = None
        if notes is not None:
            notes.append(f"the embedded Spark session was unusable ({problem}); hvdmagic started a new one")
    if session is None:
        on_stage(Stage.SPARK_STARTING)
        _embedded = _start_embedded(max(np, embedded_slots or 0, os.cpu_count() or 1))
        return _embedded
    sc = session.sparkContext
    held = sum(held_slots.values())
    slots = slot_check.available(sc) - held
    if slots < np and session is _embedded and not held:  # a session's stage runs there: keep it
        on_stage(Stage.SPARK_STARTING)
        session.stop()
        _embedded = _start_embedded(max(np, embedded_slots or 0))
        return _embedded
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


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(:.*)?$")


def first_line(exc: BaseException) -> str:
    """The useful line of a Spark/Py4J error, without the Java stack."""
    text = str(exc)
    python_tb = text.rfind("Traceback (most recent call last)")
    if python_tb >= 0:
        tail = text[python_tb:].split("\n\tat ")[0]
        lines = [line.strip() for line in tail.splitlines() if line.strip()]
        errors = [line for line in lines if _EXCEPTION_LINE.match(line)]
        if errors or lines:
            line = (errors or lines)[-1]
            if re.search(r"No module named '(hvdmagic|horovod|torch|pyarrow)\b", line):
                line += (f" on the executors: their Python ({os.environ.get('PYSPARK_PYTHON', 'python3')}, "
                         "set by PYSPARK_PYTHON before the session starts) needs hvdmagic, horovod, torch and "
                         "pyarrow installed; on one machine, set PYSPARK_PYTHON to this kernel's Python "
                         f"({sys.executable}); see docs/clusters.md")
            return line
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:500]
    return type(exc).__name__


class SparkBackend:
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
        if _starting.is_set():  # a stopped cell's session is still starting: this cell waits for it
            on_stage(Stage.SPARK_STARTING)
        self.session = session or (data.sparkSession if data is not None else None)
        if self.session is None:
            stop = threading.Event()
            try:
                self.session = on_spark_thread(session_for, elastic_start or np, on_stage, self.notes, np, stop)
            except KeyboardInterrupt:
                stop.set()  # a slot check left waiting would hold up every later cell's Spark calls
                raise
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
