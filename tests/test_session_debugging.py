"""Exploring a session's ranks (issue 61): cells on chosen ranks (--ranks), and pdb in a failed cell's rank.

One session per kind, local ranks and a Spark barrier stage on the embedded Spark, shared by the
tests of this file (each test leaves it as it found it: up, its ranks the same processes).
"""

from __future__ import annotations

import time

import pytest
from conftest import run
from IPython.core.error import UsageError
from procs import rank_processes, wait_until_gone

import hvdmagic
from hvdmagic.errors import JobFailed
from hvdmagic.kernel import warm_sessions
from hvdmagic.protocol import Framework

SETUP = """%%horovod
import os, torch, horovod.torch as hvd
hvd.init()
mark = hvd.rank() * 10
hvd.rank()
"""


@pytest.fixture(scope="module", params=["local", "spark"])
def warm(request, shell):
    """A %horovod session of two ranks (local processes, or a barrier stage on the embedded Spark), set up
    with SETUP; stopped after the module's tests of that kind, and checked for leftovers."""
    shell.run_line_magic("horovod", f"start --np {-2 if request.param == 'local' else 2}")
    result, error = run(shell, SETUP)
    assert error is None and result == 0, error
    pids = {p.pid for p in rank_processes()}
    assert len(pids) == 2, f"the session's rank processes: {pids}"
    yield pids
    assert {p.pid for p in rank_processes()} == pids, "a test of this file replaced the session's ranks"
    shell.run_line_magic("horovod", "stop")
    wait_until_gone(list(pids), within=10)


def test_a_cell_on_chosen_ranks_runs_there_alone_and_the_others_keep_their_state(ip, warm):
    result, error = run(ip, "%%horovod --ranks 1\nprint('on', hvd.rank())\nmark += 1\n(hvd.rank(), mark)")
    assert error is None and result == (1, 11), error
    record = hvdmagic.last_run()
    assert record.results == [(1, 11)], record.results
    assert [rank.state for rank in record.ranks] == ["idle", "finished"]
    assert record.logs == {0: "", 1: "on 1\n"}, record.logs
    # Rank 0 ran nothing: its mark is as the set-up left it, rank 1's as the cell left it.
    _, error = run(ip, "%%horovod --ranks 0-1\nmark")
    assert error is None and hvdmagic.last_run().results == [0, 11], hvdmagic.last_run().results
    _, error = run(ip, "%%horovod --ranks 1,0\nmark -= hvd.rank()\nmark")
    assert error is None and hvdmagic.last_run().results == [0, 10]


def test_ranks_that_cannot_be_are_one_paragraph(ip, warm):
    for line, expected in (("--ranks 2", "rank 2 is not among the 2 ranks (0, 1)"),
                           ("--ranks one", "'one' is not a list of ranks"),
                           ("--ranks 1-0", "runs backwards"),
                           ("--np -2 --ranks 0", "--ranks runs a cell on some of a session's ranks")):
        _, error = run(ip, f"%%horovod {line}\nhvd.rank()")
        assert isinstance(error, UsageError) and expected in str(error), (line, error)
    warm_session = warm_sessions.for_cell("%%horovod", Framework.HOROVOD)
    with pytest.raises(ValueError, match=r"ranks must name some of the session's 2 ranks \(0, 1\), not \[3\]"):
        hvdmagic.run(lambda: 1, session=warm_session, ranks=[3])
    with pytest.raises(ValueError, match="ranks= picks ranks of a session"):
        hvdmagic.run(lambda: 1, -2, ranks=[0])


def test_a_collective_on_some_ranks_fails_at_once_and_the_session_keeps_its_state(ip, warm):
    started = time.monotonic()
    _, error = run(ip, "%%horovod --ranks 0\nmark = 7\nhvd.allreduce(torch.ones(1))")
    took = time.monotonic() - started
    assert isinstance(error, JobFailed) and error.failures[0].rank == 0, error
    assert "CollectiveOnSomeRanks: `hvd.allreduce` is a collective: every rank must call it, and this cell runs " \
           "on rank 0 only" in str(error), error
    assert "the session keeps its ranks and their state" in str(error), error
    assert took < 5, f"the refused collective took {took:.1f} s to fail"
    # hvd.init() again is no collective (Horovod is up); broadcast_object is one.
    _, error = run(ip, "%%horovod --ranks 1\nhvd.init()\nhvd.broadcast_object(1)")
    assert isinstance(error, JobFailed) and "`hvd.broadcast` is a collective" in str(error), error
    # Nothing was left pending in Horovod: a collective of every rank works, and each rank's state is its own.
    _, error = run(ip, "%%horovod\n(mark, hvd.allreduce(torch.ones(1), op=hvd.Sum).item())")
    assert error is None and hvdmagic.last_run().results == [(7, 2.0), (10, 2.0)], error
    _, error = run(ip, "%%horovod\nmark = hvd.rank() * 10")
    assert error is None


def test_the_python_api_calls_a_function_on_chosen_ranks(ip, warm):
    def rank_and_mark(add):
        import horovod.torch as hvd

        return hvd.rank(), add + 1

    warm_session = warm_sessions.for_cell("%%horovod", Framework.HOROVOD)
    assert hvdmagic.run(rank_and_mark, session=warm_session, ranks=[1], add=2) == [(1, 3)]
    assert hvdmagic.run(rank_and_mark, session=warm_session, ranks=[0, 1], add=0) == [(0, 1), (1, 1)]
