"""Where ranks are: the fault handler's dumps, trimmed to the user's frames and grouped by rank."""

from __future__ import annotations

import re

import pytest
from conftest import run

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
