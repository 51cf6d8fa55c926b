"""Where ranks are: the fault handler's dumps, trimmed to the user's frames and grouped by rank."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import pytest
from conftest import run
from helpers import wait_until

import hvdmagic
from hvdmagic import stacks
from hvdmagic.errors import JobTimeout
from hvdmagic.protocol import NATIVE_STACKS_MARK
from hvdmagic.task import native_stacks

HEADER = "where the ranks were (most recent call first):\n"

DUMP = """Thread 0x00007f736edc36c0 (most recent call first):
  File "/x/hvdmagic/rank/__main__.py", line 28 in _exit_when_supervisor_dies
  File "/usr/lib/python3.11/threading.py", line 982 in run

Thread 0x00007f736f5c86c0 (most recent call first):
  File "/data/loader.py", line 40 in fetch
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f7370406b80 (most recent call first):
  File "/site-packages/horovod/torch/mpi_ops.py", line 1285 in synchronize
  File "<horovod-cell>", line 7 in <module>
  File "/x/hvdmagic/rank/cell.py", line 123 in __call__
  File "<frozen runpy>", line 88 in _run_code
"""


@pytest.mark.unit
def test_a_dump_keeps_the_users_threads_the_interrupted_one_first():
    assert stacks.user_stacks(DUMP.splitlines()) == (
        'Current thread:\n  File "/site-packages/horovod/torch/mpi_ops.py", line 1285 in synchronize\n'
        '  File "<horovod-cell>", line 7 in <module>\n\n'
        'Thread:\n  File "/data/loader.py", line 40 in fetch')


# What py-spy 0.4.1's `dump --native --json` wrote for a rank in hvd.allreduce (paths shortened,
# frames left out): the main thread in horovod's C++ under pybind11 and CPython's inline helpers,
# and hvdmagic's own flusher thread.
def _frame(name, short, line=0, module="/x/horovod/torch/mpi_lib_v2.so", filename=None):
    return {"name": name, "filename": filename or f"/src/{short}", "module": module, "short_filename": short,
            "line": line}


PY_SPY = json.dumps([
    {"thread_id": 1, "thread_name": "MainThread", "frames": [
        _frame("sched_yield", "libc.so.6", module="/usr/lib/libc.so.6"),
        _frame("pybind11::gil_scoped_release::~gil_scoped_release", "gil.h", 183),
        _frame("horovod::torch::WaitAndClear", "mpi_ops_v2.cc", 1127),
        _frame("Py_INCREF", "object.h", 502, filename="/usr/include/python3.11/object.h"),
        _frame("pybind11::cpp_function::dispatcher", "pybind11.h", 1209),
        _frame("synchronize", "horovod/torch/mpi_ops.py", 1285, module=None),
        _frame("(anonymous namespace)::THPFunction_apply", "libtorch_python.so", module="/x/libtorch_python.so"),
        _frame("<module>", "<horovod-cell>", 7, module=None, filename="<horovod-cell>"),
        _frame("0x7fa10ea4524a", "libc.so.6", module="/usr/lib/libc.so.6")]},
    {"thread_id": 2, "thread_name": "hvdmagic-flush", "frames": [
        _frame("clock_nanosleep", "libc.so.6", module="/usr/lib/libc.so.6"),
        _frame("_flush_loop", "hvdmagic/rank/telemetry.py", 40, module=None, filename="/x/hvdmagic/rank/telemetry.py"),
        _frame("run", "threading.py", 982, module=None, filename="/usr/lib/python3.11/threading.py")]}])


@pytest.mark.unit
def test_native_frames_follow_the_python_stacks_without_the_binding_glue():
    waiting = stacks.user_stacks([*DUMP.splitlines(), NATIVE_STACKS_MARK, PY_SPY])
    python, native = stacks.split(waiting)
    assert python == stacks.user_stacks(DUMP.splitlines())
    # Above the innermost Python call only; pybind11, Py_INCREF and unnamed addresses left out;
    # hvdmagic's own thread left out as in the Python stacks.
    assert native == ('Thread "MainThread":\n  sched_yield (libc.so.6)\n'
                      '  horovod::torch::WaitAndClear (mpi_ops_v2.cc:1127)')
    refused = stacks.user_stacks([*DUMP.splitlines(), NATIVE_STACKS_MARK,
                                  "py-spy could not read the rank: Permission denied (os error 13)"])
    assert stacks.split(refused) == (python, "py-spy could not read the rank: Permission denied (os error 13)")
    assert stacks.split(python) == (python, "")


@pytest.mark.unit
def test_ranks_with_the_same_python_stack_group_their_native_frames_within():
    waiting = stacks.user_stacks([*DUMP.splitlines(), NATIVE_STACKS_MARK, PY_SPY])
    python, native = stacks.split(waiting)
    lines = stacks.describe({0: waiting, 2: waiting})
    assert lines[1] == "ranks 0, 2:" and lines.count("  " + stacks.NATIVE) == 1
    assert lines[-3:] == ["    " + line for line in native.splitlines()]  # once: every rank the same
    elsewhere = stacks.user_stacks([*DUMP.splitlines(), NATIVE_STACKS_MARK, "py-spy did not answer within 3 s"])
    lines = stacks.describe({0: waiting, 1: elsewhere, 2: waiting, 3: python})
    at = lines.index("  " + stacks.NATIVE)
    assert lines[:at] == ["where the ranks were (most recent call first):", "ranks 0–3:",
                          *("  " + line if line else "" for line in python.splitlines())]
    assert lines[at + 1:] == ["    ranks 0, 2:", *("      " + line for line in native.splitlines()),
                              "    rank 1:", "      py-spy did not answer within 3 s"]


@pytest.mark.unit
def test_where_it_died_reads_the_last_fatal_error_only():
    stderr = ["Fatal Python error: Segmentation fault", "", "Current thread 0x1 (most recent call first):",
              '  File "<horovod-cell>", line 2 in <module>', "a line the cell printed later",
              "Fatal Python error: Aborted", "", "Current thread 0x2 (most recent call first):",
              '  File "<horovod-cell>", line 9 in <module>']
    assert stacks.where_it_died(stderr) == (
        'Fatal Python error: Aborted\n\nCurrent thread:\n  File "<horovod-cell>", line 9 in <module>')
    assert stacks.where_it_died(["Traceback (most recent call last):", "ValueError"]) == ""


@pytest.mark.unit
def test_ranks_in_the_same_place_are_shown_once():
    waiting, sleeping = "Current thread:\n  File \"<horovod-cell>\", line 7", "Current thread:\n  File \"x\", line 1"
    assert stacks.grouped({3: waiting, 0: waiting, 1: sleeping, 2: waiting}) == [([0, 2, 3], waiting), ([1], sleeping)]
    lines = stacks.describe({0: waiting, 1: "", 2: waiting})
    assert lines[:2] == ["where the ranks were (most recent call first):", "ranks 0, 2:"]
    assert lines[-2:] == ["rank 1:", "  (no stack came back)"]


def test_a_stall_shows_where_every_rank_was_before_they_were_stopped(ip):
    """Rank 1 sleeps in Python while rank 0 waits for it inside Horovod's allreduce (C++)."""
    _, error = run(ip, "%%horovod --np -2 --stall-timeout 3\nimport time, torch, horovod.torch as hvd\nhvd.init()\n"
                       "print('started', flush=True)\nif hvd.rank() == 1:\n    time.sleep(120)\n"
                       "hvd.allreduce(torch.ones(1))\n")
    assert isinstance(error, JobTimeout) and "--stall-timeout" in str(error), error
    rendered = "\n".join(error._render_traceback_())
    where = rendered.split(HEADER, 1)[1]
    rank0, rank1 = (_python_part(text) for text in where.split("rank 1:\n"))
    assert rank0.startswith("rank 0:\n  Current thread:\n"), rendered
    assert re.search(r'horovod/torch/mpi_ops\.py", line \d+ in synchronize', rank0), rendered
    assert rank0.rstrip().endswith('File "<horovod-cell>", line 7 in <module>'), rendered
    assert [line.strip() for line in rank1.strip().splitlines()] == [
        "Current thread:", 'File "<horovod-cell>", line 6 in <module>'], rendered
    assert "/hvdmagic/" not in where, rendered
    assert sorted(hvdmagic.last_run().stacks) == [0, 1]


