"""Exploring a session's ranks (issue 61): cells on chosen ranks (--ranks), and pdb in a failed cell's rank.

One session per kind, local ranks and a Spark barrier stage on the embedded Spark, shared by the
tests of this file (each test leaves it as it found it: up, its ranks the same processes).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import signal
import time

import psutil
import pytest
from conftest import run
from helpers import execute
from IPython.core.error import UsageError
from pdb_conversation import converse, typed_lines
from procs import rank_processes, wait_until_gone

import hvdmagic
from hvdmagic import protocol
from hvdmagic.errors import JobFailed
from hvdmagic.kernel import warm_sessions
from hvdmagic.protocol import Framework
from hvdmagic.rank import debugger
from hvdmagic.rank.cell_loop import Interrupts

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


FAILING = """%%horovod
def divide(a, b):
    ratio = a / b
    return ratio
x = hvd.rank() * 3
table = {'rank': hvd.rank(), 'xs': [1, 2]}
divide(x, hvd.rank() - 1)
"""


def test_debug_opens_pdb_in_the_failed_rank_at_its_frame_and_the_session_keeps_its_state(ip, warm, capsys):
    _, error = run(ip, FAILING)
    assert isinstance(error, JobFailed) and error.failures[0].rank == 1, error
    capsys.readouterr()
    hvdmagic.debug(commands=["p a, b", "w", "u", "p x", "pp table", "l 7, 7", "d", "p hvd.allreduce(torch.ones(1))"])
    out = capsys.readouterr().out
    assert out.startswith("hvdmagic: pdb in rank 1, where ZeroDivisionError: division by zero was raised; q leaves "
                          "it, and the session keeps its ranks and their state.\n"), out
    cell = f"<horovod-cell-{warm_sessions.for_cell('%%horovod', Framework.HOROVOD).next_cell - 1}>"
    transcript = out.split("\n", 1)[1]
    expected = [f"> {cell}(3)divide()\n-> ratio = a / b\n(Pdb) p a, b\n(3, 0)\n",
                # The stack starts at the cell: no frame of hvdmagic's cell loop below it.
                f"(Pdb) w\n  {cell}(7)<module>()\n-> divide(x, hvd.rank() - 1)\n> {cell}(3)divide()\n",
                f"(Pdb) u\n> {cell}(7)<module>()\n", "(Pdb) p x\n3\n", "(Pdb) pp table\n{'rank': 1, 'xs': [1, 2]}\n",
                "(Pdb) l 7, 7\n  7  ->\tdivide(x, hvd.rank() - 1)\n", f"(Pdb) d\n> {cell}(3)divide()\n",
                "(Pdb) p hvd.allreduce(torch.ones(1))\n*** hvdmagic.rank.subset_guard.CollectiveOnSomeRanks: "
                "`hvd.allreduce` is a collective: every rank must call it, and pdb runs on rank 1 alone",
                "(Pdb) q\n"]
    at = 0
    for part in expected:
        found = transcript.find(part, at)
        assert found >= 0, f"pdb's transcript lacks, in order, {part!r}:\n{transcript}"
        at = found + len(part)
    # A collective refused in an earlier cell on rank 0: pdb starts at the user's call, not in the refusal.
    hvdmagic.debug(commands=["p hvd.rank()"], rank=0)
    out = capsys.readouterr().out
    assert "where CollectiveOnSomeRanks: `hvd.allreduce` is a collective" in out and "(from an earlier cell" in out
    assert re.search(r"\n> <horovod-cell-\d+>\(3\)<module>\(\)\n-> hvd.allreduce\(torch.ones\(1\)\)\n"
                     r"\(Pdb\) p hvd.rank\(\)\n0\n", out), out
    _, error = run(ip, "%horovod debug --rank 4")
    assert isinstance(error, UsageError) and "ranks must name some of the session's 2 ranks" in str(error), error
    # q left pdb, and the ranks kept their state: the session's next cell sees it, and collectives work.
    _, error = run(ip, "%%horovod\n(mark, x, hvd.allreduce(torch.ones(1), op=hvd.Sum).item())")
    assert error is None and hvdmagic.last_run().results == [(0, 0, 2.0), (10, 3, 2.0)], error


@pytest.mark.parametrize("np", [-2, 2], ids=["local", "spark"])
def test_debug_in_a_jupyter_kernel_asks_in_its_input_box_and_stop_ends_it(kernel, np):
    """%debug and %pdb on as a notebook user meets them: pdb's prompt is the front end's input box (ipykernel's
    input_request); Stop at the prompt, or while pdb evaluates, ends pdb and leaves the session and its ranks."""
    manager, client = kernel
    reply, texts = execute(client, "%load_ext hvdmagic\nimport hvdmagic", timeout=60)
    assert reply["status"] == "ok", texts
    # A fresh cell's ranks end with it: %debug says how to keep a traceback, in one line, and opens no pdb.
    reply, _ = execute(client, "%%horovod --np -2\nraise ValueError('fresh')", timeout=120)
    assert reply["status"] == "error"
    reply, out, prompts = converse(client, "%debug", typed_lines(), timeout=30)
    assert reply["status"] == "ok" and not prompts, out
    assert out == ("hvdmagic: the failed cell's ranks ended with it, and their frames with them: give the cell "
                   "--hold-on-error SECONDS to keep its failed rank that long for %debug, or run it on a session's "
                   "ranks (%horovod start --np N, then the cell without --np), which keep a failed cell's "
                   "frames.\n"), out

    reply, texts = execute(client, f"%horovod start --np {np}", timeout=180)
    assert reply["status"] == "ok", texts
    reply, texts = execute(client, SETUP.replace("hvd.rank()\n", "pid = os.getpid()\n"), timeout=120)
    assert reply["status"] == "ok", texts
    reply, texts = execute(client, "%%horovod\npid\n", timeout=60)
    reply, texts = execute(client, "print(hvdmagic.last_run().results)", timeout=30)  # in rank order
    pids = [int(pid) for pid in re.findall(r"\d+", texts[-1])]
    assert len(pids) == 2 and all(psutil.pid_exists(pid) for pid in pids), texts

    # %pdb on: the failing cell opens rank 1's pdb as it fails, below its error.
    execute(client, "%pdb on", timeout=30)
    reply, out, prompts = converse(client, FAILING, typed_lines("p a, b", "q"), timeout=60)
    assert reply["status"] == "error" and prompts == ["(Pdb) ", "(Pdb) "], (prompts, out)
    assert out.index("ZeroDivisionError") < out.index("hvdmagic: pdb in rank 1, where ZeroDivisionError"), out
    assert "-> ratio = a / b\n" in out and "(3, 0)\n" in out, out
    execute(client, "%pdb off", timeout=30)
    # %debug: the same frame, each line typed in the input box.
    reply, out, prompts = converse(client, "%debug", typed_lines("p b", "u", "p table['xs']", "q"), timeout=60)
    assert reply["status"] == "ok" and len(prompts) == 4, (prompts, out)
    assert "\n0\n" in out and "-> divide(x, hvd.rank() - 1)\n" in out and "[1, 2]\n" in out, out

    # Stop at pdb's prompt: %debug says so in a line (as IPython's own %debug raises nothing).
    reply, out, _ = converse(client, "%debug", lambda prompt: manager.interrupt_kernel(), timeout=60)
    assert reply["status"] == "ok", (reply, out)
    assert out.endswith("hvdmagic: interrupted: Stop ended the debugger on rank 1; the session keeps its ranks and "
                        "their state.\n"), out
    # Stop while pdb evaluates a line that would run for a minute.
    started = {}

    def stop_once_sleeping(out: str) -> None:
        if "sleeping" in out and not started:
            started["at"] = time.monotonic()
            manager.interrupt_kernel()

    sleeping = typed_lines("import os, time; os.write(1, b'sleeping\\n'); time.sleep(60)")
    reply, out, _ = converse(client, "%debug", sleeping, timeout=60, on_output=stop_once_sleeping)
    assert started and "Stop ended the debugger on rank 1" in out, out
    assert time.monotonic() - started["at"] < 10, "Stop took the length of the sleep to end pdb"

    # The kernel, the session, its ranks and their state are all as they were.
    reply, texts = execute(client, "%%horovod\n(x, pid)", timeout=60)
    assert reply["status"] == "ok", texts
    reply, texts = execute(client, "print(hvdmagic.last_run().results)", timeout=30)
    assert texts[-1].strip() == f"[(0, {pids[0]}), (3, {pids[1]})]", texts
    # A rank that never failed holds nothing to debug.
    reply, out, prompts = converse(client, "%horovod debug --rank 0", typed_lines(), timeout=30)
    assert out == ("hvdmagic: rank 0 holds no traceback: no cell of this session failed on it (ranks that failed: "
                   "1).\n") and not prompts, out
    reply, texts = execute(client, "%horovod stop", timeout=60)
    assert reply["status"] == "ok", texts
    wait_until_gone(pids, within=10)  # Stop left no rank, nor pdb, behind


def test_stop_as_pdbs_read_returns_still_ends_pdb():
    """Stop sends the rank EOF, then SIGINT. Under load the signal can be handled just as the read of EOF
    returns, after SIGINT is allowed again. pdb then catches the KeyboardInterrupt and asks again. The
    EOF must already be recorded by then, or pdb waits for a line that never comes (CI saw this: 'did not
    end within 15 s of Stop')."""
    class SignalAsTheReadReturns(Interrupts):
        signalled = False

        @contextlib.contextmanager
        def held(self):
            with super().held():
                yield
            if not self.signalled:  # Stop's one SIGINT, handled at the next bytecode, with SIGINT allowed
                self.signalled = True
                os.kill(os.getpid(), signal.SIGINT)

    stdin = io.BytesIO()
    protocol.write_control(stdin, protocol.debug_input(1, None))  # Stop's line of None, as the supervisor writes it
    stdin.seek(0)  # then the end of the stream: a second read finds the rank's stdin closed
    before = signal.getsignal(signal.SIGINT)
    try:
        try:
            (lambda a, b: a / b)(3, 0)
        except ZeroDivisionError as exc:
            failure = exc
        read_eof_only = debugger.post_mortem(failure, 1, stdin, SignalAsTheReadReturns())
    finally:
        signal.signal(signal.SIGINT, before)
    assert read_eof_only, "pdb read again after Stop's EOF: at a rank, that read waits for a line that never comes"
