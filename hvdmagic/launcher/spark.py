"""The Spark side: find or start a session, check slots, run one barrier stage."""

from __future__ import annotations

import os
import re
import sys
import uuid
from pathlib import Path

from hvdmagic.errors import LaunchError
from hvdmagic.launcher.supervisor import TaskSpec, run_task

_LOG4J = Path(__file__).with_name("log4j2.properties")
_embedded = None  # the session hvdmagic started itself, which it may resize


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
    try:
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
        raise LaunchError(f"could not start an embedded local Spark session: {first_line(exc)}") from None
    session.sparkContext.setLogLevel("ERROR")
    return session


def available_slots(sc) -> int:
    """Barrier task slots the cluster offers right now."""
    master = sc.master
    if master == "local":
        return 1
    local = re.fullmatch(r"local\[(\*|\d+)(?:,\s*\d+)?\]", master)
    if local:
        return (os.cpu_count() or 1) if local.group(1) == "*" else int(local.group(1))
    task_cpus = int(sc.getConf().get("spark.task.cpus", "1"))
    return sc.defaultParallelism // max(1, task_cpus)


def session_for(np: int):
    """The active SparkSession, or an embedded local one with at least ``np`` slots."""
    global _embedded
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    session = SparkSession.getActiveSession()
    if session is None and SparkContext._active_spark_context is not None:
        session = SparkSession.builder.getOrCreate()
    if session is None:
        _embedded = _start_embedded(max(np, os.cpu_count() or 1))
        return _embedded
    slots = available_slots(session.sparkContext)
    if slots < np:
        if session is _embedded:
            session.stop()
            _embedded = _start_embedded(np)
            return _embedded
        raise LaunchError(
            f"--np {np} needs {np} barrier task slots at once, but this Spark cluster offers {slots} "
            f"(master {session.sparkContext.master}). Use a smaller --np, add executors or cores, "
            f"or run on the driver in local mode with --np -{np}."
        )
    return session


def first_line(exc: BaseException) -> str:
    """The useful line of a Spark/Py4J error, without the Java stack."""
    text = str(exc)
    python_tb = text.rfind("Traceback (most recent call last)")
    if python_tb >= 0:
        tail = text[python_tb:].split("\n\tat ")[0]
        lines = [line for line in tail.splitlines() if line.strip()]
        if lines:
            return lines[-1].strip()
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:500]
    return type(exc).__name__


def _barrier_task(spec: TaskSpec):
    def task(_partition):
        from pyspark import BarrierTaskContext

        context = BarrierTaskContext.get()
        code = run_task(spec, context.partitionId(), lambda host: context.allGather(host))
        yield context.partitionId(), code

    return task


class SparkBackend:
    name = "spark"

    def __init__(self, np: int, session=None):
        self.np = np
        self.session = session or session_for(np)
        self.sc = self.session.sparkContext
        self.bind_host = self.sc.getConf().get("spark.driver.host", "127.0.0.1")
        self.job_group = f"hvdmagic-{uuid.uuid4().hex[:12]}"
        self._thread = None
        self._error: str | None = None

    def describe(self) -> str:
        return f"Spark barrier stage of {self.np} tasks, job group {self.job_group} on {self.sc.master}"

    def start(self, spec: TaskSpec) -> None:
        from pyspark import InheritableThread

        # InheritableThread releases its py4j connection when it ends: plain threads
        # would leave one behind per cell in pinned-thread mode.
        self._thread = InheritableThread(target=self._run, args=(spec,), name="hvdmagic-spark-job", daemon=True)
        self._thread.start()

    def _run(self, spec: TaskSpec) -> None:
        try:
            self.sc.setJobGroup(self.job_group, f"hvdmagic %%horovod --np {self.np}", interruptOnCancel=True)
            self.sc.parallelize(range(self.np), self.np).barrier().mapPartitions(_barrier_task(spec)).collect()
        except Exception as exc:
            self._error = f"the Spark barrier stage failed: {first_line(exc)}"

    def failure(self) -> str | None:
        return self._error

    def cancel(self) -> None:
        try:
            self.sc.cancelJobGroup(self.job_group)
        except Exception:
            pass  # the context may already be stopped; nothing is left to cancel then

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
