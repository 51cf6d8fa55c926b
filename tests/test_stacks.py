"""Where ranks are: the fault handler's dumps, trimmed to the user's frames and grouped by rank."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time

import pytest
from conftest import run
from helpers import wait_until

import hvdmagic
from hvdmagic import stacks
from hvdmagic.errors import JobTimeout, RankFailure
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
    cell = f"Cell In[{ip.execution_count}]"  # as IPython names the %%horovod cell itself
    assert rank0.rstrip().endswith(f"{cell}, line 7 in <module>\n      hvd.allreduce(torch.ones(1))"), rendered
    assert [line.strip() for line in rank1.strip().splitlines()] == [
        "Current thread:", f"{cell}, line 6 in <module>", "time.sleep(120)"], rendered
    assert str(error).startswith(f"Rank 1 is at {cell}, line 6; rank 0 waits in `allreduce` ({cell}, line 7): "), error
    assert "/hvdmagic/" not in where, rendered
    assert sorted(hvdmagic.last_run().stacks) == [0, 1]


@contextlib.contextmanager
def _horovod_session(ip):
    """A session of 2 local ranks that have initialised horovod (and imported time and torch), stopped after."""
    _, error = run(ip, "%horovod start --np -2")
    assert error is None, error
    try:
        _, error = run(ip, "%%horovod\nimport time, torch, horovod.torch as hvd\nhvd.init()")
        assert error is None, error
        yield
    finally:
        run(ip, "%horovod stop")


def test_a_stalled_session_cell_shows_where_its_ranks_were(ip):
    with _horovod_session(ip):
        _, error = run(ip, "%%horovod --stall-timeout 3\nif hvd.rank() == 0:\n    time.sleep(120)\n"
                           "hvd.allreduce(torch.ones(1))\n")
        assert isinstance(error, JobTimeout) and "--stall-timeout" in str(error), error
        where = "\n".join(error._render_traceback_()).split(HEADER)[1]
        sleeping, waiting = (_python_part(text) for text in where.split("rank 1:\n"))
        # Named as the notebook numbers the session's cell, with its line, as a one-shot cell's are (issue 46).
        cell = f"Cell In[{ip.execution_count}]"
        assert re.search(rf"{re.escape(cell)}, line 3 in <module>\n +time\.sleep\(120\)\s*$", sleeping), where
        assert "in synchronize" in waiting and re.search(
            rf"{re.escape(cell)}, line 4 in <module>\n +hvd\.allreduce\(torch\.ones\(1\)\)\s*$", waiting), where
        assert "<horovod-cell" not in "\n".join(error._render_traceback_()), where
        assert sorted(hvdmagic.last_run().stacks) == [0, 1]


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
    cell = f"Cell In[{ip.execution_count}]"
    assert "in synchronize" in python and f"{cell}, line 6 in <module>" in python, rendered
    # The loop in horovod/torch/mpi_ops_v2.cc that synchronize() enters and spins in until every rank
    # has submitted the tensor: on the stack wherever in that loop py-spy stops the thread.
    assert re.search(r'^    Thread "MainThread":\n(      .*\n)*      horovod::torch::WaitAndClear \(', native,
                     re.MULTILINE), rendered
    assert f"{cell}, line 8 in <module>" in _python_part(rank1), rendered
    assert "WaitAndClear" in hvdmagic.last_run().stacks[0] and "WaitAndClear" not in hvdmagic.last_run().stacks[1]


# nap's frame, then the cell line that called it, in the where() tests' cells: named as IPython names
# a one-shot cell (its source line under each frame), as its file for a session's cell.
NAP_THEN_ITS_CALL = r"line 5 in nap\n( +time\.sleep\(seconds\)\n)?.*line 8 in <module>"


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
        assert re.search(NAP_THEN_ITS_CALL, rank1), text
        assert "<horovod-cell" not in text and f"Cell In[{ip.execution_count}], line 9 in <module>" in text, text
        assert sorted(record.where) == [0, 1]
    finally:
        thread.join(timeout=30)
        if session:
            run(ip, "%horovod stop")


def test_where_after_a_run_shows_what_it_kept_and_how_to_ask_while_one_runs(ip):
    _, error = run(ip, "%%horovod --np -1\n1")
    assert error is None, error
    text = hvdmagic.where()
    assert text.startswith("hvdmagic: no run is live, and the last run kept no stacks."), text
    assert "subshell console" in text and "where are the ranks?" in text, text
    _, error = run(ip, "%%horovod --np -1 --timeout 15\nimport time\ndef nap():\n    time.sleep(600)\n"
                       "print('napping', flush=True)\nnap()")
    assert error is not None
    text = hvdmagic.where()
    assert text.startswith("hvdmagic: no run is live. Where the last run's ranks were when it was stopped:"), text
    assert "nap" in text and "subshell console" in text, text


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
    assert sum(bool(re.search(NAP_THEN_ITS_CALL, g)) for g in groups) == 1, text

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


# -- notebook cells, named as IPython names them; where each rank is, in one sentence ----------------
NOTEBOOK_DUMP = """Current thread 0x00007f7370406b80 (most recent call first):
  File "/tmp/ipykernel_7/3077.py", line 4 in slow_step
  File "<horovod-cell>", line 6 in <module>
  File "/site-packages/numpy/core/fromnumeric.py", line 88 in _wrapreduction
