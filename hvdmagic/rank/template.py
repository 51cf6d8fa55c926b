"""A host's rank template: one interpreter that has imported the ranks' frameworks, and forks ranks.

``python -m hvdmagic.rank --template`` (started by a task, ``task.rank_template``) reads its
orders on stdin, leaves its starter's session, imports the modules named (torch and
horovod.torch, or TensorFlow), listens on a Unix socket in a directory private to this
user, and writes one line on stdout when it is ready. Each request proves it comes from a
task of this kernel (a token derived from the kernel's template secret) and brings the
rank's pipes (SCM_RIGHTS), environment and working directory. The template checks that a
fork is still safe, forks, and reports the child's pid and, once it has reaped it, its
exit code. The child becomes the rank (``become_rank``) and runs ``rank.__main__.main``
as a spawned rank would, with the framework already imported.

A fork is refused, and the task spawns its rank as before, when:
- a thread runs that was not there when the imports ended. The imports' own threads are
  OpenBLAS's pools (numpy, scipy) and jemalloc's purge thread (pyarrow, which TensorFlow
  imports): both stop around a fork (pthread_atfork), so they are safe;
- a module the template imported changed on disk (its file's size or time);
- the rank's environment differs beyond what a rank's own variables set after the fork;
- CUDA, Horovod or torch.distributed were initialised here (they never are: nothing else runs).
A template whose modules changed exits after saying so: the next task starts a new one.

The template exits when its owner (the kernel in local mode, the executor's JVM under
Spark) exits, or after ``idle`` seconds with no rank alive and no request. It runs no
thread of its own: one selector loop, and SIGCHLD through a wakeup pipe.
"""

from __future__ import annotations

import ctypes
import fcntl
import hmac
import io
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hvdmagic.protocol import EVENT_FD_ENV, read_message, send_message
from hvdmagic.rank.file_watch import FileWatch

FDS = 4  # the rank's stdin, stdout, stderr and event socket
OWNER_POLL = 1.0  # seconds between checks that the owner lives, where no pidfd can tell at once
PR_SET_PTRACER = 0x59616D61  # Yama: lets the task's py-spy read a rank that is not its descendant
PR_SET_NAME = 15
TEMPLATE_NAME = "hvdmagic-tmpl"  # what ps -o comm and psutil name the template


@dataclass
class Orders:
    """What the task that starts the template tells it, on its stdin (one JSON line)."""

    socket: str
    log: str  # our stderr, for the starter to quote if we fail to start; removed when we end
    lock: str  # the file the tasks start us under (task.rank_template): removed when we end
    token: str
    modules: list[str]
    owner: int
    idle: float
    idle_cap: int  # idle templates of this user on this host that may stay: the oldest idle one beyond them ends
    # Variables a rank sets for itself after the fork: the rest of its environment must be the template's.
    own_keys: list[str]
    own_prefixes: list[str]


@dataclass
class RankOrders:
    """What one request makes of its child: the rank's pipes, environment and directory."""

    fds: list[int]
    env: dict[str, str]
    cwd: str
    tracer: int  # the task's pid: its py-spy may read the rank


