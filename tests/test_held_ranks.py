"""A fresh cell's failed rank held for %debug (--hold-on-error, issue 61): pdb there, q, the hold's seconds,
the next run ending it, %pdb on and Stop in a real Jupyter kernel; on local ranks and on Spark.

Apart from tests/test_session_debugging.py, whose module-wide sessions would hold ranks and Spark's slots
while these count the processes a hold leaves and take the slots a held rank frees.
"""

from __future__ import annotations

import re
import time

import pytest
from conftest import run
from helpers import execute, wait_until
from IPython.core.error import UsageError
from pdb_conversation import converse
from procs import rank_processes, wait_until_gone

import hvdmagic
from hvdmagic.errors import JobFailed
from hvdmagic.kernel.breakpoint_console import show

HELD = """%%horovod --np {np} --hold-on-error {seconds}
import os, torch, horovod.torch as hvd
hvd.init()
x = hvd.rank() * 3
print('pid', os.getpid())
if hvd.rank() == 1:
    1 / 0
"""


def _held_pid(error) -> int:
    """The pid rank 1 printed before it failed, from the failed cell's record."""
    assert isinstance(error, JobFailed) and error.failures[0].rank == 1, error
    return int(re.search(r"pid (\d+)", hvdmagic.last_run().logs[1]).group(1))


@pytest.mark.parametrize("np", [-2, 2], ids=["local", "spark"])
def test_a_fresh_cells_failed_rank_is_held_for_debug_and_ends_with_pdb_or_the_next_run(ip, capsys, np):
    """--hold-on-error: the cell fails at once, the other rank ends as today, rank 1 waits with its frames;
    %debug's pdb runs there, and q ends it (on Spark its barrier task, so its slot is free). A hold left
    alone is ended by the next run, which says so in a note."""
    started = time.monotonic()
    _, error = run(ip, HELD.format(np=np, seconds=120))
    took = time.monotonic() - started
    held = _held_pid(error)
    assert took < 60, f"the failed cell took {took:.0f} s: it waited for its held rank"
    assert [p.pid for p in rank_processes()] == [held], "rank 0 ended with the cell; rank 1 alone is held"
    capsys.readouterr()
    hvdmagic.debug(commands=["p x", "p hvd.allreduce(torch.ones(1))"])
    out = capsys.readouterr().out
    assert out.startswith("hvdmagic: pdb in rank 1, held after the cell failed (--hold-on-error), where "
                          "ZeroDivisionError: division by zero was raised; q leaves it, and the rank ends.\n"), out
    assert "-> 1 / 0\n(Pdb) p x\n3\n" in out and "(Pdb) q\n" in out, out
    # The other rank has ended: a collective in pdb is refused, not left waiting for it.
    assert "`hvd.allreduce` is a collective: every rank must call it, and pdb runs on rank 1 alone" in out, out
    wait_until_gone([held], within=10, what="the held rank, after q,")
    assert not rank_processes(), rank_processes()
    hvdmagic.debug()
    assert capsys.readouterr().out == ("hvdmagic: rank 1, held after the cell failed, has ended (its pdb ended), "
                                       "and its frames with it: run the cell again, then %debug.\n")

    _, error = run(ip, HELD.format(np=np, seconds=120))
    held = _held_pid(error)
    result, error = run(ip, f"%%horovod --np {np}\n2 + 2")
    assert error is None and result == 4, error
    assert ("hvdmagic: ended rank 1, held for %debug after the last cell failed (--hold-on-error), to free its slot "
            "for this run.") in hvdmagic.last_run().notes, hvdmagic.last_run().notes
    wait_until_gone([held], within=10, what="the held rank, after the next run,")
    assert not rank_processes(), rank_processes()


