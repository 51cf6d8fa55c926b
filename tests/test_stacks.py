"""Where ranks are: the fault handler's dumps, trimmed to the user's frames and grouped by rank."""

from __future__ import annotations

import re
import threading

import pytest
from conftest import run
from helpers import wait_until

import hvdmagic
from hvdmagic import stacks
from hvdmagic.errors import JobTimeout

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
    where = rendered.split("where the ranks were (most recent call first):\n", 1)[1]
    rank0, rank1 = where.split("rank 1:\n")
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
        where = "\n".join(error._render_traceback_()).split("where the ranks were (most recent call first):\n")[1]
        sleeping, waiting = where.split("rank 1:\n")
        assert sleeping.rstrip().endswith('File "<horovod-cell-2>", line 3 in <module>'), where
        assert "in synchronize" in waiting and waiting.rstrip().endswith(
            'File "<horovod-cell-2>", line 4 in <module>'), where
        assert sorted(hvdmagic.last_run().stacks) == [0, 1]
    finally:
        run(ip, "%horovod stop")


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
