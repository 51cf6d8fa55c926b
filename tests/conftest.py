"""Shared fixtures: a real IPython shell with hvdmagic loaded, on real local Spark; ``spark_kind``
runs a test once on a classic session and once on a Spark Connect one."""

from __future__ import annotations

import gc
import os
import tempfile
from dataclasses import dataclass, field

import pytest
from connect_server import ConnectServer, missing_server
from helpers import kernel, kernel_factory  # noqa: F401 (fixtures: a real Jupyter kernel, for every module)
from procs import TEST_PROCESS_ENV, own_temp_dir, rank_processes
from s3_server import s3_bucket, s3_endpoint  # noqa: F401 (fixtures: moto's S3 server on loopback)

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

# Each test process (pytest-xdist's worker, or the only one) is on its own beside the others: its temp
# directory (the hosts' rank templates, blob caches and sockets live under it) and a tag that every
# process it starts inherits (ranks, Spark's JVMs and workers, mpirun's daemons), by which the tests
# count only their own processes.
TEST_PROCESS = f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}"
os.environ[TEST_PROCESS_ENV] = TEST_PROCESS
# pytest's own tmp_path stays where it was (each pytest-xdist worker has its own there already): a
# longer path would push the AF_UNIX sockets some tests make under tmp_path past their 107 bytes.
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
os.environ["TMPDIR"] = own_temp_dir(TEST_PROCESS)
tempfile.tempdir = None  # gettempdir() reads TMPDIR again

# CI's machine can run every test: there, .ci/run sets this and a skip is a failure.
FAIL_ON_SKIP = os.environ.get("HVDMAGIC_FAIL_ON_SKIP") == "1"


# Every test is in exactly one tier; `pytest -m unit` (make test-fast) runs the first in seconds.
# A test module says its tier with `pytestmark`, a test with its own mark; the rest are integration.
TIERS = {
    "unit": "no Spark, no rank process, no kernel: the whole tier runs in seconds",
    "integration": "a real IPython shell or Jupyter kernel, with local ranks or embedded local Spark",
    "cluster": "a standalone Spark cluster on 127.0.0.1, or hosts in network namespaces",
    "browser": "JupyterLab in headless chromium",
    "notebook": "the example notebooks, executed by nbval",
    "gpu": "an NVIDIA GPU and a CUDA torch (tests/test_gpu.py); left out, with a line saying so, where there is none",
}


def _has_gpu() -> bool:
    """Whether an NVIDIA driver sees a device here (cheap: no CUDA is initialised)."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


# Not a tier: the tests each runtime profile runs as well (`make test-profiles`, scripts/profiles.py).
PROFILE_MARK = ("profile: also run in every runtime profile's virtualenv (make test-profiles): the paths a "
                "runtime's versions of pyspark, ipywidgets, IPython, cloudpickle, torch and TensorFlow reach")


def pytest_configure(config):
    for tier, meaning in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: {meaning}")
    config.addinivalue_line("markers", PROFILE_MARK)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker("notebook")
        tiers = [tier for tier in TIERS if item.get_closest_marker(tier)]
        if len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked for several tiers: {', '.join(tiers)}")
        if not tiers:
            item.add_marker("integration")
    # A machine without a GPU cannot run the gpu tier: it is deselected, not skipped (CI's machine
    # has none, and a skip fails CI there), and the terminal summary says how many were left out.
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_tests and not _has_gpu():
        config.hook.pytest_deselected(items=gpu_tests)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]
        config._hvdmagic_gpu_left_out = len(gpu_tests)
        if hasattr(config, "workeroutput"):  # a pytest-xdist worker: its controller writes the summary
            config.workeroutput["hvdmagic_gpu_left_out"] = len(gpu_tests)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller (make test runs two workers): every worker collects every test, so each
    says the same number left out."""
    left_out = getattr(node, "workeroutput", {}).get("hvdmagic_gpu_left_out", 0)
    node.config._hvdmagic_gpu_left_out = max(getattr(node.config, "_hvdmagic_gpu_left_out", 0), left_out)


def pytest_terminal_summary(terminalreporter, config):
    if left_out := getattr(config, "_hvdmagic_gpu_left_out", 0):
        terminalreporter.write_line(f"{left_out} gpu-tier test(s) left out: no NVIDIA GPU on this machine "
                                    "(tests/test_gpu.py; docs/diagnostics.md says where they last ran)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if FAIL_ON_SKIP and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, and HVDMAGIC_FAIL_ON_SKIP=1 forbids skips on this machine: {reason}"


@pytest.fixture(scope="session")
def shell():
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "hvdmagic")
    return ip


@pytest.fixture
def ip(shell):
    """The shell with a clean user namespace for each test."""
    saved = dict(shell.user_ns)
    yield shell
    shell.user_ns.clear()
    shell.user_ns.update(saved)