class Template:
    def __init__(self, orders: Orders):
        self.orders = orders
        self.import_threads: set[str] = set()
        self.stamps: dict[str, tuple[int, int]] = {}
        self.env = dict(os.environ)
        self.stale = ""  # which module changed on disk: refuse every fork, and end once the ranks have
        self.watch: FileWatch | None = None  # which of the stamped files may have changed (rank.file_watch)

    def load(self) -> None:
        """Import the modules, noting the threads their imports started and the files they came from."""
        before = _threads()
        for name in self.orders.modules:
            try:
                __import__(name)
            except Exception:  # the rank meets the same error when it imports, with its own traceback
                continue
        self.import_threads = _threads() - before
        # A few modules name a relative file (torch's ``_ops.py``): not one to stat from any directory.
        paths = [path for module in list(sys.modules.values())
                 if (path := getattr(module, "__file__", None)) and os.path.isabs(path)
                 and _heavy(module.__name__, self.orders.modules)]
        self.watch = FileWatch(paths)  # first: a change after it is an event, one before it a stamp
        for path in paths:
            try:
                stat = os.stat(path)
            except OSError:
                continue
            self.stamps[path] = (stat.st_size, stat.st_mtime_ns)

    def unsafe(self, env: dict[str, str]) -> str:
        """Why a fork now would not give the rank a spawned rank would be; "" when it is safe."""
        extra = max(len(_threads() - self.import_threads) - 1, threading.active_count() - 1)
        if extra > 0:
            return (f"the template runs {extra} thread(s) besides the libraries' own pools, and a fork could "
                    f"deadlock on a lock one of them holds")
        if self.stale:
            return self.stale
        changed = self.watch.changed() if self.watch is not None else None
        for path in self.stamps if changed is None else changed & self.stamps.keys():
            stamp = self.stamps[path]
            try:
                stat = os.stat(path)
                now = (stat.st_size, stat.st_mtime_ns)
            except OSError:
                now = None
            if now != stamp:
                self.stale = f"{path} changed on disk since the template imported it"
                return self.stale
        return self.environment_differs(env) or initialised()

    def environment_differs(self, env: dict[str, str]) -> str:
        differs = sorted(key for key in set(env) | set(self.env)
                         if env.get(key) != self.env.get(key) and not self.own(key))
        if differs:
            return f"the rank's environment differs from the template's ({', '.join(differs[:5])})"
        return ""

    def own(self, key: str) -> bool:
        return key in self.orders.own_keys or key.startswith(tuple(self.orders.own_prefixes))


def initialised() -> str:
    """What must never be initialised in a process that forks ranks: "" when none is."""
    torch = sys.modules.get("torch")
    if torch is not None:
        if torch.cuda.is_initialized():
            return "CUDA was initialised in the template"
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return "torch.distributed was initialised in the template"
    for name in ("horovod.torch", "horovod.tensorflow"):
        hvd = sys.modules.get(name)
        if hvd is not None and getattr(hvd, "is_initialized", lambda: False)():
            return "Horovod was initialised in the template"
    return ""


def _heavy(module: str, preloaded: list[str]) -> bool:
    """Whether ``module`` belongs to one of the packages the template was asked for."""
    roots = {name.split(".")[0] for name in preloaded}
    return module.split(".")[0] in roots


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def serve(orders: Orders) -> RankOrders | None:
    """The template's life: returns in a forked child (what it must become), or None once the template ends."""
    template = Template(orders)
    template.load()
    _name(TEMPLATE_NAME.encode())  # again: importing torch 2.3 names the main thread (so the process) pt_main_thread
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    Path(orders.socket).unlink(missing_ok=True)
    listener.bind(orders.socket)
    listener.listen(64)
    ours = os.stat(orders.socket).st_ino
    sys.stdout.write(json.dumps({"ready": os.getpid()}) + "\n")
    sys.stdout.flush()
    _quiet_stdout()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup pipe hears it
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    try:
        owner_fd = os.pidfd_open(orders.owner)
        selector.register(owner_fd, selectors.EVENT_READ, "owner")
    except (AttributeError, OSError):
        owner_fd = None
    children: dict[int, socket.socket] = {}
    idle_since = time.monotonic()
    was_busy = None
    while True:
        if bool(children) != was_busy:  # what the other templates read: since when this one is idle
            was_busy = bool(children)
            _say_idle_since(orders.socket, None if was_busy else time.time())
        if template.stale:
            # New tasks find no template here and start a new one; requests already made are refused.
            _unlink_own(orders.socket, ours)
        elif not children and time.monotonic() - idle_since > orders.idle:
            break
        elif not children and _newer_idle_ones(orders.socket) >= orders.idle_cap:
            break
        if owner_fd is None and not _alive(orders.owner):
            break
        events = selector.select(timeout=0 if template.stale else OWNER_POLL)
        if any(key.data == "owner" for key, _ in events) or (template.stale and not events and not children):
            break
        for key, _ in events:
            if key.data == "child":
                _drain(wake_r)
                _reap(children)
                if not children:
                    idle_since = time.monotonic()
            elif key.data == "accept":
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                idle_since = time.monotonic()
                child = _answer(template, conn, children)
                if child is not None:
                    selector.close()
                    listener.close()  # the socket's path stays: it is the template's
                    for fd in (wake_r, wake_w, *([owner_fd] if owner_fd is not None else [])):
                        os.close(fd)
                    return child
    listener.close()
    _unlink_own(orders.socket, ours)
    _remove_start_lock(orders.lock)
    Path(orders.log).unlink(missing_ok=True)
    for conn in children.values():
        conn.close()
    return None