def test_a_stalled_session_cell_shows_where_its_ranks_were(ip):
    _, error = run(ip, "%horovod start --np -2")
    assert error is None, error
    try:
        _, error = run(ip, "%%horovod\nimport time, torch, horovod.torch as hvd\nhvd.init()")
        assert error is None, error
        _, error = run(ip, "%%horovod --stall-timeout 3\nif hvd.rank() == 0:\n    time.sleep(120)\n"
                           "hvd.allreduce(torch.ones(1))\n")
        assert isinstance(error, JobTimeout) and "--stall-timeout" in str(error), error
        where = "\n".join(error._render_traceback_()).split(HEADER)[1]
        sleeping, waiting = (_python_part(text) for text in where.split("rank 1:\n"))
        assert sleeping.rstrip().endswith('File "<horovod-cell-2>", line 3 in <module>'), where
        assert "in synchronize" in waiting and waiting.rstrip().endswith(
            'File "<horovod-cell-2>", line 4 in <module>'), where
        assert sorted(hvdmagic.last_run().stacks) == [0, 1]
    finally:
        run(ip, "%horovod stop")


def _python_part(group: str) -> str:
    """A group of the rendered stacks without its native frames (py-spy's, where installed)."""
    return group.split("  " + stacks.NATIVE + "\n")[0]


