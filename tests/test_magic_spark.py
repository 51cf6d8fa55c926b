"""%%horovod on real local Spark with real Horovod over Gloo."""

from __future__ import annotations

import re
import sys

import pytest
from conftest import run
from helpers import execute, stop_active_session, users_shell
from procs import rank_processes

from hvdmagic.errors import JobFailed, JobTimeout, LaunchError


@pytest.mark.profile
def test_two_rank_allreduce_and_streamed_output(ip, capfd, spark_kind):
    result, error = run(ip, """%%horovod --np 2
import torch, horovod.torch as hvd
hvd.init()
print(f"ready {hvd.rank()}/{hvd.size()}")
hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
""")
    assert error is None
    assert result == 3.0
    out = capfd.readouterr().out
    assert "[rank 0] ready 0/2" in out
    assert "[rank 1] ready 1/2" in out
    assert f"np=2 ({spark_kind.mode}): finished" in out, out


def test_the_embedded_session_becomes_the_notebooks_active_session(ip, capfd):
    """pyspark keeps the active session per thread, and hvdmagic starts its own on its Spark thread: the
    cell that starts it makes it the notebook's too, and says once how to reach it."""
    import hvdmagic
    from hvdmagic.launch import spark_session

    stop_active_session()  # so that the next cell starts the embedded session
    ip.run_cell("from pyspark.sql import SparkSession")
    assert ip.run_cell("SparkSession.getActiveSession()").result is None
    capfd.readouterr()
    _, error = run(ip, "%%horovod --np 2\n1")
    assert error is None, error
    embedded = spark_session._embedded
    assert embedded is not None, "the cell did not start the embedded session"
    notes = [note for note in hvdmagic.last_run().notes if "SparkSession.builder.getOrCreate()" in note]
    assert len(notes) == 1 and "\n" not in notes[0], hvdmagic.last_run().notes
    assert notes[0] in capfd.readouterr().out
    assert ip.run_cell("SparkSession.getActiveSession()").result is embedded
    assert ip.run_cell("SparkSession.getActiveSession().range(3).count()").result == 3
    _, error = run(ip, "%%horovod --np 2\n1")
    assert error is None and not any("getOrCreate" in note for note in hvdmagic.last_run().notes), "said twice"


@pytest.mark.profile
def test_rank0_result_is_returned_and_stored_with_out(ip, spark_kind):
    result, error = run(ip, """%%horovod --np 2 --out answer
import horovod.torch as hvd
hvd.init()
{"rank": hvd.rank(), "size": hvd.size()}
""")
    assert error is None
    assert result == {"rank": 0, "size": 2}
    assert ip.user_ns["answer"] == {"rank": 0, "size": 2}


@pytest.mark.profile
def test_notebook_function_class_and_array_are_captured(ip, capfd):
    ip.run_cell("""
import numpy as np
weights = np.arange(6, dtype=np.float64).reshape(2, 3)
def scale(x):
    return x * factor
factor = 10
class Accumulator:
    def __init__(self):
        self.total = 0.0
    def add(self, value):
        self.total += value
        return self
""")
    result, error = run(ip, """%%horovod --np 2
import horovod.torch as hvd
hvd.init()
acc = Accumulator().add(scale(weights).sum())
(acc.total, type(acc).__name__)
""")
    assert error is None
    assert result == (150.0, "Accumulator")
    summary = capfd.readouterr().out
    # `factor` is read only by `scale`, so it travels inside the pickled function.
    assert "captured 3 global(s)" in summary
    for name in ("weights (numpy.ndarray", "scale (function", "Accumulator (type"):
        assert name in summary


def test_var_expansion_on_magic_line(ip):
    ip.user_ns["n"] = 2
    result, error = run(ip, "%%horovod --np {n}\nimport horovod.torch as hvd\nhvd.init()\nhvd.size()")
    assert error is None and result == 2


@pytest.mark.profile
def test_rank_raising_while_other_waits_in_allreduce(ip, spark_kind):
    ip.user_ns["answer"] = "untouched"
    _, error = run(ip, """%%horovod --np 2 --out answer
import torch, horovod.torch as hvd
hvd.init()
if hvd.rank() == 1:
    raise ValueError("rank one is broken")
hvd.allreduce(torch.ones(1))
""")
    assert isinstance(error, JobFailed)
    assert [f.rank for f in error.failures][:1] == [1]
    rendered = "\n".join(error._render_traceback_())
    assert "rank 1" in rendered and "ValueError: rank one is broken" in rendered
    assert re.search(r"Cell In\[\d+\], line 5\b", rendered), rendered  # as IPython names the cell
    assert 'raise ValueError("rank one is broken")' in rendered
    assert "hvdmagic/" not in rendered  # no launcher frames
    assert ip.user_ns["answer"] == "untouched"

    # The next cell works.
    result, error = run(ip, "%%horovod --np 2\nimport horovod.torch as hvd\nhvd.init()\nhvd.rank()")
    assert error is None and result == 0