def test_a_hold_ends_after_its_seconds_and_the_kernels_variable_is_its_default(ip, capsys, monkeypatch):
    monkeypatch.setenv("HVDMAGIC_HOLD_ON_ERROR", "2")
    _, error = run(ip, HELD.format(np=-2, seconds=2).replace(" --hold-on-error 2", ""))
    held = _held_pid(error)
    assert [p.pid for p in rank_processes()] == [held]
    wait_until_gone([held], within=15, what="a rank held for 2 s")
    wait_until(lambda: not error.held.alive, 10, "the kernel did not see the held rank end")
    capsys.readouterr()
    hvdmagic.debug()
    assert "has ended (its 2 s (--hold-on-error) passed)" in capsys.readouterr().out
    monkeypatch.setenv("HVDMAGIC_HOLD_ON_ERROR", "soon")
    _, error = run(ip, "%%horovod --np -2\n1")
    assert isinstance(error, UsageError) and "HVDMAGIC_HOLD_ON_ERROR (the default of --hold-on-error) must be a " \
        "number of seconds, such as 300, not 'soon'" in str(error), error
    _, error = run(ip, "%%horovod --np -2 --hold-on-error -1\n1")
    assert isinstance(error, UsageError) and "--hold-on-error must be 0" in str(error), error


@pytest.mark.parametrize("np", [-2, 2], ids=["local", "spark"])
def test_pdb_on_enters_a_held_rank_as_the_fresh_cell_fails_and_stop_ends_it(kernel, np):
    """%pdb on in a Jupyter kernel: the fresh cell's held rank's pdb asks in the input box as the cell fails;
    Stop at its prompt ends pdb, the rank and its task, and the kernel goes on."""
    manager, client = kernel
    reply, texts = execute(client, "%load_ext hvdmagic\n%pdb on", timeout=60)
    assert reply["status"] == "ok", texts
    prompts_seen = []

    def answer(prompt: str):
        prompts_seen.append(prompt)
        if len(prompts_seen) == 1:
            return "p x"
        manager.interrupt_kernel()  # Stop at the second prompt
        return None

    reply, out, prompts = converse(client, HELD.format(np=np, seconds=120), answer, timeout=180)
    assert reply["status"] == "error" and prompts == ["(Pdb) ", "(Pdb) "], (prompts, out)
    assert out.index("ZeroDivisionError") < out.index("hvdmagic: pdb in rank 1, held after the cell failed"), out
    assert "-> 1 / 0\n" in out and "\n3\n" in out, out
    assert "hvdmagic: interrupted: Stop ended the debugger on rank 1, and the rank held for it.\n" in out, out
    reply, texts = execute(client, "%pdb off\nimport hvdmagic\nprint(hvdmagic.last_run().logs[1].split()[1])",
                           timeout=30)
    wait_until_gone([int(texts[-1].split()[-1])], within=10, what="the held rank, after Stop,")
    reply, texts = execute(client, f"%%horovod --np {np}\n2 + 2", timeout=120)
    assert reply["status"] == "ok", texts


def test_horovods_echo_of_the_other_ranks_exit_is_left_out_of_pdbs_text(capsys):
    """A held rank's Horovod thread notices the other ranks' exit whenever it runs, on a loaded machine
    after pdb has started (CI saw it head the text): its line stays out of the pdb text, as it stays
    out of the live views, and pdb's own lines and the rank's other output are shown whole."""
    echo = ("[2026-12-07 01:21:01.530073: E /tmp/hvd-build/src/horovod-0.28.1/horovod/common/operations.cc:697] "
            "[1]: Horovod background loop uncaught exception: [/tmp/hvd-build/src/horovod-0.28.1/third_party/gloo/"
            "gloo/transport/tcp/pair.cc:589] Read error [127.0.0.1]:46480: Connection reset by peer\n")
    pdb = "> <horovod-cell>(7)<module>()\n-> 1 / 0\n(Pdb) "
    show(echo + "a line the cell's thread printed\n")
    show(pdb)
    assert capsys.readouterr().out == "a line the cell's thread printed\n" + pdb