def test_a_rank_blocked_inside_a_collective_shows_the_native_frame_it_waits_in(ip):
    """Rank 1 never enters the allreduce rank 0 waits in; py-spy names horovod's C++ frame under ``synchronize``."""
    assert native_stacks.find(), (
        "py-spy is not installed beside this Python or on PATH: run scripts/setup.sh (hvdmagic's dev extras "
        "install it, pinned in requirements/lock.txt), or .venv/bin/pip install py-spy==0.4.1")
    _, error = run(ip, "%%horovod --np -2 --stall-timeout 3\nimport time, torch, horovod.torch as hvd\nhvd.init()\n"
                       "print('started', flush=True)\nif hvd.rank() == 0:\n    hvd.allreduce(torch.ones(1))\n"
                       "else:\n    time.sleep(120)\n")
    assert isinstance(error, JobTimeout) and "--stall-timeout" in str(error), error
    rendered = "\n".join(error._render_traceback_())
    rank0, rank1 = rendered.split(HEADER, 1)[1].split("\nrank 1:\n")
    python, native = rank0.split("  " + stacks.NATIVE + "\n")
    assert "in synchronize" in python and 'File "<horovod-cell>", line 6 in <module>' in python, rendered
    # The loop in horovod/torch/mpi_ops_v2.cc that synchronize() enters and spins in until every rank
    # has submitted the tensor: on the stack wherever in that loop py-spy stops the thread.
    assert re.search(r'^    Thread "MainThread":\n(      .*\n)*      horovod::torch::WaitAndClear \(', native,
                     re.MULTILINE), rendered
    assert 'File "<horovod-cell>", line 8 in <module>' in _python_part(rank1), rendered
    assert "WaitAndClear" in hvdmagic.last_run().stacks[0] and "WaitAndClear" not in hvdmagic.last_run().stacks[1]


def _ask_where_once_training(answers: list) -> threading.Thread:
    """What a second thread (the dashboard's button, a subshell) sees while the cell runs: where()."""

    def ask() -> None:
        record = wait_until(lambda: (r := hvdmagic.last_run()) is not None and r.state == "running"
                            and all(rank.logs for rank in r.ranks) and r, 60, "the cell never printed")
        answers.append((record, hvdmagic.where(timeout=10)))

    thread = threading.Thread(target=ask, name="test-where")
    thread.start()
    return thread