def _answer(template: Template, conn: socket.socket, children: dict[int, socket.socket]) -> RankOrders | None:
    """One request: refuse it, or fork; returns what the child must become (in the child only)."""
    conn.settimeout(10)
    fds: list[int] = []
    try:
        peer_pid = _peer_pid(conn)
        _, fds, _, _ = socket.recv_fds(conn, 1, FDS)
        request = read_message(conn)
        if not hmac.compare_digest(str(request.get("token", "")), template.orders.token) or len(fds) != FDS:
            raise ValueError("not one of this kernel's tasks")
        env, cwd = dict(request["env"]), str(request["cwd"])
    except (OSError, ValueError, KeyError, TypeError):
        _close_all(fds)
        conn.close()
        return None
    reason = template.unsafe(env)
    if reason:
        _close_all(fds)
        _tell(conn, {"refused": reason})
        conn.close()
        return None
    sys.stderr.flush()
    settled_r, settled_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _lead_own_session(settled_r, settled_w)
        conn.close()
        if template.watch is not None:
            template.watch.close()
        for other in children.values():
            other.close()
        return RankOrders(fds, env, cwd, peer_pid)
    _close_all(fds)
    _await_own_session(settled_r, settled_w)
    _tell(conn, {"pid": pid})
    children[pid] = conn
    return None


# The task signals its rank's process group by the pid told here (a Stop, an abort: AdoptedRank), as
# it would a spawned rank, whose Popen returns only after its setsid. A pid told before the child's
# own setsid names no group yet: a killpg then finds nothing (ESRCH), and the rank a Stop was meant
# for, forked as the run failed, ran on past the cell (issue 58, on a loaded machine). So the child
# leaves the template's session first thing, and the template tells its pid only after that.
def _lead_own_session(settled_r: int, settled_w: int) -> None:
    """In the child: a session and process group of its own, then the template may tell its pid."""
    os.setsid()
    os.close(settled_r)
    os.close(settled_w)  # the pipe's last write end: the template's read sees its end


def _await_own_session(settled_r: int, settled_w: int) -> None:
    """In the template: wait until the child leads its own session (or has already ended)."""
    os.close(settled_w)
    try:
        os.read(settled_r, 1)  # b"" once the child closed its write end; nothing is ever written
    finally:
        os.close(settled_r)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _tell(conn: socket.socket, message: dict) -> None:
    """A task that has gone away hears nothing: its rank, if any, sees its pipes close."""
    try:
        send_message(conn, message)
    except OSError:
        pass


# An idle template's socket has the time it went idle as its mtime; a busy one's, this (2100-01-01):
# never the oldest idle one.
_BUSY = 4102444800.0


def _say_idle_since(socket_path: str, since: float | None) -> None:
    try:
        os.utime(socket_path, (time.time(), _BUSY if since is None else since))
    except OSError:
        pass


def _newer_idle_ones(own: str) -> int:
    """How many templates of this user on this host have been idle for less time than this one: each
    idle template ends once the cap's number of them are newer, so the newest ``idle_cap`` stay."""
    try:
        mine = os.stat(own).st_mtime
    except OSError:
        return 0
    newer = []
    for path in Path(own).parent.glob("*.sock"):
        try:
            since = path.stat().st_mtime
        except OSError:
            continue
        if str(path) != own and mine < since < _BUSY:
            newer.append(str(path))
    if not newer:
        return 0
    return len(set(newer) & _listening())  # a killed template's socket file is no template