def test_nonzero_exit_names_rank_and_code(ip):
    _, error = run(ip, """%%horovod --np 2
import os
import horovod.torch as hvd
hvd.init()
if hvd.rank() == 0:
    os._exit(3)
""")
    assert isinstance(error, JobFailed)
    assert error.failures[0].rank == 0
    assert "exited with code 3" in str(error)


def test_timeout_stops_every_rank(ip, spark_kind):
    _, error = run(ip, "%%horovod --np 2 --timeout 4\nimport time\ntime.sleep(600)")
    assert isinstance(error, JobTimeout)
    assert "--timeout 4" in str(error)
    assert sorted(error.stopped) == [0, 1]


def test_failure_leaves_no_rank_process_and_no_active_spark_job(ip):
    from pyspark import SparkContext

    _, error = run(ip, """%%horovod --np 2
import time, horovod.torch as hvd
hvd.init()
if hvd.rank() == 0:
    raise RuntimeError("stop")
time.sleep(600)
""")
    assert isinstance(error, JobFailed) and error.stopped == [1]
    assert rank_processes() == [], "rank processes outlived the failed cell"
    tracker = SparkContext._active_spark_context.statusTracker()
    assert tracker.getActiveJobsIds() == [], "the barrier job is still running"


def _log_levels(spark) -> tuple:
    """The JVM's log settings a user may have made: the root level, the loggers that have a level
    of their own, and the level each of Spark's task-failure loggers gets."""
    from hvdmagic.launch.spark_session import TASK_FAILURE_LOGGERS

    log4j = spark.sparkContext._jvm.org.apache.logging.log4j
    config = log4j.LogManager.getContext(False).getConfiguration()
    return (str(config.getRootLogger().getLevel()), sorted(config.getLoggers().keySet()),
            [str(log4j.LogManager.getLogger(name).getLevel()) for name in TASK_FAILURE_LOGGERS])


def test_sparks_task_failure_log_stays_out_of_the_cell_on_the_users_own_session(ip, capfd, tmp_path, monkeypatch):
    """A notebook's own session whose executors' Python lacks hvdmagic: Spark's executor and
    scheduler log each failed task with some 70 Java frames, into the cell. The cell shows
    hvdmagic's paragraph alone; the record keeps the whole error; the user's levels stay theirs."""
    from pyspark.sql import SparkSession

    import hvdmagic
    from hvdmagic.launch import spark_session
    from hvdmagic.launch.spark_session import TASK_FAILURE_LOGGERS, on_spark_thread

    python = tmp_path / "python-without-site-packages"
    # As a bare python3: no site-packages, so no hvdmagic; and, since `-m pyspark.daemon` puts its directory
    # first on sys.path, not in the JVM's directory (maybe the checkout, with its hvdmagic).
    python.write_text(f'#!/bin/sh\ncd "{tmp_path}" && exec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    stop_active_session()  # one SparkContext per process: this test needs one with that Python
    monkeypatch.setenv("PYSPARK_PYTHON", str(python))
    # The console bar on, as in a session pyspark's launcher starts in a fresh kernel (this process's JVM may
    # be one another session started with it off).
    spark = (SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "true").getOrCreate())
    log4j = spark.sparkContext._jvm.org.apache.logging.log4j
    try:
        spark.sparkContext.setLogLevel("WARN")  # the user's choices, which let task failures through
        log4j.core.config.Configurator.setLevel(TASK_FAILURE_LOGGERS[0], log4j.Level.ERROR)
        levels = _log_levels(spark)
        capfd.readouterr()
        _, error = run(ip, "%%horovod --np 2\nprint('never runs')\n")
        out, err = capfd.readouterr()
        assert isinstance(error, LaunchError), error
        assert "No module named 'hvdmagic' on the executors" in str(error) and "PYSPARK_PYTHON" in str(error)
        assert "\tat org.apache.spark" not in out + err and "Exception in task" not in err, err
        assert "No module named 'hvdmagic'" in out + err, "the cell should still say why"
        assert "\tat org.apache.spark" in hvdmagic.last_run().error.details, "the record lost Spark's error"
        assert _log_levels(spark) == levels, "hvdmagic left its own log settings in the user's JVM"
        # No other logger was left with a level of its own: the user's setLogLevel still reaches them.
        spark.sparkContext.setLogLevel("INFO")
        assert _log_levels(spark)[2] == ["ERROR"] + ["INFO"] * (len(TASK_FAILURE_LOGGERS) - 1)
        # Two stages at once (a session's and a cell's): the loggers come back when the last one ends.
        levels = _log_levels(spark)
        on_spark_thread(spark_session.quiet_task_logs, spark.sparkContext)
        on_spark_thread(spark_session.quiet_task_logs, spark.sparkContext)
        on_spark_thread(spark_session.restore_task_logs)
        assert set(_log_levels(spark)[2]) == {"OFF"}, "the stage still running lost its quiet"
        on_spark_thread(spark_session.restore_task_logs)
        assert _log_levels(spark) == levels
        # Spark's console progress bar writes to a null stream while hvdmagic's stage runs, then to its own again.
        bar = spark.sparkContext._jsc.sc().progressBar().get()
        console = bar.getClass().getDeclaredField("console")
        console.setAccessible(True)
        own = console.get(bar)
        on_spark_thread(spark_session.quiet_task_logs, spark.sparkContext)
        assert not console.get(bar).equals(own), "Spark's console bar still writes into the cell"
        on_spark_thread(spark_session.restore_task_logs)
        assert console.get(bar).equals(own), "Spark's console bar was not given its stream back"
    finally:
        # The JVM outlives the session, and later tests' sessions run in it: without the user's choice.
        context = log4j.LogManager.getContext(False)
        context.getConfiguration().removeLogger(TASK_FAILURE_LOGGERS[0])
        context.updateLoggers()
        stop_active_session()


