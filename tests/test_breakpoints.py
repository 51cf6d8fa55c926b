"""``breakpoint()`` in a cell's code (issue 61): pdb in the notebook for the rank that hit it, in fresh
cells and in sessions, on local ranks and on a Spark barrier stage.

The in-process tests type at pdb's prompt through a ``Console`` of their own (what the notebook's input
box would return), and look at the run's rows while a rank waits there; the Jupyter kernel's test types
in the kernel's stdin channel, as a front end does, and presses Stop at the prompt.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from conftest import run
from helpers import execute
from pdb_conversation import converse, typed_lines
from procs import rank_processes, wait_until_gone

import hvdmagic
from hvdmagic.errors import JobFailed
from hvdmagic.kernel import breakpoint_console
from hvdmagic.kernel.ui import progress_text
from hvdmagic.launch.breakpoint_prompts import NEEDS_A_NOTEBOOK, Console

LIMITS = "--stall-timeout 2 --timeout 30"
BOTH_STOP = """import horovod.torch as hvd, torch
hvd.init()
x = hvd.rank() * 3
breakpoint()
total = hvd.allreduce(torch.ones(1) * x, op=hvd.Sum).item()
(x, total)
"""
RANK_1_STOPS = BOTH_STOP.replace("breakpoint()", "if hvd.rank() == 1:\n    breakpoint()")


class _Typist:
    """The user at the notebook's input box: types ``lines`` in order, one per prompt, and notes each prompt
    with the run's rows as they stood. ``think``: seconds taken over the first prompt, longer than the
    cell's stall limit, to show that the limits wait for the user."""

    def __init__(self, *lines: str, think: float = 0.0):
        self.lines, self.think = list(lines), think
        self.prompts: list[tuple[str, list[str]]] = []
        self.shown: list[str] = []

    def ask(self, prompt: str) -> str:
        rows = [progress_text.row_state(rank) for rank in hvdmagic.last_run().ranks]
        self.prompts.append((prompt, rows))
        assert self.lines, f"pdb asked once more ({prompt!r}) than the test had lines for"
        if len(self.prompts) == 1 and self.think:
            time.sleep(self.think)  # the scenario itself: a user who reads the frame for a while
        return self.lines.pop(0)

    def console(self) -> Console:
        return Console(self.ask, self.shown.append, lambda rank, event: self.shown.append(f"[start {rank}]"))


@pytest.fixture(params=["local", "spark"])
def np(request) -> int:
    return -2 if request.param == "local" else 2


def _typed_by(monkeypatch, typist: _Typist) -> None:
    monkeypatch.setattr(breakpoint_console, "console", typist.console)


def test_fresh_cell_ranks_stop_one_prompt_at_a_time_and_c_continues_with_the_limits_waiting(ip, np, monkeypatch):
    typist = _Typist("p x", "c", "p x", "c", think=4)
    _typed_by(monkeypatch, typist)
    _, error = run(ip, f"%%horovod --np {np} {LIMITS}\n{BOTH_STOP}")
    assert error is None, error
    assert hvdmagic.last_run().results == [(0, 3.0), (3, 3.0)], hvdmagic.last_run().results
    prompts = [prompt for prompt, _ in typist.prompts]
    first = int(prompts[0].split()[2].rstrip(")"))
    other = 1 - first
    # One rank's stop is served to its end (c) before the other's, each prompt naming its rank.
    assert prompts == [f"(Pdb rank {first}) "] * 2 + [f"(Pdb rank {other}) "] * 2, prompts
    assert typist.prompts[0][1][first] == "in the debugger", typist.prompts[0][1]
    assert typist.shown[0] == f"[start {first}]" and "-> total = hvd.allreduce(" in typist.shown[1], typist.shown
    assert typist.shown[2] == f"{first * 3}\n" and typist.shown[-2] == f"{other * 3}\n", typist.shown


def test_q_at_a_breakpoint_fails_the_fresh_cell_in_one_line(ip, np, monkeypatch):
    typist = _Typist("q")
    _typed_by(monkeypatch, typist)
    _, error = run(ip, f"%%horovod --np {np} {LIMITS}\n{RANK_1_STOPS}")
    assert isinstance(error, JobFailed) and error.failures[0].rank == 1, error
    failure = error.failures[0]
    assert failure.summary == "BdbQuit: q in pdb at breakpoint() ended the cell" and not failure.traceback, failure
    # Rank 0 waits in the allreduce: it is stopped, or, on a loaded machine, Horovod's shutdown at rank 1's
    # exit reaches it first, which is fallout and never the cause.
    assert all(other.is_fallout for other in error.failures[1:]), error.failures
    assert "rank 1" in str(error) and "Traceback" not in str(error), error