def _listening() -> set[str]:
    """The paths of the Unix sockets bound on this host (/proc/net/unix's last column)."""
    try:
        with open("/proc/net/unix") as table:
            return {parts[-1] for line in table if len(parts := line.split()) >= 8}
    except OSError:
        return set()


def _remove_start_lock(path: str) -> None:
    """Remove the lock file the tasks start this template under (``task.rank_template``), unless a task
    holds it now (it starts the next template, which removes it in turn). A task that waited on the
    removed file finds it gone once it has the lock, and locks the path's new one."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _unlink_own(path, os.fstat(fd).st_ino)
    except OSError:
        pass  # held, or gone already
    finally:
        os.close(fd)


def _unlink_own(path: str, inode: int) -> None:
    """Remove our file's name (our socket's, our start lock's), unless a new one of the same name (a new
    template of the same kernel and environment) has it now."""
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _peer_pid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    pid, uid = int.from_bytes(creds[:4], "little"), int.from_bytes(creds[4:8], "little")
    if uid != os.getuid():
        raise ValueError("another user's process")
    return pid


def _reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            _tell(conn, {"code": os.waitstatus_to_exitcode(status)})
            conn.close()


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _quiet_stdout() -> None:
    """The starter reads our stdout until the ready line: after it, nothing more goes there."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)


def become_rank(child: RankOrders) -> None:
    """In the forked child: take the rank's pipes, environment, directory and signals, as a spawn would give them."""
    stdin, stdout, stderr, events = child.fds
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    # (The session of its own it took as it was forked: _lead_own_session.)
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as the interpreter sets it at start
    signal.signal(signal.SIGINT, signal.default_int_handler)
    env = dict(child.env)
    env[EVENT_FD_ENV] = str(events)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(child.cwd)
    if sys.path and sys.path[0] == _START_DIR:
        sys.path[0] = child.cwd  # ``python -m`` puts its working directory first
    sys.argv = [sys.argv[0]]
    _allow_tracer(child.tracer)
    _name(Path(sys.executable).name.encode()[:15])  # a rank's, as a spawned rank's
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))  # the ranks' environment sets it: output flows at once
    sys.stdin = _stream(0, "r", unbuffered)
    sys.stdout = _stream(1, "w", unbuffered)
    sys.stderr = _stream(2, "w", unbuffered)
    _reseed()


def _stream(fd: int, mode: str, unbuffered: bool) -> io.TextIOWrapper:
    """A standard stream as the interpreter makes it at start (CPython's ``create_stdio``): unbuffered
    output writes straight to the file descriptor; buffered, stderr is line-buffered."""
    raw = io.FileIO(fd, mode, closefd=False)
    if mode == "r":
        binary = io.BufferedReader(raw)
    else:
        binary = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(binary, encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict",
                            line_buffering=not unbuffered and (fd == 2 or raw.isatty()), write_through=unbuffered)


def _allow_tracer(pid: int) -> None:
    """Under Yama's ptrace_scope 1, only ancestors may read a process: let the task's py-spy read this one."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, pid, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _reseed() -> None:
    """Each fork would draw numpy's legacy global stream from the template's seed; a spawned rank draws its own.
    (``random`` reseeds itself after a fork.)"""
    random = sys.modules.get("numpy.random")
    if random is not None:
        random.seed()


_START_DIR = os.getcwd()


def read_orders(stream) -> Orders:
    return Orders(**json.loads(stream.readline()))


def _name(comm: bytes) -> None:
    """What top and ps -o comm show: the template apart from the ranks it forks (whose cmdline is its own)."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(comm), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main() -> RankOrders | None:
    orders = read_orders(sys.stdin)
    _name(TEMPLATE_NAME.encode())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return serve(orders)
