"""Before any rank starts, the executors' Python and cloudpickle must be the kernel's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import stop_active_session

import hvdmagic
from hvdmagic.errors import LaunchError
from hvdmagic.kernel.warm_sessions import environment_table
from hvdmagic.launch import versions
from hvdmagic.task.versions import versions as here

KERNEL = {"python": "3.11.7", "cloudpickle": "3.1.3", "torch": "2.13.0+cpu", "tensorflow": None,
          "horovod": "0.28.1", "pyarrow": "26.0.1", "hvdmagic": "0.1.0"}
OLDEST_CLOUDPICKLE = Path(sys.prefix) / "oldest-cloudpickle"  # cloudpickle 3.0.0, installed by the set-up


@pytest.fixture(autouse=True)
def nothing_reported_yet(monkeypatch):
    """Each test starts as a fresh kernel would: no task has reported its versions."""
    monkeypatch.setattr(versions, "_REPORTED", {})


@pytest.mark.unit
def test_the_same_environment_passes_in_silence():
    assert versions.compare({0: ("a", KERNEL), 1: ("b", dict(KERNEL))}, KERNEL) == (None, [])


@pytest.mark.unit
def test_a_different_cloudpickle_or_python_fails_naming_the_hosts():
    old = {**KERNEL, "cloudpickle": "3.0.0"}
    problem, notices = versions.compare({0: ("a", old), 1: ("b", KERNEL), 2: ("a", old)}, KERNEL)
    assert problem.startswith("the executors cannot unpickle what this kernel sends: cloudpickle 3.0.0 on a "
                              "(tasks 0, 2), 3.1.3 in this kernel. "), problem
    assert notices == []
    problem, _ = versions.compare({0: ("b", {**KERNEL, "python": "3.12.1"})}, KERNEL)
    assert "python 3.12.1 on b (task 0), 3.11.7 in this kernel" in problem, problem


@pytest.mark.unit
def test_a_difference_that_may_work_is_one_notice():
    problem, notices = versions.compare({0: ("a", {**KERNEL, "python": "3.11.9", "torch": "2.13.1"}),
                                         1: ("b", {**KERNEL, "tensorflow": "2.21.0"})}, KERNEL)
    assert problem is None
    assert notices == ["hvdmagic: the executors differ from this kernel: python 3.11.9 on a (task 0), 3.11.7 in "
                       "this kernel", "hvdmagic: the executors differ from this kernel: torch 2.13.1 on a (task 0), "
                       "2.13.0+cpu in this kernel", "hvdmagic: the executors differ from this kernel: tensorflow "
                       "2.21.0 on b (task 1), none in this kernel"]


@pytest.mark.unit
def test_the_env_table_marks_what_differs():
    assert environment_table("%horovod").startswith("hvdmagic: no task has reported its environment")
    versions.compare({0: ("worker-1", {**here(), "torch": "2.99"}), 1: ("worker-2", here())})
    table = environment_table("%horovod").splitlines()
    assert table[0].split() == ["this", "kernel", "worker-1", "worker-2"]
    assert next(line.split() for line in table if line.startswith("torch ")) == [
        "torch", str(here()["torch"]), "2.99", "*", str(here()["torch"])], table
    assert table[-1] == "(* differs from this kernel; %horovod env shows what the last run's tasks sent)"


@pytest.mark.unit
def test_the_kernel_reports_its_own():
    found = here()
    assert found["python"] == ".".join(map(str, sys.version_info[:3]))
    assert found["hvdmagic"] and found["cloudpickle"] == __import__("cloudpickle").__version__


def test_an_executor_with_another_cloudpickle_fails_before_any_rank_starts(tmp_path, monkeypatch):
    """A real mismatch: Spark's Python workers run with cloudpickle 3.0.0 first on their path."""
    from pyspark.sql import SparkSession

    assert (OLDEST_CLOUDPICKLE / "cloudpickle").is_dir(), "the set-up installs cloudpickle 3.0.0 there"
    python = tmp_path / "python-with-old-cloudpickle"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{OLDEST_CLOUDPICKLE}${{PYTHONPATH:+:$PYTHONPATH}}" '
                      f'exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    stop_active_session()  # one SparkContext per process: this test needs one with that Python
    monkeypatch.setenv("PYSPARK_PYTHON", str(python))  # what a SparkContext starts its Python workers with
    spark = (SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1")
             .config("spark.ui.enabled", "false").getOrCreate())
    try:
        with pytest.raises(LaunchError) as caught:
            hvdmagic.run(lambda: 1, 2)
        message = str(caught.value)
        assert message.startswith("the executors cannot unpickle what this kernel sends: cloudpickle 3.0.0 on "), \
            message
        assert f"(tasks 0, 1), {here()['cloudpickle']} in this kernel" in message, message
        assert hvdmagic.last_run().ranks[0].stage is None, "a rank started"
        table = environment_table("%horovod").splitlines()
        row = next(line.split() for line in table if line.startswith("cloudpickle "))
        assert row == ["cloudpickle", here()["cloudpickle"], "3.0.0", "*"], table
        assert next(line.split() for line in table if line.startswith("python ")) == ["python", here()["python"],
                                                                                       here()["python"]], table
        # An elastic run compares each task as it joins (launch.elastic): the first one fails it alike.
        with pytest.raises(LaunchError) as caught:
            hvdmagic.run(lambda: 1, 2, min_np=1)
        message = str(caught.value)
        assert message.startswith("the executors cannot unpickle what this kernel sends: cloudpickle 3.0.0 on "), \
            message
        assert hvdmagic.last_run().ranks[0].stage is None, "a rank started"
    finally:
        spark.stop()