"""
SLOW_STEP = ["import time\n", "\n", "def slow_step(seconds):\n", "    time.sleep(seconds)\n"]


@pytest.mark.unit
def test_a_frame_in_a_notebook_cell_is_named_as_ipython_names_it_with_its_line():
    cells = {"/tmp/ipykernel_7/3077.py": ("Cell In[5]", SLOW_STEP), "<horovod-cell>": ("Cell In[6]", ["\n"] * 3)}
    named = stacks.name_cells(stacks.user_stacks(NOTEBOOK_DUMP.splitlines()), cells.get)
    assert named.splitlines() == [
        "Current thread:", "  Cell In[5], line 4 in slow_step", "    time.sleep(seconds)",
        "  Cell In[6], line 6 in <module>",  # past the cell's end: no source line to show
        '  File "/site-packages/numpy/core/fromnumeric.py", line 88 in _wrapreduction']
    assert stacks.name_cells(named, cells.get) == named  # named once: naming again changes nothing
    assert stacks.name_cells(named, {}.get) == named


def _thread(*frames: tuple[str, int, str]) -> str:
    """A fault handler's dump of one thread; a frame in "Cell In[N]" as ``name_cells`` wrote it."""
    return "\n".join(["Current thread 0x00007f7370406b80 (most recent call first):",
                      *(f"  {file}, line {line} in {function}" if file.startswith("Cell In[")
                        else f'  File "{file}", line {line} in {function}' for file, line, function in frames)])


HVD = "/venv/lib/python3.11/site-packages/horovod/torch/mpi_ops.py"
# As horovod 0.28.1 and torch 2 write hvd.allreduce: horovod's allreduce is a torch autograd Function.
IN_ALLREDUCE = _thread((HVD, 1285, "synchronize"), (HVD, 205, "forward"),
                       ("/venv/lib/python3.11/site-packages/torch/autograd/function.py", 625, "apply"),
                       (HVD, 254, "allreduce"), ("Cell In[6]", 7, "<module>"))


@pytest.mark.unit
def test_the_summary_names_the_users_function_and_the_collective_the_others_wait_in():
    asleep = _thread(("Cell In[5]", 4, "slow_step"), ("Cell In[6]", 6, "<module>"))
    many = {rank: IN_ALLREDUCE for rank in range(24)} | {1: asleep}
    assert stacks.summary(many) == ("rank 1 is in `slow_step` (Cell In[5], line 4); "
                                    "ranks 0, 2–23 wait in `allreduce` (Cell In[6], line 7)")
    # torch.distributed's all_reduce under its logging wrapper; a cell's own top level; a library's frame
    # under a user's file; a rank that sent no stack back is left out.
    torch = "/usr/lib/python3.11/site-packages/torch/distributed"
    assert stacks.summary({
        0: _thread((f"{torch}/distributed_c10d.py", 2501, "all_reduce"), (f"{torch}/c10d_logger.py", 79, "wrapper"),
                   ("/home/me/train.py", 12, "step")),
        1: _thread(("Cell In[6]", 9, "<module>")),
        2: _thread(("/usr/lib/python3.11/json/decoder.py", 337, "decode"), ("/home/me/train.py", 30, "load")),
        3: ""}, "task") == ("task 1 is at Cell In[6], line 9; task 2 is in `load` (train.py, line 30); "
                            "task 0 waits in `all_reduce` (train.py, line 12)")


