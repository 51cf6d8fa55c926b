"""Counting what a run leaves behind: rank processes, threads, sockets."""

from __future__ import annotations

import os
import threading
import time

import psutil


def rank_processes() -> list[psutil.Process]:
    """Rank processes started from this process (Spark's ranks descend from its JVM)."""
    found = []
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if "hvdmagic.rank" in proc.cmdline():
                found.append(proc)
        except psutil.NoSuchProcess:
            continue
    return found


def wait_until_gone(pids, within: float, what: str = "rank processes") -> None:
    """Fail with a clear message if any of ``pids`` still runs after ``within`` seconds."""
    deadline = time.monotonic() + within
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if alive:
            time.sleep(0.1)
    assert not alive, f"{what} {alive} still ran {within:g} s later"


def kernel_resources() -> dict[str, int]:
    me = psutil.Process(os.getpid())
    return {
        "threads": threading.active_count(),
        "sockets": len(me.net_connections(kind="inet")),
        "fds": me.num_fds(),
        "children": len(me.children(recursive=True)),
        "rss": me.memory_info().rss,
    }


def mpi_processes(within: float = 10.0) -> list[str]:
    """mpirun, its daemons, agents and rank shims still running anywhere on the machine
    ``within`` seconds from now (orted daemonizes, so it is nobody's child here)."""
    deadline = time.monotonic() + within
    while (found := _mpi_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _mpi_processes() -> list[str]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status", "ppid"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue  # exited; its new parent (init) reaps it in its own time
        if proc.info["name"] in ("mpirun", "orterun", "orted") or "hvdmagic.launch.mpi_" in cmdline:
            found.append(f"{proc.info['name']} {proc.pid} ({proc.info['status']}, parent {proc.info['ppid']}) "
                         f"{cmdline[:120]}")
    return found