def run(ip, cell: str):
    """Run a cell; return (result, error) like a notebook user would see them."""
    outcome = ip.run_cell(cell)
    return outcome.result, outcome.error_in_exec


# -- the same test on a classic and on a Spark Connect session -------------------------------------
CONNECT_SERVER_START = 120  # seconds the Connect server gets to listen: a JVM on a busy 2-core machine
CONNECT_CORES = 4  # the server's local[N]: as many slots as test_connect.py's server has


@dataclass
class SparkKind:
    """The session kind a ``spark_kind`` test runs on: ``name`` is "classic" or "connect"; ``mode`` is
    what a run on it records (``last_run().mode``) and its header shows in parentheses."""

    name: str
    mode: str
    server: ConnectServer | None = None  # connect: the server whose JVM the tasks and ranks descend from
    connect_session: object = None
    runs: list = field(default_factory=list)  # every run record the test made, in order
    makes_runs: bool = True  # False: a test of Spark alone (a transform), which starts no ranks

    @property
    def session(self):
        """The SparkSession of this kind for a test's own use (a DataFrame for --data): the Connect
        session, or the classic one hvdmagic runs on (started here if no cell has started it yet)."""
        if self.connect_session is not None:
            return self.connect_session
        from hvdmagic.launch.spark import session_for
        from hvdmagic.launch.spark_session import on_spark_thread

        return on_spark_thread(session_for, 2)

    def ranks(self) -> list:
        """The rank processes running now: a classic session's descend from this process, a Connect
        server's from its JVM."""
        return rank_processes(self.server.proc.pid if self.server else None)


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory):
    """One real Spark Connect server for the whole test session, started by the first test that asks."""
    if reason := missing_server():  # a runtime profile with pyspark 3.5; never the main lock (CI fails a skip)
        pytest.skip(reason)
    server = ConnectServer(tmp_path_factory.mktemp("spark-kind-connect"), master=f"local[{CONNECT_CORES}]")
    server.wait_listening(CONNECT_SERVER_START)
    yield server
    server.stop()


@pytest.fixture(params=["classic", "connect"])
def spark_kind(request, monkeypatch):
    """Run the test on a classic session (hvdmagic's embedded one) and again on a Spark Connect session.

    connect: a client session to ``connect_server`` becomes the process's default and active Connect
    session, and the process is in Connect mode (SPARK_CONNECT_MODE_ENABLED, as ``remote()`` leaves
    it), as in a notebook that made ``SparkSession.builder.remote("sc://...")``. The embedded classic
    session, if one runs, runs on beside it: hvdmagic must take the Connect one (``launch.spark``
    asks ``spark_connect.active_session`` first). Afterwards the Connect session is stopped, which
    clears both, and Connect mode is left. Either way the test must have made a run, and every run
    on Spark must have run on this kind: its record's mode, which the header shows, says so.
    A test that crosses this with a local-mode parameter names its kinds with indirect parametrization.
    """
    from hvdmagic.kernel import runner
    from hvdmagic.launch import spark_connect

    assert spark_connect.active_session() is None and not spark_connect.remote_mode(), \
        "a Spark Connect session was left active by an earlier test: every test would run on it"
    kind = SparkKind(request.param, {"classic": "spark", "connect": "spark connect"}[request.param])
    if kind.name == "connect":
        from pyspark.sql.connect.session import SparkSession as ConnectSession

        kind.server = request.getfixturevalue("connect_server")
        # pyspark's own builder refuses remote() beside a classic SparkContext (SESSION_ALREADY_EXIST);
        # Connect's builder makes the same client session, without looking at the classic side.
        monkeypatch.setenv("SPARK_CONNECT_MODE_ENABLED", "1")
        kind.connect_session = ConnectSession.builder.remote(kind.server.url).getOrCreate()
    set_last = runner.set_last

    def recording(record):
        kind.runs.append(record)
        set_last(record)

    monkeypatch.setattr(runner, "set_last", recording)
    try:
        yield kind
    finally:
        if kind.connect_session is not None:
            kind.connect_session.stop()
            # pyspark 4.0's Connect session closes its client again in __del__. Run by the garbage collector
            # inside a later test's ThreadPoolExecutor.submit in Connect's client, that close waits for the
            # lock the submit holds, for ever (seen on Databricks 17.3's pyspark 4.0.0): collect it here.
            kind.connect_session = None
            gc.collect()
    assert kind.runs or not kind.makes_runs, f"the test ran nothing on its {kind.name} session"
    on_spark = [record.mode for record in kind.runs if record.mode != "local"]
    assert all(mode == kind.mode for mode in on_spark), \
        f"a {kind.name} test ran on another kind of session: the runs' modes were {on_spark}"
