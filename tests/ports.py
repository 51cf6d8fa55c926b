"""Ports for the servers the tests start that must be told a port before they bind it (the standalone
master and its web UI, Spark Connect, moto, JupyterLab).

Asking the kernel for a free port (bind to 0) and releasing it leaves a window in which anything may
take it: the kernel hands the same ephemeral range to every outgoing connection, and another test
process (a second pytest-xdist worker, a second `make test` beside this one) asks in the same way.
So the ports come from below the ephemeral range, where the kernel hands out none by itself, and
each is reserved for the life of this process by an exclusive lock on a file named after it in a
directory every test process on the machine shares: two test processes never get the same port,
and the lock goes with the process, however it ends.

Standard library only, so that benchmarks can import it without pytest.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import time
from pathlib import Path

# Linux's default ephemeral range starts at 32768; read the machine's own where there is one.
try:
    _EPHEMERAL_LOW = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
except (OSError, ValueError, IndexError):
    _EPHEMERAL_LOW = 32768
_LOW = 20000
_HIGH = max(_LOW + 1000, min(_EPHEMERAL_LOW, 32768))  # exclusive
# Shared across test processes on purpose: the locks are how they keep out of each other's ports. In the
# machine's /tmp, not tempfile's: each test process has a TMPDIR of its own (tests/conftest.py), which a
# pytest-xdist worker inherits from its controller, so tempfile's was one directory per `make test`, and a
# second `make test` beside this one took the same ports (15002 among them).
_LOCKS = Path("/tmp") / "hvdmagic-test-ports"
_held: dict[int, int] = {}  # port -> the fd whose lock reserves it


def reserve_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on, that no other test process will be given, and that
    the kernel will not hand out as an ephemeral port; this process holds it until it exits."""
    _LOCKS.mkdir(mode=0o1777, exist_ok=True)
    for _ in range(2000):
        port = random.randrange(_LOW, _HIGH)
        if port in _held:
            continue
        fd = os.open(_LOCKS / str(port), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another test process holds it
            os.close(fd)
            continue
        if _bindable(host, port):
            _held[port] = fd
            return port
        os.close(fd)  # something outside the tests has it
    raise RuntimeError(f"no free port on {host} in {_LOW}-{_HIGH - 1} after 2000 tries")


@contextlib.contextmanager
def holding(port: int, within: float, host: str = "0.0.0.0"):
    """Hold a fixed ``port`` that a server takes by itself, as ``remote("local[N]")``'s Spark Connect
    server takes 15002 (its client knows no other), for as long as the block runs. Another test process
    that holds it (a second ``make test`` beside this one) is waited for, ``within`` seconds at most,
    and so is the port's last server, until the port can be bound again: on the wildcard address, as
    that server binds it, which anything on the port at any of the machine's addresses keeps from it."""
    _LOCKS.mkdir(mode=0o1777, exist_ok=True)
    fd = os.open(_LOCKS / str(port), os.O_RDWR | os.O_CREAT, 0o666)
    deadline = time.monotonic() + within
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _bindable(host, port):
                    break
                fcntl.flock(fd, fcntl.LOCK_UN)  # its last server is still going: let its holder see it go
            except BlockingIOError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"port {port} on {host} was held or bound by another process for {within:g} s")
            time.sleep(0.2)
        yield port
    finally:
        os.close(fd)


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) == 0
