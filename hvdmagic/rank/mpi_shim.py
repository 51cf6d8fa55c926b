"""The process mpirun starts for each rank: hand it over to its task's supervisor.

mpirun's daemon starts us with Open MPI's variables, in the host's leading
task. We connect to the supervisor of our MPI rank's task (a Unix socket in a
directory private to this user), prove we belong to the job, and receive the
pipes and environment that supervisor would give a rank it spawned itself. The
rank runs as our child, in its task's working directory, so MPI sees the
process it started live on, and the supervisor learns its pid (to signal it)
and its exit code (from us).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from hvdmagic.protocol import EVENT_FD_ENV, SOCKET_DIR_ENV, TOKEN_ENV, read_message, send_message

_MPI_PREFIXES = ("OMPI_", "PMIX_", "OPAL_", "ORTE_")
FDS = 4  # the rank's stdin, stdout, stderr and event socket


def main() -> int:
    rank = os.environ["OMPI_COMM_WORLD_RANK"]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.path.join(os.environ[SOCKET_DIR_ENV], f"rank-{rank}.sock"))
    send_message(sock, {"token": os.environ[TOKEN_ENV]})
    _, fds, _, _ = socket.recv_fds(sock, 1, FDS)
    if len(fds) != FDS:
        raise ConnectionError("the supervisor refused this process")
    stdin, stdout, stderr, events = fds
    setup = read_message(sock)
    env = setup["env"]
    # The rank needs Open MPI's view of where it sits to join the job.
    env.update({k: v for k, v in os.environ.items() if k.startswith(_MPI_PREFIXES)})
    env[EVENT_FD_ENV] = str(events)
    proc = subprocess.Popen([sys.executable, "-m", "hvdmagic.rank"], stdin=stdin, stdout=stdout, stderr=stderr,
                            pass_fds=(events,), env=env, cwd=setup["cwd"], start_new_session=True)
    for fd in fds:
        os.close(fd)
    # Open MPI stops its processes with SIGTERM: pass it on to the rank's own group.
    signal.signal(signal.SIGTERM, lambda sig, _frame: os.killpg(proc.pid, sig))
    send_message(sock, {"pid": proc.pid})
    code = proc.wait()
    send_message(sock, {"code": code})
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
