"""A rank's native frames too, where py-spy is installed: what its C++ (a collective) is doing.

The rank's fault handler gives every thread's Python stack, but a thread inside C++ shows
only as the Python call that entered it (``synchronize``). py-spy reads the process from
outside (ptrace), with the native frames, and nothing in the rank has to cooperate. It is
optional: where it is not installed, or cannot attach (ptrace not allowed, another user's
process), the stacks stay Python's only. The kernel reads its JSON (``hvdmagic.stacks``).

A rank that a crash signal kills is read too (``CrashWatch``): where py-spy is here, the rank's
crash hold (``rank.crash_hold``) keeps it alive until it has been read.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from hvdmagic import stacks
from hvdmagic.protocol import NATIVE_STACKS_MARK
from hvdmagic.rank import crash_hold

# Seconds py-spy gets. Most of its time goes to reading the libraries' symbols (libtorch's are
# large), before it pauses the rank: about 1 s here, the pause itself under 0.2 s; a busy host
# took over 3 s. A watchdog waits this long (launch.job.STACKS_WAIT) before it stops the ranks.
WAIT = 6.0


def find() -> str | None:
    """The py-spy of the environment this task runs in: beside its Python (a virtualenv that is
    not activated), else on PATH; None when there is none."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def dump(pid: int, wait: float = WAIT) -> str:
    """py-spy's JSON dump of process ``pid``, native frames included; a line saying why py-spy could
    not read it (it failed, or took longer than ``wait``); "" where py-spy is not installed."""
    program = find()
    if program is None:
        return ""
    try:
        done = subprocess.run([program, "dump", "--native", "--json", "--pid", str(pid)],
                              capture_output=True, text=True, timeout=wait, errors="replace")
    except subprocess.TimeoutExpired:
        return f"py-spy did not answer within {wait:g} s"
    except OSError as exc:
        return f"py-spy could not run: {exc}"
    if done.returncode != 0 or not done.stdout.lstrip().startswith("["):
        # Its first line says why (e.g. "Permission denied (os error 13)" where ptrace is refused).
        said = next((line.strip().removeprefix("Error: ") for line in (done.stderr + done.stdout).splitlines()
                     if line.strip()), "")
        return f"py-spy could not read the rank: {said or f'exit code {done.returncode}'}"
    return done.stdout.strip()


# How the fault handler names each crash signal in its first line ("Fatal Python error: Aborted").
# Any other fatal error (Py_FatalError's own message) ends in abort(): SIGABRT.
_FAULTS = {"Segmentation fault": signal.SIGSEGV, "Aborted": signal.SIGABRT, "Bus error": signal.SIGBUS,
           "Floating point exception": signal.SIGFPE, "Illegal instruction": signal.SIGILL}
HOLD_START_WAIT = 2.0  # seconds from the fault handler's first line to the hold: it writes every thread's stack
HOLD_POLL = 0.01


def can_hold() -> bool:
    """Whether a dying rank should wait to be read (``rank.crash_hold``): py-spy is here, and the
    rank's crash hold can be installed (Linux, glibc, x86_64 or aarch64)."""
    return sys.platform == "linux" and crash_hold.supported() and find() is not None


class CrashWatch:
    """Reads the native frames of a rank that a crash signal is killing, while its crash hold keeps
    it (``rank.crash_hold``), then lets it die of its signal.

    ``saw`` gets the rank's stderr lines as they come: the fault handler's first line starts it.
    That line alone proves nothing (any program may print it), so the process must also be in the
    hold: the signal's handler is back to the default action (``SA_RESETHAND`` did that as the hold
    began), which ``/proc/<pid>/status`` shows. ``lines`` gives, once the rank's stderr has ended,
    what to relay after the fault handler's dump: ``NATIVE_STACKS_MARK`` and ``stacks.died_in``.
    """

    def __init__(self, proc, enabled: bool):
        self._proc = proc
        self._enabled = enabled
        self._thread: threading.Thread | None = None
        self._lines: list[str] = []

    def saw(self, lines: list[str]) -> None:
        if not self._enabled or self._thread is not None:
            return
        for line in lines:
            if line.startswith(stacks.FATAL_ERROR):
                what = line.removeprefix(stacks.FATAL_ERROR).strip()
                self._thread = threading.Thread(target=self._read, args=(_FAULTS.get(what, signal.SIGABRT),),
                                                 name="hvdmagic-crash-frames", daemon=True)
                self._thread.start()
                return

    def lines(self) -> list[str]:
        if self._thread is not None:
            self._thread.join(HOLD_START_WAIT + WAIT + 1)
        return self._lines

    def _read(self, sig: signal.Signals) -> None:
        pid = self._proc.pid
        deadline = time.monotonic() + HOLD_START_WAIT
        while not held(pid, sig):
            if self._proc.returncode is not None or time.monotonic() > deadline:
                return  # it died at once (no hold), or it never crashed: nothing to read, nothing to end
            time.sleep(HOLD_POLL)  # the other process's state: nothing to wait on
        try:
            # The hold lasts as many seconds as the signal's number (4 for SIGILL): py-spy ends before.
            dump_text = dump(pid, min(WAIT, int(sig) - 1))
            if dump_text:
                self._lines = [NATIVE_STACKS_MARK, *stacks.died_in(dump_text).splitlines()]
        finally:
            if self._proc.returncode is None:
                try:
                    os.kill(pid, sig)  # the default action now: it dies of its own signal
                except ProcessLookupError:
                    pass


def held(pid: int, sig: int) -> bool:
    """Whether process ``pid`` waits in its crash hold for ``sig``: alive, and no longer catching ``sig``."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "").strip().startswith(("Z", "X")):
        return False
    caught = int(fields.get("SigCgt", "0").strip(), 16)
    return not caught >> (int(sig) - 1) & 1
