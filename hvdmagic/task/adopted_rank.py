"""A rank this task did not start itself, with the part of Popen's interface the supervisor uses.

Two things start ranks for a task: mpirun's shim (``--controller mpi``, ``task.mpi``) and the
host's template (``task.rank_template``). Either gets the rank's pipes from the task over a
Unix socket (``RankPipes``), answers with the rank's pid, and later with its exit code.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading

from hvdmagic.protocol import read_message


class RankPipes:
    """The pipes a rank gets, as a spawn would make them: its ends are sent, ours kept."""

    def __init__(self, events_w: int):
        self._stdin_r, self._stdin_w = os.pipe()
        self._out_r, self._out_w = os.pipe()
        self._err_r, self._err_w = os.pipe()
        self.child_ends = [self._stdin_r, self._out_w, self._err_w, events_w]
        self._sent = False

    def handed_over(self) -> None:
        """The child's ends are with the other process (or failed to go): ours need them no more.
        (The rank's end of the event socket is the caller's, who closes it.)"""
        if not self._sent:
            self._sent = True
            for fd in self.child_ends[:3]:
                os.close(fd)

    def close(self) -> None:
        """Nobody will adopt the rank: our ends go too."""
        self.handed_over()
        for fd in (self._stdin_w, self._out_r, self._err_r):
            os.close(fd)

    def adopt(self, conn: socket.socket, pid: int) -> AdoptedRank:
        conn.settimeout(None)
        return AdoptedRank(conn, pid, os.fdopen(self._stdin_w, "wb"), os.fdopen(self._out_r, "rb"),
                           os.fdopen(self._err_r, "rb"))


class AdoptedRank:
    """A rank another process started and reaps: its pid leads its own process group (the shim and
    the template start it in a new session), so the supervisor signals it as it would a rank it spawned."""

    def __init__(self, conn: socket.socket, pid: int, stdin, stdout, stderr):
        self.pid, self.stdin, self.stdout, self.stderr = pid, stdin, stdout, stderr
        self.returncode: int | None = None
        self._conn = conn
        self._done = threading.Event()
        threading.Thread(target=self._wait_for_exit, name="hvdmagic-adopted-rank", daemon=True).start()

    def _wait_for_exit(self) -> None:
        try:
            code = int(read_message(self._conn)["code"])
        except (OSError, ValueError, KeyError):
            # The shim was killed (mpirun tearing the job down), or the template: the rank must not outlive it.
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            code = -signal.SIGKILL
        self._conn.close()
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired("hvdmagic.rank", timeout)
        return self.returncode
