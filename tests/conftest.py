"""Shared fixtures: a real IPython shell with hvdmagic loaded, on real local Spark."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


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
