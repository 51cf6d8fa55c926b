"""A rank that a crash signal kills: its native frames, read by py-spy while its crash hold keeps it
alive (rank.crash_hold, task.native_stacks.CrashWatch), under its Python stack in the cell's error."""

from __future__ import annotations

import re

import pytest
from conftest import run
from procs import alive, rank_processes

import hvdmagic
from hvdmagic import stacks
from hvdmagic.errors import JobFailed
from hvdmagic.task import native_stacks

PY_SPY_MISSING = ("py-spy is not installed beside this Python or on PATH: run scripts/setup.sh (hvdmagic's dev "
                  "extras install it, pinned in requirements/lock.txt), or .venv/bin/pip install py-spy==0.4.1")


def _crash(ip, how: str) -> tuple[JobFailed, list[str]]:
    """Rank 1 crashes with ``how`` (a line of Python) while rank 0 sleeps: the error, and rank 1's part
    of it (from its "--- rank 1 ---" line on). Neither rank's process outlived the cell."""
    assert native_stacks.can_hold(), PY_SPY_MISSING
    _, error = run(ip, "%%horovod --np -2\nimport ctypes, os, time\nprint('pid', os.getpid(), flush=True)\n"
                       f"if os.environ['HOROVOD_RANK'] == '1':\n    {how}\ntime.sleep(60)\n")
    assert isinstance(error, JobFailed), error
    rendered = "\n".join(error._render_traceback_())
    died = rendered.split("--- rank 1 ---\n", 1)[1].splitlines()
    crashed = [int(line.split()[-1]) for _, line in hvdmagic.last_run().ranks[1].logs if line.startswith("pid ")]
    assert len(crashed) == 1, hvdmagic.last_run().ranks[1].logs
    # The cell ends once its supervisors reaped their ranks: the crashed one, waiting to be read, too.
    assert not alive(crashed), f"rank 1's process {crashed} outlived the cell"
    assert not rank_processes(), f"rank processes outlived the cell: {rank_processes()}"
    return error, died


def _native_frames(died: list[str]) -> list[str]:
    """The native frames of the thread that crashed, as the error shows them under its Python stack."""
    assert stacks.NATIVE in died, "\n".join(died)
    native = died[died.index(stacks.NATIVE) + 1:]
    assert native[0] == 'Current thread "MainThread":', "\n".join(died)
    return [line.strip() for line in native[1:] if line.startswith("  ")]


def test_a_segfault_in_c_shows_the_native_frame_it_died_in_and_still_its_signal(ip):
    """ctypes reads address 0: the C function that read it is named, under the cell's Python line."""
    error, died = _crash(ip, "ctypes.string_at(0)")
    assert str(error).startswith("rank 1 on ") and "failed: killed by SIGSEGV" in str(error), error
    python = died[:died.index(stacks.NATIVE)]
    assert python[:3] == ["Fatal Python error: Segmentation fault", "", "Current thread:"], died
    # The cell's own line, named as IPython names the cell.
    assert python[-3:-1] == [f"  Cell In[{ip.execution_count}], line 5 in <module>", "    ctypes.string_at(0)"], died
    frames = _native_frames(died)
    # Innermost first: libc's strlen (not exported under its own name: "??"), then ctypes' string_at.
    assert frames[0].endswith("(libc.so.6)"), died
    assert re.fullmatch(r"string_at \(_ctypes\.c:\d+\)", frames[1]), died
    assert "_ctypes_callproc (callproc.c" in "\n".join(frames), died
    assert not any(name in "\n".join(frames) for name in ("sleep", "faulthandler")), died  # the hold is left out
    assert hvdmagic.last_run().stacks == {1: error.failures[0].traceback}, hvdmagic.last_run().stacks


def test_an_abort_shows_abort_and_raise_in_libc_and_still_its_signal(ip):
    """os.abort(), as a C++ library's failed check does: libc's abort and raise, under the cell's line."""
    error, died = _crash(ip, "os.abort()")
    assert "rank 1 on " in str(error) and "failed: killed by SIGABRT" in str(error), error
    assert died[0] == "Fatal Python error: Aborted", died
    assert f"  Cell In[{ip.execution_count}], line 5 in <module>" in died, died
    frames = _native_frames(died)
    assert "raise (libc.so.6)" in frames and "abort (libc.so.6)" in frames, died
    assert frames.index("raise (libc.so.6)") < frames.index("abort (libc.so.6)"), died  # most recent first


def test_a_crash_in_a_thread_without_python_says_py_spy_cannot_read_it(ip):
    """A C thread aborts (as a framework's background thread would): py-spy lists Python's threads only."""
    start = ("libc = ctypes.CDLL(None); thread = ctypes.c_ulong(); "
             "libc.pthread_create(ctypes.byref(thread), None, ctypes.cast(libc.abort, ctypes.c_void_p), None); "
             "time.sleep(30)")
    error, died = _crash(ip, start)
    assert "failed: killed by SIGABRT" in str(error), error
    native = died[died.index(stacks.NATIVE) + 1:]
    assert native[0] == stacks.CRASHED_OUTSIDE_PYTHON, died


def test_a_rank_that_only_prints_the_fault_handlers_words_is_left_alone(ip):
    """The fault handler's first line alone is no crash: the rank is not read, nor sent any signal."""
    assert native_stacks.can_hold(), PY_SPY_MISSING
    # It stays up past the time its supervisor gives a crashing rank to reach the hold.
    result, error = run(ip, "%%horovod --np -2\nimport sys, time\n"
                            "print('Fatal Python error: Segmentation fault', file=sys.stderr, flush=True)\n"
                            f"time.sleep({native_stacks.HOLD_START_WAIT + 1})\n'still here'\n")
    assert error is None and result == "still here", error
    assert not any(line == native_stacks.NATIVE_STACKS_MARK for record in hvdmagic.last_run().ranks
                   for _, line in record.logs), hvdmagic.last_run().ranks[0].logs


@pytest.mark.unit
def test_the_crash_hold_installs_in_well_under_a_millisecond_after_ctypes():
    """A rank's start-up pays for it: ctypes' import (measured apart) and five sigaction calls.

    Its cost is the CPU time it takes: the wall time also counts any wait for a core, which beside
    another test worker on two cores once came to 31 ms (issue 58)."""
    import subprocess
    import sys

    code = ("import os, time, ctypes, signal\nfrom hvdmagic.rank import crash_hold\n"
            "from hvdmagic.task.native_stacks import held\n"
            "before = held(os.getpid(), signal.SIGSEGV)\nt = time.thread_time()\n"
            "assert crash_hold.install()\nprint(time.thread_time() - t, before, held(os.getpid(), signal.SIGSEGV))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert float(out[0]) < 0.005, out  # measured 0.1-0.2 ms here
    assert out[1:] == ["True", "False"], out  # SIGSEGV's default action before, a handler (the hold's) after
