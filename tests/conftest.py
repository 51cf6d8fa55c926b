"""Shared fixtures: a real IPython shell with hvdmagic loaded, on real local Spark."""

from __future__ import annotations

import os

import pytest
from helpers import kernel, kernel_factory  # noqa: F401 (fixtures: a real Jupyter kernel, for every module)

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

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
}


def pytest_configure(config):
    for tier, meaning in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: {meaning}")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker("notebook")
        tiers = [tier for tier in TIERS if item.get_closest_marker(tier)]
        if len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked for several tiers: {', '.join(tiers)}")
        if not tiers:
            item.add_marker("integration")


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

