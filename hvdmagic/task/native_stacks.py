"""A rank's native frames too, where py-spy is installed: what its C++ (a collective) is doing.

The rank's fault handler gives every thread's Python stack, but a thread inside C++ shows
only as the Python call that entered it (``synchronize``). py-spy reads the process from
outside (ptrace), with the native frames, and nothing in the rank has to cooperate. It is
optional: where it is not installed, or cannot attach (ptrace not allowed, another user's
process), the stacks stay Python's only. The kernel reads its JSON (``hvdmagic.stacks``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

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
