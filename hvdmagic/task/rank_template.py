"""Ranks forked from the host's template (``rank.template``), the task's side: find it or start it, and ask.

A template is one per host, kernel, executor, Python and rank environment: its socket's name
hashes them, so a task whose ranks would get another environment (another ``OMP_NUM_THREADS``, a
variable the user set) finds another template, never a wrong one. Tasks of one host
serialise its start with a lock file; the first waits while it imports (the stage "importing
into the template"), the others then find it ready. Everything here fails soft: the
caller spawns its rank as before, with the reason as a note.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hvdmagic.protocol import Stage, read_message, send_message
from hvdmagic.task.adopted_rank import AdoptedRank, RankPipes

TEMPLATE_ENV = "HVDMAGIC_TEMPLATE"  # "0": every rank is spawned, as before templates
IMPORTS_ENV = "HVDMAGIC_TEMPLATE_IMPORTS"  # more modules for templates to import ahead, comma-separated
IDLE_ENV = "HVDMAGIC_TEMPLATE_IDLE"  # seconds a template with no rank and no request lives on
IDLE = 1800.0
# Idle templates this many stay per user and host (each holds its imports: about 230 MB with torch); the
# oldest idle one beyond them ends, so a kernel that tried several environments keeps the newest ones.
IDLE_CAP_ENV = "HVDMAGIC_TEMPLATE_IDLE_CAP"
IDLE_CAP = 3
START_WAIT = 300.0  # seconds a template may take to import (TensorFlow from a cold disk)
ASK_WAIT = 30.0  # seconds a ready template may take to answer one request

# What a supervisor sets for its own rank after the fork: per rank or per job, and read by the
# frameworks when the cell calls them (hvd.init, init_process_group, the first CUDA call), not
# when they are imported. Everything else in the rank's environment is the template's.
OWN_PREFIXES = ("HOROVOD_", "HVDMAGIC_", "TORCHELASTIC_", "TORCH_NCCL_", "TORCH_FR_", "OMPI_", "PMIX_")
OWN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
            "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME",
            "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES")  # CUDA: the template asserts it never initialised it


class Refused(Exception):
    """Why this rank cannot be forked: it is spawned instead, and the run's notes say why."""


class _Gone(OSError):
    """The template's socket took no connection: it has just ended, or was never there."""


def enabled() -> bool:
    return os.environ.get(TEMPLATE_ENV, "1") != "0"


def extra_imports() -> tuple[str, ...]:
    return tuple(name.strip() for name in os.environ.get(IMPORTS_ENV, "").split(",") if name.strip())


def own(key: str) -> bool:
    return key in OWN_KEYS or key.startswith(OWN_PREFIXES)


def template_environment(rank_env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in rank_env.items() if not own(key)}


def directory() -> Path:
    """Where this user's templates listen: private to the user, or refused."""
    path = Path(tempfile.gettempdir()) / f"hvdmagic-templates-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    stat = path.stat()
    if stat.st_uid != os.getuid() or stat.st_mode & 0o077:
        raise Refused(f"{path} is not private to this user")
    return path


def token(secret: bytes) -> str:
    """What a task shows the template: derived from the kernel's template secret, never the secret."""
    return hmac.new(secret, b"rank-template", hashlib.sha256).hexdigest()


def name(secret: bytes, modules: tuple[str, ...], env: dict[str, str], owned_by: int) -> str:
    """One template per kernel, executor, Python, set of modules and rank environment: two executors
    of one host never share one, so an executor that ends takes no other executor's ranks with it."""
    identity = json.dumps([token(secret), owned_by, sys.executable, list(modules), sorted(env.items())])
    return hashlib.sha256(identity.encode()).hexdigest()[:20]


def owner() -> int:
    """The process whose end ends the template: the executor's JVM under Spark (the nearest ``java``
    among our ancestors), else our own process (the kernel, whose threads run local mode's tasks)."""
    pid = os.getpid()
    for _ in range(8):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            break
        if comm == "java":
            return pid
        pid = int(stat.rsplit(")", 1)[1].split()[1])
        if pid <= 1:
            break
    return os.getpid()


