"""The kernel's SparkSession: find the active one, start an embedded local one, replace one that broke.

Runs in the kernel, for the Spark backend (``launch.spark``), which asks it for a
session and then checks that session's slots. Here live what only a classic
session with a JVM behind it needs: the Java check, the JVM's own output kept out
of the cells (``jvm_log``; on a user's session, its log of hvdmagic's failed tasks:
``quiet_task_logs``), Spark's error reduced to one line (``first_line``) and
the one thread that talks to the JVM. A Spark Connect session has no JVM in the
kernel and needs none of it. Imports pyspark lazily, ``hvdmagic.errors`` and
``hvdmagic.protocol``; nothing else of hvdmagic.

Every call into the JVM that hvdmagic makes for the kernel runs on one thread of
its own (``on_spark_thread``), never on the kernel's main thread. Ctrl-C (the
notebook's Stop) raises KeyboardInterrupt in the main thread; had it landed inside
a Py4J call there, the call's half-read answer would be left on its connection, and
pyspark's own SIGINT handler would make a second, reentrant call on it
(``cancelAllJobs``): the gateway, and sometimes the JVM, broke for the rest of the
kernel's life. On its own thread a call always finishes; the main thread only
waits for it, and an interrupted wait leaves it to finish in the background. One
thread, not one per call, because in pinned-thread mode every Python thread that
calls the JVM holds a connection of its own. The functions below that call the JVM
expect to run on it, but ``make_active_here``, which must run on the notebook's thread.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hvdmagic.errors import LaunchError
from hvdmagic.launch import spark_connect
from hvdmagic.protocol import Stage

_LOG4J = Path(__file__).with_name("log4j2.properties")
_embedded = None  # the session hvdmagic started itself, which it may resize or replace
_spark_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hvdmagic-spark")
_starting = threading.Event()  # the Spark thread is starting an embedded session (maybe for a cell that was stopped)
_shown = None  # the embedded session that make_active_here last made the notebook's own


def on_spark_thread(fn: Callable, *args):
    """``fn(*args)`` on hvdmagic's Spark thread; the main thread only waits (see the module doc)."""
    return _spark_thread.submit(fn, *args).result()


def embedded_starting() -> bool:
    """Whether the Spark thread is starting an embedded session, maybe for a cell that was stopped."""
    return _starting.is_set()


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


# Spark's loggers that report a failed or killed task of hvdmagic's stage, each time with the
# Java stack behind it: on a session of the user's own, whose JVM writes into the cell, some
# 130 lines above hvdmagic's one paragraph. The stage's whole error, that stack included, is
# in hvdmagic.last_run().error.details.
TASK_FAILURE_LOGGERS = (
    "org.apache.spark.executor.Executor",  # local mode: "Exception in task ...", with the stack
    "org.apache.spark.scheduler.TaskSetManager",  # "Lost task ...", the same stack again; "aborting job"
    "org.apache.spark.scheduler.DAGScheduler",  # "Failed to cancel job group" once hvdmagic cancels a failed stage
    "org.apache.spark.api.python.PythonRunner",  # "Incomplete task ... interrupted" for each task a cancel kills
)


class _QuietTaskLogs:
    """TASK_FAILURE_LOGGERS turned off, and Spark's console progress bar silenced, in one JVM while
    any of hvdmagic's stages runs there.

    Counted, because a warm session's stage and a cell's may overlap: the first stage turns
    them off, the last one to end restores them as they were, and only those loggers. Each
    logger's own level is restored, and a logger that had none (it followed the root level,
    which ``sc.setLogLevel`` sets) gets none again, so the user's later ``setLogLevel`` still
    reaches it. Used on the Spark thread only, one call at a time: no lock.
    """

    def __init__(self):
        self.holders = 0
        self.jvm = None
        self.saved: dict[str, object] = {}  # logger name: its own level before, None where it had none
        self.progress_console = None  # (the bar, its console field, its own stream) while the bar is silenced

    def quiet(self, sc) -> None:
        jvm = sc._jvm
        if self.holders and jvm is not self.jvm:  # a new JVM (the last one died): nothing to restore in the old
            self.holders, self.saved, self.progress_console = 0, {}, None
        self.holders += 1
        if self.holders > 1:
            return
        self.jvm = jvm
        self._silence_progress_bar(sc)
        log4j = jvm.org.apache.logging.log4j
        try:
            context = log4j.LogManager.getContext(False)
            config = context.getConfiguration()
            for name in TASK_FAILURE_LOGGERS:
                own = config.getLoggers().get(name)
                self.saved[name] = None if own is None else own.getLevel()
                if own is None:
                    config.addLogger(name, log4j.core.config.LoggerConfig(name, log4j.Level.OFF, True))
                else:
                    own.setLevel(log4j.Level.OFF)
            context.updateLoggers()
        except Exception:  # not log4j 2 (or not reachable): Spark's lines reach the cell as before
            pass

    def _silence_progress_bar(self, sc) -> None:
        """Spark's console progress bar (on in any session pyspark starts, spark.ui.showConsoleProgress)
        writes "[Stage 5:>   (0 + 2) / 2]" to the JVM's stderr, the kernel's: the cell keeps it as a red
        box, blank once Spark clears the line. hvdmagic's dashboard shows its own stages, so the bar's
        stream (its ``console`` field, Spark 4's) becomes a null stream until the last stage ends.
        Where the bar or that field is missing, nothing changes."""
        try:
            bar = sc._jsc.sc().progressBar()
            if not bar.isDefined():
                return
            bar = bar.get()
            field = bar.getClass().getDeclaredField("console")
            field.setAccessible(True)
            own = field.get(bar)
            field.set(bar, self.jvm.java.io.PrintStream(self.jvm.java.io.OutputStream.nullOutputStream()))
            self.progress_console = (bar, field, own)
        except Exception:  # no such field (an older Spark), or no bar: as before
            pass

    def restore(self) -> None:
        if not self.holders:
            return
        self.holders -= 1
        if self.holders:
            return
        saved, self.saved = self.saved, {}
        progress_console, self.progress_console = self.progress_console, None
        with contextlib.suppress(Exception):  # the JVM may be gone, and its loggers with it
            if progress_console is not None:
                bar, field, own = progress_console
                field.set(bar, own)
            context = self.jvm.org.apache.logging.log4j.LogManager.getContext(False)
            config = context.getConfiguration()
            for name, level in saved.items():
                if level is None:
                    config.removeLogger(name)
                elif (own := config.getLoggers().get(name)) is not None:
                    own.setLevel(level)
            context.updateLoggers()


