"""Counting what a run leaves behind: rank processes, threads, sockets."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import threading

import psutil
from helpers import wait_until

from hvdmagic.rank.template import TEMPLATE_NAME

# The environment variable by which every process a test process starts says whose it is (conftest.py).
TEST_PROCESS_ENV = "HVDMAGIC_TEST_PROCESS"


def own_temp_dir(tag: str) -> str:
    """A temp directory of this test process's own (``tag`` ends with its pid), short enough for the
    AF_UNIX sockets under it. Those of test processes that have ended go: not at this one's end, since
    IPython's history and atexit work still write under it then."""
    for old in glob.glob("/tmp/hvdmagic-test-*-*"):
        pid = old.rsplit("-", 1)[1]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    path = os.path.join("/tmp", f"hvdmagic-test-{tag}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def ours(proc: psutil.Process) -> bool:
    """Whether ``proc`` was started by this test process (or its environment cannot be read, as a
    process of another user's: then it counts, as before the tag)."""
    try:
        return proc.environ().get(TEST_PROCESS_ENV) == os.environ.get(TEST_PROCESS_ENV)
    except psutil.AccessDenied:
        return True
    except psutil.NoSuchProcess:
        return False


def rank_processes(parent: int | None = None) -> list[psutil.Process]:
    """Rank processes started from this process, or from process ``parent`` (Spark's ranks descend from its JVM).

    A rank forked from a host's template (hvdmagic.rank.template) descends from the template, which
    descends from the task that started it until that task's process ends: the template's
    ``--owner=`` (the kernel, or the executor's JVM) says whose it is then."""
    root = psutil.Process(parent or os.getpid())
    tree = root.children(recursive=True)
    under = {root.pid} | {proc.pid for proc in tree}
    candidates = list(tree)
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.pid not in under and proc.name() == TEMPLATE_NAME and _owner(proc) in under:
                candidates.extend(proc.children())
    found = []
    for proc in candidates:
        try:
            # A template is no rank: the ranks it forks share its cmdline.
            if "hvdmagic.rank" in proc.cmdline() and proc.name() != TEMPLATE_NAME:
                found.append(proc)
        except psutil.Error:  # exited (or a zombie) while we looked
            continue
    return found


def _owner(template: psutil.Process) -> int | None:
    for arg in template.cmdline():
        if arg.startswith("--owner="):
            return int(arg.removeprefix("--owner="))
    return None


def wait_until_gone(pids, within: float, what: str = "rank processes") -> None:
    """Fail with a clear message if any of ``pids`` still runs after ``within`` seconds."""
    wait_until(lambda: not alive(pids), within, lambda: f"{what} {alive(pids)} still ran {within:g} s later")


def alive(pids) -> list[int]:
    """Those of ``pids`` whose processes still run (a zombie has exited)."""
    running = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
    return running


def inet_sockets(process: psutil.Process | None = None) -> list:
    """The process's (default: this one's) internet sockets: psutil >= 6 calls it net_connections,
    the psutil 5.9 of Databricks' runtimes connections."""
    process = process or psutil.Process(os.getpid())
    connections = getattr(process, "net_connections", None) or process.connections
    return connections(kind="inet")


def kernel_resources() -> dict[str, int]:
    me = psutil.Process(os.getpid())
    return {
        "threads": threading.active_count(),
        "sockets": len(inet_sockets(me)),
        "fds": me.num_fds(),
        "children": len(me.children(recursive=True)),
        "rss": me.memory_info().rss,
    }


def wait_until_no_mpi_processes(within: float = 10.0, what: str = "mpirun, a daemon or a shim outlived the cell"):
    """Fail, naming them, if mpirun, its daemons, agents or rank shims that this test process started
    still run ``within`` seconds from now (orted daemonizes, so it is nobody's child here: its
    inherited tag says whose it is, and another pytest-xdist worker's MPI runs do not count)."""
    wait_until(lambda: not _mpi_processes(), within, lambda: f"{what}: {_mpi_processes()}")


def _mpi_processes() -> list[str]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status", "ppid"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue  # exited; its new parent (init) reaps it in its own time
        if (proc.info["name"] in ("mpirun", "orterun", "orted") or "hvdmagic.launch.mpi_" in cmdline) \
                and ours(proc):
            found.append(f"{proc.info['name']} {proc.pid} ({proc.info['status']}, parent {proc.info['ppid']}) "
                         f"{cmdline[:120]}")
    return found


def registered_rank(marker: str, host_prefix: str) -> tuple[psutil.Process, psutil.Process] | None:
    """The rank process whose Horovod host starts with ``host_prefix``, and its task's supervisor, as
    the rank wrote them (``elastic_training.train``'s ``<marker>.<host>.pids``); None if none did."""
    for path in sorted(glob.glob(f"{glob.escape(marker)}.{host_prefix}*.pids")):
        try:
            rank, supervisor = (int(pid) for pid in open(path).read().split())
            return psutil.Process(rank), psutil.Process(supervisor)
        except (OSError, ValueError, psutil.NoSuchProcess):
            continue
    return None