class HostTemplate:
    """This task's way to its host's template for one set of modules and one environment."""

    def __init__(self, secret: bytes, modules: tuple[str, ...], rank_env: dict[str, str]):
        self.modules = modules
        self.env = template_environment(rank_env)
        self._token = token(secret)
        here = directory()
        self.owner = owner()
        stem = here / name(secret, modules, self.env, self.owner)
        self.socket = stem.with_suffix(".sock")
        self.log = stem.with_name(f"{stem.name}-{os.getpid()}-{time.time_ns()}.log")  # each template its own
        self.lock = stem.with_suffix(".lock")  # the template removes it as it ends (rank.template)

    def fork(self, env: dict[str, str], events_w: int, on_stage: Callable[[Stage], None]) -> AdoptedRank:
        """A rank forked from the template with this environment and the task's working directory.
        ``on_stage`` hears the rank's stages: TEMPLATE while this task waits for a template to import,
        then FORKING. A template that has just ended (its modules changed) is started again, once."""
        for _attempt in range(2):
            self._ensure(lambda: on_stage(Stage.TEMPLATE))
            on_stage(Stage.FORKING)
            try:
                return self._ask(env, events_w)
            except _Gone as gone:
                why = gone
        raise Refused(f"the host's template did not answer ({why})")

    def _ensure(self, on_wait) -> None:
        """Find the template, or start it (or wait for the task that starts it) until it has imported."""
        if self._answers():
            return
        on_wait()
        while True:
            with open(self.lock, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # the task that holds it starts the template, within START_WAIT
                if not _still_named(lock, self.lock):
                    continue  # an ending template removed the file we waited on: lock the one there now
                if not self._answers():
                    self._start()
                return

    def _ask(self, env: dict[str, str], events_w: int) -> AdoptedRank:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(ASK_WAIT)
        try:
            conn.connect(str(self.socket))
        except OSError as exc:
            conn.close()
            raise _Gone(exc) from None
        pipes = RankPipes(events_w)
        try:
            try:
                socket.send_fds(conn, [b"F"], pipes.child_ends)
                send_message(conn, {"token": self._token, "env": env, "cwd": os.getcwd()})
            finally:
                pipes.handed_over()
            answer = read_message(conn)
            if "refused" in answer:
                raise Refused(str(answer["refused"]))
            return pipes.adopt(conn, int(answer["pid"]))
        except Refused:
            pipes.close()
            conn.close()
            raise
        except (OSError, ValueError, KeyError) as exc:
            pipes.close()
            conn.close()
            raise Refused(f"the host's template did not answer ({exc})") from None

    def _answers(self) -> bool:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(self.socket))
            return True
        except OSError:
            return False
        finally:
            probe.close()

    def _start(self) -> None:
        orders = {"socket": str(self.socket), "log": str(self.log), "lock": str(self.lock), "token": self._token,
                  "modules": list(self.modules),
                  "owner": self.owner, "idle": float(os.environ.get(IDLE_ENV, IDLE)),
                  "idle_cap": int(os.environ.get(IDLE_CAP_ENV, IDLE_CAP)),
                  "own_keys": list(OWN_KEYS), "own_prefixes": list(OWN_PREFIXES)}
        with open(self.log, "wb") as log:
            # The owner in the command line too, for ps and tools: a rank's ancestry may not show it.
            proc = subprocess.Popen([sys.executable, "-m", "hvdmagic.rank", "--template", f"--owner={self.owner}"],
                                    stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, env=self.env, start_new_session=True)
        # The template stays our child (local mode's ranks then descend from the kernel); the Popen
        # object may go: subprocess reaps a child whose object went once it has exited.
        try:
            proc.stdin.write(json.dumps(orders).encode() + b"\n")
            proc.stdin.close()
            line = _line_within(proc.stdout, START_WAIT)
        finally:
            proc.stdout.close()
        if not line.startswith(b"{"):
            try:  # its stdout closed before its line: it is exiting, and its code says more than a wait would
                why = f"exited with code {proc.wait(timeout=2)} before it started"
            except subprocess.TimeoutExpired:
                proc.kill()
                why = f"did not start within {START_WAIT:.0f} s"
            raise Refused(f"the host's template {why}{_last_words(self.log)}")
        # A module the template could not import fails in the rank too, with the rank's own traceback.


def _still_named(file, path: Path) -> bool:
    """Whether the open ``file`` is still the one at ``path`` (not removed, nor replaced, meanwhile)."""
    try:
        return os.fstat(file.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _line_within(stream, seconds: float) -> bytes:
    deadline = time.monotonic() + seconds
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([stream], [], [], left)[0]:
            return b""
        chunk = os.read(stream.fileno(), 65536)
        if not chunk:
            return data
        data += chunk
    return data


def _last_words(log: Path) -> str:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return f": {lines[-1].strip()}" if lines else ""