_quiet_task_logs = _QuietTaskLogs()


def quiet_task_logs(sc) -> None:
    """Keep Spark's log of failed and killed tasks (TASK_FAILURE_LOGGERS) and its console progress
    bar out of the cell while hvdmagic's stage runs on ``sc``, until ``restore_task_logs``. Only a
    session of the user's own needs it: the embedded session's JVM writes to ``jvm_log()``, with no
    progress bar. Runs on the Spark thread."""
    _quiet_task_logs.quiet(sc)


def restore_task_logs() -> None:
    """The loggers and the progress bar as ``quiet_task_logs`` found them, once no stage of
    hvdmagic's runs. Runs on the Spark thread."""
    _quiet_task_logs.restore()


@contextlib.contextmanager
def spark_output_quiet(session):
    """``quiet_task_logs`` for the whole of a run that starts Spark jobs of its own before its stage
    (an estimator's fit checks and counts its DataFrame): nothing of Spark's console output in its
    cell. A classic session of the user's own only; the Spark thread's calls are its own."""
    if spark_connect.is_connect(session) or is_embedded(session):
        yield
        return
    on_spark_thread(quiet_task_logs, session.sparkContext)
    try:
        yield
    finally:
        on_spark_thread(restore_task_logs)


def _java_check() -> None:
    from shutil import which

    if not (os.environ.get("JAVA_HOME") or which("java")):
        raise LaunchError(
            "Spark needs Java 17 or newer, and no 'java' was found on PATH (JAVA_HOME is not set either). "
            "Install it, e.g. 'apt-get install -y openjdk-17-jre-headless', or run the set-up command "
            "from the README; or use local mode (--np -N), which needs no Spark."
        )


def users_session():
    """The notebook's session as a launch finds it: its Spark Connect one, else its classic one; None
    when it has neither (a launch would start the embedded one). Imports pyspark only if it is imported."""
    if (connect := spark_connect.active_session()) is not None:
        return connect
    classic = sys.modules.get("pyspark.sql")
    return classic.SparkSession.getActiveSession() if classic is not None else None


def prefer_this_python() -> bool:
    """Make PYSPARK_PYTHON this process's Python where it is unset, no SparkContext runs yet and
    nothing says that the session to come runs on a cluster. A local-mode session's executors
    otherwise start the ``python3`` on PATH: from a virtualenv kernel (or ``.venv/bin/python
    script.py``, not activated) one without pyarrow, torch or hvdmagic, which no error can fix
    without a restart. A cluster's master (``MASTER``, ``--master`` in ``PYSPARK_SUBMIT_ARGS``,
    ``spark.master`` in ``$SPARK_HOME/conf/spark-defaults.conf``) leaves it alone: its workers may
    have no such path. Returns whether it set it. Called by ``%load_ext hvdmagic`` and ``import
    hvdmagic.spark``; imports nothing."""
    if os.environ.get("PYSPARK_PYTHON") or os.environ.get("SPARK_REMOTE") or _master_named_elsewhere():
        return False
    context = getattr(sys.modules.get("pyspark"), "SparkContext", None)
    if context is not None and context._active_spark_context is not None:
        return False  # too late: the executors' Python is fixed (first_line's advice says so if it is wrong)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    return True