@pytest.mark.unit
def test_the_summary_stays_one_sentence_for_ranks_in_many_places():
    scattered = {rank: _thread(("Cell In[6]", 10 + rank, "<module>")) for rank in range(8)}
    assert stacks.summary(scattered) == ("rank 0 is at Cell In[6], line 10; rank 1 is at Cell In[6], line 11; "
                                         "rank 2 is at Cell In[6], line 12; rank 3 is at Cell In[6], line 13; "
                                         "ranks 4–7 are elsewhere")
    assert stacks.summary({0: "", 1: "(no stack came back)"}) == ""


@pytest.mark.unit
def test_a_timeouts_message_says_where_the_ranks_were_instead_of_guessing():
    dumps = {0: IN_ALLREDUCE.replace("  Cell In[6], line 7", '  File "<horovod-cell>", line 7'), 1: NOTEBOOK_DUMP}
    note = ("rank(s) 0, 1 made no progress for 3 s (--stall-timeout); rank 0 stopped progressing 3 s ago "
            "(alive, e.g. stuck in a collective)")
    error = JobTimeout([], [0, 1], note=note, stacks=dumps)  # as the launcher raises it
    cells = {"/tmp/ipykernel_7/3077.py": ("Cell In[5]", SLOW_STEP), "<horovod-cell>": ("Cell In[6]", [])}
    error.stacks = {rank: stacks.name_cells(text, cells.get) for rank, text in error.stacks.items()}  # as the kernel
    # The rank that does not wait in a collective first, then the ranks waiting for it.
    assert str(error) == ("Rank 1 is in `slow_step` (Cell In[5], line 4); rank 0 waits in `allreduce` (Cell In[6], "
                          "line 7): rank(s) 0, 1 made no progress for 3 s (--stall-timeout); rank 0 stopped "
                          "progressing 3 s ago (alive); rank(s) 0, 1 were stopped.")
    assert "stuck in a collective" in str(JobTimeout([], [0, 1], note=note))  # no stacks: the guess stays
    # Rank 0's collective failed as the stop ended its peer: part of the stop, the news stays first.
    fallout = RankFailure(0, "RuntimeError: [pair.cc:553] Connection reset by peer", "", "vm")
    named = error.stacks
    error = JobTimeout([fallout], [1], note=note, stacks=dumps)
    error.stacks = named  # as the kernel names the cells
    assert str(error).startswith("Rank 1 is in `slow_step` (Cell In[5], line 4); rank 0 waits in `allreduce` "), error
    assert str(error).endswith("; rank(s) 0, 1 were stopped."), error


@pytest.mark.unit
def test_the_record_names_the_notebook_cells_in_where_answers(ip):
    from hvdmagic.kernel.record import RunRecord
    from hvdmagic.launch import Placement

    defined = ip.run_cell("".join(SLOW_STEP), store_history=True)
    filename = ip.user_ns["slow_step"].__code__.co_filename
    record = RunRecord(Placement.of(-2))
    dump = NOTEBOOK_DUMP.replace("/tmp/ipykernel_7/3077.py", filename)
    record.apply({"type": "stacks", "rank": 1, "text": dump})
    assert f"Cell In[{defined.execution_count}], line 4 in slow_step\n    time.sleep(seconds)" in record.where[1]
    assert filename not in record.where[1]
    assert '"<horovod-cell>", line 6' in record.where[1]  # no %%horovod cell behind this record: left as it is


