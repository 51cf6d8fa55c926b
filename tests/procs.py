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
    }
