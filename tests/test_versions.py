"""Before any rank starts, the executors' Python and cloudpickle must be the kernel's."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import netns
import pytest
from helpers import spark_cluster, stop_active_session

import hvdmagic
from hvdmagic.errors import LaunchError
from hvdmagic.kernel.warm_sessions import environment_table
from hvdmagic.launch import versions
from hvdmagic.task.versions import versions as here

KERNEL = {"python": "3.11.7", "cloudpickle": "3.1.3", "torch": "2.13.0+cpu", "tensorflow": None,
          "horovod": "0.28.1", "pyarrow": "26.0.1", "hvdmagic": "0.1.0"}
# pyproject.toml's cloudpickle floor, which the set-up installs here (2.2.0 for ">=2.2").
OLDEST_CLOUDPICKLE = Path(sys.prefix) / "oldest-cloudpickle"
# A second virtualenv: the lock's pyspark, py4j and psutil, that oldest cloudpickle, this hvdmagic (scripts/setup.sh).
OLDEST_CLOUDPICKLE_VENV = Path(sys.prefix) / "oldest-cloudpickle-venv"
OLDEST = next((re.sub(r"^cloudpickle-(.+)\.dist-info$", r"\1", info.name)
               for info in OLDEST_CLOUDPICKLE.glob("cloudpickle-*.dist-info")), "not installed")
_NO_HOSTS = netns.available()  # why two simulated hosts cannot be made here, or None


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
    """A real mismatch: Spark's Python workers run with the oldest cloudpickle allowed first on their path."""
    from pyspark.sql import SparkSession

    assert (OLDEST_CLOUDPICKLE / "cloudpickle").is_dir(), f"the set-up installs cloudpickle {OLDEST} there"
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
        assert message.startswith(f"the executors cannot unpickle what this kernel sends: cloudpickle {OLDEST} on "), \
            message
        assert f"(tasks 0, 1), {here()['cloudpickle']} in this kernel" in message, message
        assert hvdmagic.last_run().ranks[0].stage is None, "a rank started"
        table = environment_table("%horovod").splitlines()
        row = next(line.split() for line in table if line.startswith("cloudpickle "))
        assert row == ["cloudpickle", here()["cloudpickle"], OLDEST, "*"], table
        assert next(line.split() for line in table if line.startswith("python ")) == ["python", here()["python"],
                                                                                       here()["python"]], table
        # An elastic run compares each task as it joins (launch.elastic): the first one fails it alike.
        with pytest.raises(LaunchError) as caught:
            hvdmagic.run(lambda: 1, 2, min_np=1)
        message = str(caught.value)
        assert message.startswith(f"the executors cannot unpickle what this kernel sends: cloudpickle {OLDEST} on "), \
            message
        assert hvdmagic.last_run().ranks[0].stage is None, "a rank started"
    finally:
        spark.stop()


@pytest.mark.cluster
@pytest.mark.skipif(_NO_HOSTS is not None, reason=f"no simulated hosts: {_NO_HOSTS}")
def test_one_worker_with_another_virtualenv_fails_the_run_naming_only_its_host(tmp_path):
    """Two simulated hosts, one worker each; the second worker's executors run the second virtualenv.

    Spark sends every executor the driver's PYSPARK_PYTHON, so it is a bare command name here,
    and each worker's PATH (which its executors and their Python workers inherit) says which
    Python that name starts.
    """
    second_python = OLDEST_CLOUDPICKLE_VENV / "bin" / "python"
    assert second_python.exists(), "scripts/setup.sh builds it (install_oldest_cloudpickle_venv)"
    command = "hvdmagic-test-executor-python"
    worker_env = []
    for worker, python in enumerate([sys.executable, second_python]):
        folder = tmp_path / f"python-of-worker{worker}"
        folder.mkdir()
        # A script, not a symlink: a symlink's Python would look for pyvenv.cfg beside the link,
        # miss it, and run as the base interpreter outside either virtualenv.
        (folder / command).write_text(f'#!/bin/sh\nexec "{python}" "$@"\n')
        (folder / command).chmod(0o755)
        worker_env.append({"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"})
    with netns.Hosts() as network, spark_cluster(tmp_path, cores=2, gpus=0, host=network.driver,
                                                    worker_hosts=network.hosts, worker_env=worker_env,
                                                    python=command, app="hvdmagic-two-virtualenvs"):
        kernel_host, old_host = (ns for _, ns in network.hosts)  # the hostname of each is its namespace's
        with pytest.raises(LaunchError) as caught:
            hvdmagic.run(lambda: 1, 4)
        message = str(caught.value)
        assert hvdmagic.last_run().ranks[0].stage is None, "a rank started"
    named = re.match(rf"the executors cannot unpickle what this kernel sends: cloudpickle {re.escape(OLDEST)} on (\S+) "
                     r"\(tasks (\d+), (\d+)\), (\S+) in this kernel\. ", message)
    assert named, message
    assert (named[1], named[4]) == (old_host, here()["cloudpickle"]), message
    assert kernel_host not in message, f"the worker with the kernel's virtualenv is named: {message}"
    # One row per package; cells are at least two spaces apart ("2.2.0 *" holds one).
    rows = {cells[0]: cells[1:] for cells in (re.split(r" {2,}", line) for line in
                                              environment_table("%horovod").splitlines()[:-1])}
    hosts = rows[""][1:]
    assert sorted(hosts) == sorted([kernel_host, old_host]), rows
    assert rows["cloudpickle"][0] == here()["cloudpickle"], rows
    assert dict(zip(hosts, rows["cloudpickle"][1:])) == {kernel_host: here()["cloudpickle"], old_host: f"{OLDEST} *"}, \
        rows
    column = hosts.index(kernel_host) + 1
    assert not [name for name, cells in rows.items() if cells[column].endswith("*")], \
        f"the worker with the kernel's virtualenv differs from the kernel: {rows}"
    assert rows["python"] == [here()["python"]] * 3, f"the second virtualenv's Python is the kernel's: {rows}"