def test_the_users_own_local_session_in_a_virtualenv_kernel_just_works(kernel_factory):
    """A virtualenv's kernel, PYSPARK_PYTHON unset and the virtualenv not on PATH (as Jupyter starts a
    registered kernel): the user's own local session, made after %load_ext, runs a cell, because its
    executors run the kernel's Python (launch.spark_session.prefer_this_python), not PATH's python3,
    which has no pyarrow, torch or hvdmagic."""
    _, client = kernel_factory(PYSPARK_PYTHON=None, PATH=users_shell()["PATH"])
    cells = ["%load_ext hvdmagic",
             "import os\nfrom pyspark.sql import SparkSession\n"
             "spark = (SparkSession.builder.master('local[2]').config('spark.driver.host', '127.0.0.1')\n"
             "         .config('spark.ui.enabled', 'false').getOrCreate())",
             "%%horovod --np 2 --out size\nimport horovod.torch as hvd\nhvd.init()\nhvd.size()",
             "print(size, os.environ['PYSPARK_PYTHON'] == __import__('sys').executable)"]
    for cell in cells:
        reply, texts = execute(client, cell, timeout=240)
        assert reply["status"] == "ok", "".join(texts)[-3000:]
    assert texts[-1] == "2 True\n", texts


def test_output_reaches_the_driver_while_the_job_runs(tmp_path):
    """Rank 0 blocks until the driver has seen its first line: only live streaming lets it finish."""
    from hvdmagic.launch import Placement, launch, shipment

    sentinel = tmp_path / "seen"

    def wait_for_driver():
        import os
        import time
        if os.environ["HOROVOD_RANK"] == "0":
            print("first line", flush=True)
            deadline = time.monotonic() + 60
            while not os.path.exists(sentinel):
                if time.monotonic() > deadline:
                    raise TimeoutError("the driver never saw the first line while the job ran")
                time.sleep(0.05)
        return "done"

    def on_event(event):
        if event.get("type") == "output" and "first line" in event.get("lines", []):
            sentinel.touch()

    result = launch(shipment.pack((wait_for_driver, (), {})), Placement.of(2), on_event=on_event)
    assert result.results == ["done", "done"]


def test_consecutive_cells_share_nothing_but_the_spark_session(ip):
    """Launch reuses the SparkSession only: each cell's ranks are fresh processes."""
    first, error = run(ip, """%%horovod --np 2
import os, sys, horovod.torch as hvd
hvd.init()
os.environ["LEAKED_VAR"] = "1"
os.environ["CUDA_VISIBLE_DEVICES"] = "7"
sys.modules["leaked_module"] = sys
leaked_file = open(os.devnull)
(os.getpid(), hvd.rank())
""")
    assert error is None
    second, error = run(ip, """%%horovod --np 2
import os, sys
(os.getpid(), "LEAKED_VAR" in os.environ, os.environ.get("CUDA_VISIBLE_DEVICES"),
 "leaked_module" in sys.modules, "PYTHONPATH" in os.environ and ".jar" in os.environ["PYTHONPATH"],
 len(os.listdir("/proc/self/fd")))
""")
    assert error is None
    pid, leaked_env, cuda, leaked_module, spark_jar, fds = second
    assert pid != first[0], "the second cell ran in the first cell's rank process"
    assert not leaked_env and cuda is None and not leaked_module
    assert not spark_jar, "a rank inherited the Spark jar on its PYTHONPATH"
    assert fds < 20, f"a fresh rank has {fds} open file descriptors"
