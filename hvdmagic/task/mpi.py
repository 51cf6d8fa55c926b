"""--controller mpi, the task's side: adopt the rank that mpirun started for this task.

mpirun's daemon starts a small shim per rank (``hvdmagic.rank.mpi_shim``). The
shim finds its task's supervisor through a Unix socket in a directory private
to this user, proves it belongs to the job with a token derived from the job's
secret, and receives the pipes the supervisor would have given a rank it
spawned itself. From there on, output, events, aborts and exit codes travel
exactly as with Gloo. The task that leads a host also runs mpirun's daemon
command for the driver (``Supervisor._exec``), as ssh would.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import signal
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

from hvdmagic.protocol import read_message, send_message


def socket_dir(job_id: str) -> Path:
    """Where a host's supervisors wait for their ranks' shims: private to this user."""
    return Path(tempfile.gettempdir()) / f"hvdmagic-mpi-{job_id}"


def rank_token(secret: bytes, job_id: str) -> str:
    """What a shim shows its supervisor: derived from the job's secret, never the secret itself."""
    return hmac.new(secret, b"mpi-rank:" + job_id.encode(), hashlib.sha256).hexdigest()


def as_root_env() -> dict[str, str]:
    """Open MPI refuses to run as root unless told twice; containers often run as root."""
    if os.geteuid() != 0:
        return {}
    return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def listen_for_rank(job_id: str, rank: int) -> socket.socket:
    """The Unix socket where the shim of ``rank`` will find this task's supervisor."""
    directory = socket_dir(job_id)
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / f"rank-{rank}.sock"
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    listener.settimeout(0.2)
    return listener


def close_listener(listener: socket.socket) -> None:
    path = listener.getsockname()
    listener.close()
    Path(path).unlink(missing_ok=True)
    try:
        Path(path).parent.rmdir()  # the last of the host's supervisors removes the directory
    except OSError:
        pass


def adopt_rank(listener: socket.socket, token: str, env: dict[str, str], events_w: int,
               aborted: threading.Event) -> AdoptedRank | None:
    """Wait for this rank's shim and hand it the rank's pipes; None if the job is aborted first."""
    while not aborted.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(30)
        try:
            if not hmac.compare_digest(str(read_message(conn).get("token", "")), token):
                raise ValueError("wrong token")
            stdin_r, stdin_w = os.pipe()
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            child_ends = [stdin_r, out_w, err_w, events_w]
            try:
                socket.send_fds(conn, [b"F"], child_ends)
                send_message(conn, {"env": env, "cwd": os.getcwd()})
            finally:
                for fd in child_ends[:3]:
                    os.close(fd)
            pid = int(read_message(conn)["pid"])
        except (OSError, ValueError, KeyError):
            conn.close()  # not our shim, or it died on the way: keep waiting
            continue
        conn.settimeout(None)
        return AdoptedRank(conn, pid, os.fdopen(stdin_w, "wb"), os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
    return None


class AdoptedRank:
    """A rank that mpirun started, with the part of Popen's interface the supervisor uses.

    Its pid leads its own process group (the shim starts it in a new session),
    so the supervisor signals it as it would a rank it spawned.
    """

    def __init__(self, conn: socket.socket, pid: int, stdin, stdout, stderr):
        self.pid, self.stdin, self.stdout, self.stderr = pid, stdin, stdout, stderr
        self.returncode: int | None = None
        self._conn = conn
        self._done = threading.Event()
        threading.Thread(target=self._wait_for_exit, name="hvdmagic-mpi-rank", daemon=True).start()

    def _wait_for_exit(self) -> None:
        try:
            code = int(read_message(self._conn)["code"])
        except (OSError, ValueError, KeyError):
            # The shim was killed (mpirun tearing the job down): its rank must not outlive it.
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
