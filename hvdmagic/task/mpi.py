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
import socket
import tempfile
import threading
from pathlib import Path

from hvdmagic.protocol import read_message, send_message
from hvdmagic.task.adopted_rank import AdoptedRank, RankPipes


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
        pipes = None
        try:
            if not hmac.compare_digest(str(read_message(conn).get("token", "")), token):
                raise ValueError("wrong token")
            pipes = RankPipes(events_w)
            try:
                socket.send_fds(conn, [b"F"], pipes.child_ends)
                send_message(conn, {"env": env, "cwd": os.getcwd()})
            finally:
                pipes.handed_over()
            pid = int(read_message(conn)["pid"])
        except (OSError, ValueError, KeyError):
            if pipes is not None:
                pipes.close()
            conn.close()  # not our shim, or it died on the way: keep waiting
            continue
        return pipes.adopt(conn, pid)
    return None