def test_a_session_cell_stops_at_breakpoint_and_keeps_its_ranks_after_c_and_q(ip, np, monkeypatch):
    ip.run_line_magic("horovod", f"start --np {np}")
    try:
        _, error = run(ip, "%%horovod\nimport horovod.torch as hvd, torch\nhvd.init()")  # the imports take seconds
        assert error is None, error
        pids = {p.pid for p in rank_processes()}
        typist = _Typist("p x", "c", "p x", "q", think=4)
        _typed_by(monkeypatch, typist)
        # --timeout 3: the user's four seconds at the prompt do not count against it.
        _, error = run(ip, f"%%horovod --timeout 3 --stall-timeout 2\n{RANK_1_STOPS}")
        assert error is None and hvdmagic.last_run().results == [(0, 3.0), (3, 3.0)], error
        assert typist.prompts[0] == ("(Pdb rank 1) ", ["running", "in the debugger"]), typist.prompts
        _, error = run(ip, "%%horovod\nmark = hvd.rank() + 100\nif hvd.rank() == 1:\n    breakpoint()\nmark")
        assert isinstance(error, JobFailed) and "BdbQuit: q in pdb at breakpoint() ended the cell" in str(error)
        assert "the session keeps its ranks and their state" in str(error), error
        _, error = run(ip, "%%horovod\n(mark, hvd.allreduce(torch.ones(1), op=hvd.Sum).item())")
        assert error is None and hvdmagic.last_run().results == [(100, 2.0), (101, 2.0)], error
        assert {p.pid for p in rank_processes()} == pids, "q at a breakpoint restarted the session's ranks"
    finally:
        ip.run_line_magic("horovod", "stop")


def test_without_a_prompt_a_script_says_so_in_one_line_and_goes_on(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent("""
        import hvdmagic

        def train():
            import horovod.torch as hvd
            hvd.init()
            breakpoint()
            return hvd.rank()

        print("results", hvdmagic.run(train, -2))
    """))
    done = subprocess.run([sys.executable, str(script)], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "results [0, 1]" in done.stdout, done.stdout
    notes = [line for line in done.stdout.splitlines() if "breakpoint()" in line]
    assert len(notes) == 1 and notes[0] in {NEEDS_A_NOTEBOOK.format(who=f"rank {r}") for r in (0, 1)}, done.stdout


def test_breakpoint_in_a_jupyter_kernel_asks_in_its_input_box_and_stop_ends_the_cell(kernel):
    """A fresh cell and a session's, as a notebook user meets them: the prompt is the front end's input box;
    Stop at the prompt ends the cell, leaves no rank behind, and the kernel and the session work on."""
    manager, client = kernel
    reply, texts = execute(client, "%load_ext hvdmagic\nimport hvdmagic", timeout=60)
    assert reply["status"] == "ok", texts
    reply, out, prompts = converse(client, f"%%horovod --np -2\n{RANK_1_STOPS}", typed_lines("p x", "c"), timeout=120)
    assert reply["status"] == "ok" and prompts == ["(Pdb rank 1) "] * 2, (prompts, out)
    assert "hvdmagic: rank 1 stopped at breakpoint()" in out and "\n3\n" in out, out

    stopped_at = {}

    def stop(prompt: str) -> None:
        stopped_at["ranks"] = [p.pid for p in rank_processes(manager.provisioner.process.pid)]
        manager.interrupt_kernel()

    reply, out, _ = converse(client, f"%%horovod --np -2\n{RANK_1_STOPS}", stop, timeout=120)
    assert reply["status"] == "error" and "interrupted while the ranks ran" in out, out
    assert len(stopped_at["ranks"]) == 2, stopped_at
    wait_until_gone(stopped_at["ranks"], within=15)

    reply, texts = execute(client, "%horovod start --np -2", timeout=180)
    assert reply["status"] == "ok", texts
    # No collective after the breakpoint: rank 0 ends the cell, and only rank 1's pdb is left for Stop to end.
    no_collective = ("import horovod.torch as hvd\nhvd.init()\nx = hvd.rank() * 3\n"
                     "if hvd.rank() == 1:\n    breakpoint()\nx")
    reply, out, _ = converse(client, f"%%horovod\n{no_collective}", stop, timeout=120)
    assert reply["status"] == "error" and "the session keeps its ranks and their state" in out, out
    reply, texts = execute(client, "%%horovod\nx", timeout=60)
    assert reply["status"] == "ok", texts
    reply, texts = execute(client, "print(hvdmagic.last_run().results)", timeout=30)
    assert texts[-1].strip() == "[0, 3]", texts
    reply, texts = execute(client, "%horovod stop", timeout=60)
    wait_until_gone(stopped_at["ranks"], within=15)