def _master_named_elsewhere() -> bool:
    """Whether a non-local master is named outside the notebook's code, where a session would find it."""
    masters = [os.environ.get("MASTER", "")]
    if found := re.search(r"--master[= ](\S+)", os.environ.get("PYSPARK_SUBMIT_ARGS", "")):
        masters.append(found.group(1))
    defaults = Path(os.environ.get("SPARK_CONF_DIR") or Path(os.environ.get("SPARK_HOME", "/nonexistent")) / "conf")
    with contextlib.suppress(OSError):
        for line in (defaults / "spark-defaults.conf").read_text().splitlines():
            if found := re.match(r"\s*spark\.master[\s=]+(\S+)", line):
                masters.append(found.group(1))
    return any(master and not master.startswith("local") for master in masters)


def start_embedded(slots: int, archive_option: str | None = None):
    """A new embedded ``local[slots]`` session; its JVM maps the class-data archive (``jvm_archive``)
    when one has been made, or ``archive_option`` says otherwise."""
    from pyspark.sql import SparkSession

    from hvdmagic.launch import jvm_archive

    _java_check()
    # Spark binds to the machine's external-looking address unless told otherwise;
    # an embedded session serves only this kernel, so loopback is the right place.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    archive_option = jvm_archive.options() if archive_option is None else archive_option
    _starting.set()
    try:
        with _jvm_output_to_log():
            session = (
                SparkSession.builder.master(f"local[{slots}]")
                .appName("hvdmagic")
                .config("spark.driver.host", "127.0.0.1")
                .config("spark.driver.bindAddress", "127.0.0.1")
                .config("spark.ui.showConsoleProgress", "false")
                .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile={_LOG4J} {archive_option} "
                        f"-XX:ErrorFile={jvm_log().with_suffix('')}-crash-%p.log")  # not the notebook's folder
                .getOrCreate()
            )
    except Exception as exc:
        if archive_option.startswith("-XX:SharedArchiveFile="):  # a damaged archive kills the JVM at start
            session = start_embedded(slots, "")
            jvm_archive.forget(archive_option)  # it was the archive: the JVM starts without it
            return session
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


def find_or_start(slots: int, on_stage: Callable[[Stage], None] = lambda stage: None,
                  notes: list[str] | None = None) -> tuple[object, bool]:
    """The active SparkSession, or a new embedded local one with at least ``slots`` slots
    (one per core at the least); and whether it is the new one.

    An embedded session that broke (its JVM died) is replaced by a new one, and
    ``notes`` says so; a broken session of the user's own is an error, since it may
    hold their state.
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
        from hvdmagic.launch import spark_connect

        if spark_connect.remote_mode():  # pyspark would refuse a local session here: CONNECT_URL_NOT_SET
            raise LaunchError(
                "this kernel is in Spark Connect mode (a session was made with SparkSession.builder.remote(...)), "
                "and no Spark Connect session is active now: create one again, e.g. spark = SparkSession.builder"
                ".remote('sc://host:15002').getOrCreate(), and run the cell; or use local mode (--np -N).")
        on_stage(Stage.SPARK_STARTING)
        _embedded = start_embedded(max(slots, os.cpu_count() or 1))
        return _embedded, True
    return session, False


def make_active_here(session) -> str | None:
    """Make an embedded session, once, the active SparkSession of the calling thread too (the
    notebook's: the thread that ran the cell), and return a note that says how to reach it;
    None for any other session, or one already made so.

    pyspark keeps the active session per thread (the JVM's ``SparkSession.setActiveSession``,
    a thread-local), and hvdmagic starts its session on its Spark thread: without this,
    ``SparkSession.getActiveSession()`` in the notebook returns None. This one JVM call runs on
    the calling thread, with Ctrl-C held back until it returns (``_sigint_held``), so that an
    interrupt never lands inside it (the module doc says why that matters).
    """
    global _shown
    if session is None or session is not _embedded or session is _shown:
        return None
    _shown = session
    from pyspark.sql import SparkSession

    with _sigint_held():
        try:
            SparkSession._activeSession = session
            SparkSession._get_j_spark_session_class(session._jvm).setActiveSession(session._jsparkSession)
        except Exception:  # the session still runs the job, and getOrCreate() still finds it
            pass
    return (f"hvdmagic's embedded Spark session ({session.sparkContext.master}) is the notebook's active one "
            "too: spark = SparkSession.builder.getOrCreate()")


@contextlib.contextmanager
def _sigint_held():
    """In the main thread, a Ctrl-C during the block raises KeyboardInterrupt only once it ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


def is_embedded(session) -> bool:
    """Whether hvdmagic started ``session`` itself, and so may replace it; a user's session it never stops."""
    return session is _embedded


def restart_embedded(slots: int, on_stage: Callable[[Stage], None] = lambda stage: None):
    """Stop the embedded session and start one with ``slots`` slots in its place."""
    global _embedded
    on_stage(Stage.SPARK_STARTING)
    _embedded.stop()
    _embedded = start_embedded(slots)
    return _embedded


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