@pytest.mark.parametrize("session", [False, True], ids=["one-shot", "session"])
def test_where_shows_every_live_rank_grouped_while_the_cell_runs(ip, session):
    """Rank 1 naps in Python; rank 0 waits for it in Horovod's allreduce. Asked mid-run, not at a timeout."""
    if session:
        _, error = run(ip, "%horovod start --np -2")
        assert error is None, error
    answers: list = []
    thread = _ask_where_once_training(answers)
    try:
        _, error = run(ip, ("%%horovod" if session else "%%horovod --np -2") + "\n"
                           "import time, torch, horovod.torch as hvd\nhvd.init()\n"
                           "def nap(seconds):\n    time.sleep(seconds)\n"
                           "print('started', flush=True)\nif hvd.rank() == 1:\n    nap(6)\n"
                           "hvd.allreduce(torch.ones(1))\n")
        thread.join(timeout=30)
        assert error is None, error
        (record, text), = answers
        assert text.startswith("where the ranks were (most recent call first):"), text
        rank0, rank1 = text.split("rank 1:\n")
        assert "in synchronize" in rank0 and re.search(r"line 9 in <module>", rank0), text
        assert re.search(r'line 5 in nap\n.*line 8 in <module>', rank1), text
        assert sorted(record.where) == [0, 1]
    finally:
        thread.join(timeout=30)
        if session:
            run(ip, "%horovod stop")


def test_where_says_so_when_no_run_is_live(ip):
    assert hvdmagic.where().startswith("hvdmagic: no run is live")


def test_an_elastic_run_answers_where_and_its_timeout_shows_where_its_ranks_were(ip):
    """Elastic, local tasks: rank 1 naps in Python while rank 0 waits in the allreduce. where() mid-run
    names them by task (an elastic run's rows); the --timeout that ends the run, by Horovod rank."""
    answers: list = []
    thread = _ask_where_once_training(answers)
    try:
        _, error = run(ip, "%%horovod --np -2 --min-np 1 --timeout 45\nimport time, torch, horovod.torch as hvd\n"
                           "hvd.init()\ndef nap(seconds):\n    time.sleep(seconds)\n"
                           "print('started', flush=True)\nif hvd.rank() == 1:\n    nap(600)\n"
                           "hvd.allreduce(torch.ones(1))\n")
    finally:
        thread.join(timeout=30)
    (record, text), = answers
    assert text.startswith(HEADER) and "rank" not in text.split("\n")[1], text  # "task 0:", not "rank 0:"
    assert sorted(record.where) == [0, 1], text
    groups = [_python_part(group) for group in text.split(HEADER)[1].split("\ntask ")]
    assert len(groups) == 2 and sum("in synchronize" in g for g in groups) == 1, text
    assert sum(bool(re.search(r'line 5 in nap\n.*line 8 in <module>', g)) for g in groups) == 1, text

    assert isinstance(error, JobTimeout) and "--timeout 45 s" in str(error), error
    assert sorted(error.stacks) == [0, 1] and hvdmagic.last_run().stacks == error.stacks, error.stacks
    assert "in synchronize" in error.stacks[0] and re.search(r"line 5 in nap", error.stacks[1]), error.stacks
    if native_stacks.find():
        assert "horovod::torch::WaitAndClear" in stacks.split(error.stacks[0])[1], error.stacks[0]


def test_py_spy_reads_a_live_python_and_says_in_one_line_why_not_otherwise():
    """task.native_stacks on real processes: a Python asleep in time.sleep, and a process that is no Python."""
    assert native_stacks.find(), "py-spy is not installed: run scripts/setup.sh (the dev extras install it)"
    python = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen(["sleep", "60"])
    try:
        assert python.stdout.readline() == "ready\n"  # its interpreter is up: py-spy can find it
        dump = native_stacks.dump(python.pid)
        native = stacks.split(stacks.user_stacks([NATIVE_STACKS_MARK, dump]))[1]
        assert native.startswith("Thread:\n  ") and "sleep" in native, dump  # no threading module: no name
        said = native_stacks.dump(other.pid)
        assert said.startswith("py-spy could not read the rank: ") and "\n" not in said, said
    finally:
        for process in (python, other):
            process.kill()
            process.wait()
