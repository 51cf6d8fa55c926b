"""The Spark side: find or start a session, check slots, run one barrier stage."""

from __future__ import annotations

import os
import re
import sys
import time
import uuid
from pathlib import Path

from hvdmagic.errors import LaunchError
from hvdmagic.protocol import TaskSpec
from hvdmagic.task.barrier import barrier_task, sharded_barrier_task

_LOG4J = Path(__file__).with_name("log4j2.properties")
SLOT_WAIT = 3.0  # seconds without new executors before too few slots is final
EXECUTOR_WAIT = 60.0  # seconds a session with no executor yet gets for its first ones
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
    """Barrier task slots the cluster offers right now.

    Spark's own count (the one its barrier check uses) covers executor cores,
    spark.task.cpus and GPU amounts; the fallback counts cores only.
    """
    try:
        jsc = sc._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:
        pass
    master = sc.master
    if master == "local":
        return 1
    local = re.fullmatch(r"local\[(\*|\d+)(?:,\s*\d+)?\]", master)
    if local:
        return (os.cpu_count() or 1) if local.group(1) == "*" else int(local.group(1))
    task_cpus = int(sc.getConf().get("spark.task.cpus", "1"))
    return sc.defaultParallelism // max(1, task_cpus)


def _wait_for_executors(sc, np: int, slots: int) -> int:
    """Give a new session's executors time to register before judging the slot count.

    With no executor at all we wait up to EXECUTOR_WAIT for the first ones; once
    some are there, we wait SLOT_WAIT after the count last grew. A cluster that is
    simply too small is therefore reported within seconds.
    """
    start = changed = time.monotonic()
    while slots < np:
        now = time.monotonic()
        if (slots == 0 and now - start > EXECUTOR_WAIT) or (slots > 0 and now - changed > SLOT_WAIT):
            break
        time.sleep(0.25)
        current = available_slots(sc)
        if current != slots:
            slots, changed = current, time.monotonic()
    return slots


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
    sc = session.sparkContext
    slots = available_slots(sc)
    if slots < np and session is _embedded:
        session.stop()
        _embedded = _start_embedded(np)
        return _embedded
    slots = _wait_for_executors(sc, np, slots)
    if slots < np:
        conf = sc.getConf()
        gpus = conf.get("spark.task.resource.gpu.amount", None)
        per_task = f"{conf.get('spark.task.cpus', '1')} core(s)" + (f" and {gpus} GPU(s)" if gpus else "")
        raise LaunchError(
            f"--np {np} needs {np} barrier task slots at once, but this Spark cluster offers {slots} "
            f"(master {sc.master}, {per_task} per task). Spark would retry silently for minutes, so "
            f"hvdmagic stops here: use a smaller --np, add executors or cores, "
            f"or run on the driver in local mode with --np -{np}."
        )
    return session


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

    def __init__(self, np: int, session=None, data=None):
        self.np = np
        self.data = data
        self.session = session or (data.sparkSession if data is not None else None) or session_for(np)
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
            if self.data is None:
                self.sc.parallelize(range(self.np), self.np).barrier().mapPartitions(barrier_task(spec)).collect()
            else:
                from pyspark.sql.pandas.types import to_arrow_schema

                task = sharded_barrier_task(spec, to_arrow_schema(self.data.schema))
                # repartition(np) is round-robin: the shards differ by a few rows at most.
                self.data.repartition(self.np).mapInArrow(task, "task int, code int", barrier=True).collect()
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
