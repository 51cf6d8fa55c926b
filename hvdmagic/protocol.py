"""Everything that travels between the processes of a job, named once.

Every process imports this module, a rank included, so it imports nothing but
the standard library. Events are JSON objects whose ``"type"`` is an ``Event``;
``Event`` is a ``StrEnum``, so a member compares equal to the string that
travels and ``json.dumps`` writes it as that string.

    kernel (driver)  <-- channel (HMAC frames) -->  task supervisor  <-- pipes -->  rank
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass
from enum import StrEnum


class Event(StrEnum):
    # task -> driver
    HELLO = "hello"  # task index, host address, GPUs, shard rows: the driver places every task from these
    OUTPUT = "output"  # a rank's stdout/stderr lines, and its latest \r update
    EXIT = "exit"  # a rank's exit code; "aborted" when the supervisor's own signal ended it
    READY = "ready"  # --controller mpi: the task listens for its rank's shim
    # rank -> driver (relayed by the supervisor, which appends "rank")
    REPORT = "report"  # progress bars and metric rows
    RESULT = "result"  # the cloudpickled return value, base64
    ERROR = "error"  # the exception type, message and the user's traceback
    HEARTBEAT = "heartbeat"  # alive, for the driver's watchdog
    NOTE = "note"  # a line for the dashboard's notes (scale_lr, --data)
    STAGE = "stage"  # a Stage reached: by the driver (no "rank") or by one rank
    IDLE = "idle"  # a session rank is ready for a cell: "cell" names the one it finished, "rss" its memory
    WORKER = "worker"  # elastic: the rank's notification service (addresses, secret) and its world rank and size
    RESET = "reset"  # elastic: the rank came back from a reset: its world rank and size, the commit it restored
    # driver -> task
    GO = "go"  # the task's slot, devices and rows per rank: start the rank
    ABORT = "abort"  # stop the rank now
    CELL = "cell"  # a session: run this payload ("id", base64 "payload") in the rank's namespace
    INTERRUPT = "interrupt"  # a session: SIGINT to the rank, as Ctrl-C in a terminal
    STOP_RANK = "stop_rank"  # elastic: end this task's rank process; the task stays for a later go
    EXEC = "exec"  # --controller mpi: run mpirun's daemon command here
    # rsh agent <-> driver <-> task (--controller mpi)
    RSH = "rsh"
    RSH_EXIT = "rsh_exit"
    # the channel server -> driver
    GONE = "gone"  # a task's connection closed (its executor was lost, or the task ended)
    # driver -> the run's views only
    LAUNCHING = "launching"
    PLACED = "placed"
    LOST = "lost"  # elastic: a rank's process or task was lost ("reason"); the others go on
    WORLD = "world"  # elastic: a rank's world rank and size (after it joined or came back from a reset)
    RESUMED = "resumed"  # elastic: the ranks reset: the sizes before and after, why, the commit restored


class Stage(StrEnum):
    """The stages of a run, in order, as the dashboard names them while it waits."""

    SPARK_STARTING = "starting the embedded Spark"  # the kernel's first cell only
    WAITING_FOR_SLOTS = "waiting for slots"
    SUBMITTED = "stage submitted"
    RANKS_STARTING = "rank processes starting"
    IMPORTING = "importing"  # the rank's interpreter runs the cell, up to `import horovod`
    HVD_INIT = "hvd.init"  # horovod is imported and not yet initialised
    FIRST_STEP = "first step"  # horovod is initialised; nothing reported yet
    TRAINING = "training"  # the rank's first output, progress or metric


STAGE_ORDER = {stage: i for i, stage in enumerate(Stage)}


# Events that show a rank is doing work (its watchdog's "last progress").
PROGRESS_EVENTS = frozenset({Event.OUTPUT, Event.REPORT, Event.RESULT})

# Environment variables a supervisor sets for its rank.
EVENT_FD_ENV = "HVDMAGIC_EVENT_FD"  # the rank's end of its event pipe
JOB_ID_ENV = "HVDMAGIC_JOB_ID"
SHARD_ENV = "HVDMAGIC_SHARD"  # the rank's Arrow shard (--data)
TASK_GPUS_ENV = "HVDMAGIC_TASK_GPUS"
CUDA_DEVICE_ENV = "HVDMAGIC_CUDA_DEVICE"  # the rank's device index within CUDA_VISIBLE_DEVICES
# --controller mpi: what mpirun's helpers need to find the job.
RSH_ENV = "HVDMAGIC_RSH"  # driver host, channel port and secret, for the rsh agent mpirun starts
SOCKET_DIR_ENV = "HVDMAGIC_MPI_DIR"  # where a host's supervisors wait for their ranks' shims
TOKEN_ENV = "HVDMAGIC_MPI_TOKEN"  # what a shim shows its supervisor
PYTHON_ENV = "HVDMAGIC_PYTHON"
LEGACY_KERAS_SET_ENV = "HVDMAGIC_SET_LEGACY_KERAS"  # hvdmagic, not the user, chose Keras 2 for the rank


@dataclass(frozen=True)
class Slot:
    """Where one rank sits: Horovod's rank, local rank and cross rank, and its host."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    host: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TaskSpec:
    """Everything a task needs, shipped in the Spark closure (or handed to a thread)."""

    job_id: str
    driver_host: str
    channel_port: int
    rendezvous_port: int
    secret: bytes
    payload: bytes
    env: tuple[tuple[str, str], ...] = ()  # job-wide extra variables for every rank (e.g. HOROVOD_TIMELINE)
    controller: str = "gloo"  # or "mpi": mpirun starts the ranks, and the task adopts its own
    results: str = "all"  # which ranks send their value back: a ResultPolicy
    framework: str = "horovod"  # whose collectives the ranks use: a Framework
    session: bool = False  # the ranks stay up and run cells as they come (launch.session)
    elastic: bool = False  # Horovod elastic: a task runs a rank each time the driver says go (launch.elastic)


class Framework(StrEnum):
    """Whose collectives the ranks use, and so which rendezvous and environment they get."""

    HOROVOD = "horovod"  # %%horovod: Horovod's Gloo rendezvous (or mpirun), HOROVOD_* variables
    TORCH = "torch"  # %%torchrun: torch.distributed's env:// rendezvous, torchrun's variables


class ResultPolicy(StrEnum):
    """Which ranks send their return value back to the kernel, and what an unpicklable one does."""

    ALL = "all"  # hvdmagic.run: every rank's, in rank order; an unpicklable value fails its rank
    ALL_OR_REPR = "all_or_repr"  # the magic: every rank's, an unpicklable one replaced by its repr (an UnsentResult)
    RANK0 = "rank0"  # HorovodRunner: rank 0's only (the others are never used); an unpicklable one fails rank 0


def read_message(sock: socket.socket) -> dict:
    """One JSON line from a Unix socket: how an MPI rank's shim and its supervisor talk.

    Both ends are processes of this user on one host, behind a private directory
    and a token derived from the job's secret.
    """
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the other side closed the connection")
        data += chunk
        if len(data) > 1 << 22:
            raise ValueError("message too long")
    return json.loads(data)


def send_message(sock: socket.socket, message: dict) -> None:
    """One JSON line, as read_message reads it."""
    sock.sendall(json.dumps(message).encode() + b"\n")