def test_a_hang_names_the_notebook_cells_and_says_where_each_rank_is(ip):
    """Rank 1 sleeps in a function from another cell while rank 0 waits for it in Horovod's allreduce."""
    defined = ip.run_cell("".join(SLOW_STEP), store_history=True)
    hang = ip.run_cell("%%horovod --np -2 --stall-timeout 3\nimport torch, horovod.torch as hvd\nhvd.init()\n"
                       "print('started', flush=True)\nif hvd.rank() == 1:\n    slow_step(120)\n"
                       "hvd.allreduce(torch.ones(1))\n", store_history=True)
    error = hang.error_in_exec
    assert isinstance(error, JobTimeout), error
    other, own = f"Cell In[{defined.execution_count}]", f"Cell In[{hang.execution_count}]"
    assert str(error).startswith(f"Rank 1 is in `slow_step` ({other}, line 4); "
                                 f"rank 0 waits in `allreduce` ({own}, line 7): "), error
    assert "stuck in a collective" not in str(error), error
    rendered = "\n".join(error._render_traceback_())
    rank1 = _python_part(rendered.split("\nrank 1:\n", 1)[1])
    assert [line.strip() for line in rank1.strip().splitlines()] == [
        "Current thread:", f"{other}, line 4 in slow_step", "time.sleep(seconds)",
        f"{own}, line 6 in <module>", "slow_step(120)"], rendered
    for unnamed in ("<ipython-input", "/tmp/ipykernel", "<horovod-cell>"):
        assert unnamed not in rendered, rendered
    assert hvdmagic.last_run().stacks == error.stacks  # kept as shown


# Ranks that print nothing, ever: rank 1 sleeps in a function from another cell, rank 0 waits for it in
# a collective. The stall clock runs from the ranks' start, not from a first line that never comes.
SILENT_DEADLOCK = {
    "horovod": ("import torch, horovod.torch as hvd\nhvd.init()\nif hvd.rank() == 1:\n    slow_step(120)\n"
                "hvd.allreduce(torch.ones(1))\n", "allreduce"),
    "torchrun": ("import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                 "if dist.get_rank() == 1:\n    slow_step(120)\ndist.all_reduce(torch.ones(1))\n", "all_reduce"),
}
STALL = 4  # --stall-timeout, seconds
# What the error may take beyond --stall-timeout: the ranks' start (spawned or forked), the stacks'
# collection (STACKS_WAIT) and the stop. Horovod's own stall warning, which once set the clock off,
# comes only after 60 s.
STALL_SLACK = 35


def _assert_the_sleeper_is_named_first(error, defined: int, own: int, collective: str) -> None:
    assert isinstance(error, JobTimeout), error
    assert f"rank(s) 0, 1 made no progress for {STALL} s (--stall-timeout)" in str(error), error
    assert re.search(rf"^Rank 1 is in `slow_step` \(Cell In\[{defined}\], line 4\); rank 0 waits in `{collective}` "
                     rf"\(Cell In\[{own}\], line 6\): ", str(error)), error


@pytest.mark.parametrize("magic", ["horovod", "torchrun"])
@pytest.mark.parametrize("where", ["local", "spark"])
def test_the_stall_timeout_catches_a_deadlock_among_ranks_that_never_printed(ip, magic, where):
    if where == "spark":  # the embedded Spark's start (once per kernel) is not the cell's to time
        from hvdmagic.launch.spark import session_for
        from hvdmagic.launch.spark_session import on_spark_thread

        on_spark_thread(session_for, 2)
    defined = ip.run_cell("".join(SLOW_STEP), store_history=True).execution_count
    code, collective = SILENT_DEADLOCK[magic]
    np = "-2" if where == "local" else "2"
    started = time.monotonic()
    outcome = ip.run_cell(f"%%{magic} --np {np} --stall-timeout {STALL}\n{code}", store_history=True)
    took = time.monotonic() - started
    _assert_the_sleeper_is_named_first(outcome.error_in_exec, defined, outcome.execution_count, collective)
    assert took < STALL + STALL_SLACK, f"the stall timeout fired after {took:.1f} s, not about {STALL} s"


def test_the_stall_timeout_catches_a_silent_deadlock_in_a_session_cell(ip):
    with _horovod_session(ip):
        defined = ip.run_cell("".join(SLOW_STEP), store_history=True).execution_count
        started = time.monotonic()
        outcome = ip.run_cell(f"%%horovod --stall-timeout {STALL}\n\nif hvd.rank() == 1:\n    slow_step(120)\n"
                              "hvd.allreduce(torch.ones(1))\n", store_history=True)
        took = time.monotonic() - started
        error = outcome.error_in_exec
        assert isinstance(error, JobTimeout) and f"made no progress for {STALL} s" in str(error), error
        assert re.search(rf"Rank 1 is in `slow_step` \(Cell In\[{defined}\], line 4\); rank 0 waits in `allreduce`",
                         str(error)), error
        assert took < STALL + STALL_SLACK, f"the stall timeout fired after {took:.1f} s, not about {STALL} s"
