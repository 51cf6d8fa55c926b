"""Everything that travels between the processes of a job, named once.

Every process imports this module, a rank included, so it imports nothing but
the standard library. Events are JSON objects whose ``"type"`` is an ``Event``;
``Event`` is a ``StrEnum``, so a member compares equal to the string that
travels and ``json.dumps`` writes it as that string.

    kernel (driver)  <-- channel (HMAC frames) -->  task supervisor  <-- pipes -->  rank
"""

from __future__ import annotations

import base64
import json
import pickle
import signal
import socket
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any, Literal, NamedTuple, TypedDict


class Event(StrEnum):
    # task -> driver
    HELLO = "hello"  # task index, host address, GPUs, shard rows: the driver places every task from these
    OUTPUT = "output"  # a rank's stdout/stderr lines, and its latest \r update
    EXIT = "exit"  # a rank's exit code; "aborted" when the supervisor's own signal ended it
    RESOURCES = "resources"  # what a rank's processes use (CPU, RSS, GPUs), sampled by its supervisor
    READY = "ready"  # --controller mpi: the task listens for its rank's shim
    FLIGHT_RECORD = "flight_record"  # the digest of the rank's NCCL flight recorder dump (hvdmagic.flight_records)
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
    DEBUG_PROMPT = "debug_prompt"  # the rank's pdb waits for a line: what it wrote since its last prompt, the prompt
    DEBUG_END = "debug_end"  # the rank's pdb ended (q, or Stop), or there was no traceback to debug
    HELD = "held"  # a fresh cell's failed rank waits "seconds" for %debug (--hold-on-error), its traceback kept
    # rank <-> its task only, on the rank's event socket, never relayed: the rank asks ("id"), and its task
    # answers ("delivered") once the kernel has acknowledged every event the rank sent before it
    SYNC = "sync"
    # driver -> task
    GO = "go"  # the task's slot, devices and rows per rank: start the rank
    ABORT = "abort"  # stop the rank now
    CELL = "cell"  # a session: run this payload ("id", "payload": a Payload's fields; "ranks": which run it)
    DEBUG = "debug"  # a session: pdb.post_mortem on the rank's kept traceback, its I/O as DEBUG_* messages
    DEBUG_INPUT = "debug_input"  # a line for the rank's pdb ("line"; None: end it, as EOF at a terminal does)
    INTERRUPT = "interrupt"  # a session: SIGINT to the rank, as Ctrl-C in a terminal
    STOP_RANK = "stop_rank"  # elastic: end this task's rank process; the task stays for a later go
    STACKS = "stacks"  # driver -> task: dump the rank's Python stacks; task -> driver: the dump ("text")
    EXEC = "exec"  # --controller mpi: run mpirun's daemon command here
    # rsh agent <-> driver <-> task (--controller mpi)
    RSH = "rsh"
    RSH_EXIT = "rsh_exit"
    # the channel server -> driver
    GONE = "gone"  # a task's connection closed (its executor was lost, or the task ended), or its grace ran out
    # the channel server -> driver -> the views: a task's connection broke ("lost": true, "since"), or came back
    CONTACT = "contact"
    # the resumable channel's own frames, either way (attach, acknowledgements, beats): never passed on
    LINK = "link"
    # driver -> the run's views only
    LAUNCHING = "launching"
    PLACED = "placed"
    LOST = "lost"  # elastic: a rank's process or task was lost ("reason"); the others go on
    WORLD = "world"  # elastic: a rank's world rank and size (after it joined or came back from a reset)
    SHIPPING = "shipping"  # the payload's blobs on their way to the hosts: bytes asked for and received, by host
    RESUMED = "resumed"  # elastic: the ranks reset: the sizes before and after, why, the commit restored
    # a Spark ML model's transform: an executor's Python worker -> the kernel's progress server
    PREDICTED = "predicted"  # a task's rows predicted so far, and its state


class Stage(StrEnum):
    """The stages of a run, in order, as the dashboard names them while it waits."""

    SPARK_STARTING = "starting the embedded Spark"  # the kernel's first cell only
    PREPARING_DATA = "preparing the DataFrame"  # an estimator's checks and counts of its DataFrame
    WAITING_FOR_SLOTS = "waiting for slots"
    SUBMITTED = "stage submitted"
    RANKS_STARTING = "rank processes starting"
    TEMPLATE = "importing into the template"  # a task starts its host's template (rank.template)
    FORKING = "forking from the template"  # the rank's process, ready-imported
    IMPORTING = "importing"  # the rank's interpreter runs the cell, up to `import horovod`
    HVD_INIT = "hvd.init"  # horovod is imported and not yet initialised
    FIRST_STEP = "first step"  # horovod is initialised; nothing reported yet
    TRAINING = "training"  # the rank's first output, progress or metric


STAGE_ORDER = {stage: i for i, stage in enumerate(Stage)}


# Events that show a rank is doing work (its watchdog's "last progress").
PROGRESS_EVENTS = frozenset({Event.OUTPUT, Event.REPORT, Event.RESULT})

# Environment variables a supervisor sets for its rank.
EVENT_FD_ENV = "HVDMAGIC_EVENT_FD"  # the rank's end of its event socket
# Seconds at most a task waits, while its connection is up, for the kernel to acknowledge what its rank
# sent before a sync: a kernel on a loaded machine acknowledges late (5 s was too short at a load of 16);
# while the connection is down it does not wait at all (KernelLink.delivered).
SYNC_WAIT = 30.0
JOB_ID_ENV = "HVDMAGIC_JOB_ID"
SUPERVISOR_ENV = "HVDMAGIC_SUPERVISOR_PID"  # the process of the rank's task: its parent, unless a template forked it
SHARD_ENV = "HVDMAGIC_SHARD"  # the rank's Arrow shard (--data)
TASK_GPUS_ENV = "HVDMAGIC_TASK_GPUS"
CUDA_DEVICE_ENV = "HVDMAGIC_CUDA_DEVICE"  # the rank's device index within CUDA_VISIBLE_DEVICES
# --controller mpi: what mpirun's helpers need to find the job.
RSH_ENV = "HVDMAGIC_RSH"  # driver host, channel port and secret, for the rsh agent mpirun starts
SOCKET_DIR_ENV = "HVDMAGIC_MPI_DIR"  # where a host's supervisors wait for their ranks' shims
TOKEN_ENV = "HVDMAGIC_MPI_TOKEN"  # what a shim shows its supervisor
PYTHON_ENV = "HVDMAGIC_PYTHON"
LEGACY_KERAS_SET_ENV = "HVDMAGIC_SET_LEGACY_KERAS"  # hvdmagic, not the user, chose Keras 2 for the rank
STACKS_ENV = "HVDMAGIC_STACKS_FILE"  # where the rank's fault handler writes its stacks when asked
BLOB_DIR_ENV = "HVDMAGIC_BLOB_DIR"  # the host's blob cache (task.blob_cache), where a rank maps its payload's blobs
STACKS_SIGNAL = signal.SIGUSR2
# Set by a supervisor that can read a dying rank with py-spy: the rank then waits in its crash
# handler until read (rank.crash_hold, task.native_stacks.CrashWatch).
CRASH_HOLD_ENV = "HVDMAGIC_CRASH_HOLD"
# In a STACKS event's text, after the fault handler's dump: py-spy's JSON dump of the rank with
# its native frames (task.native_stacks), or one line saying why py-spy could not read it.
NATIVE_STACKS_MARK = "--- hvdmagic: py-spy dump --native ---"
# What a session's rank writes to its stdout and stderr (the file descriptors, after flushing
# them) when a cell ends, just before its "idle": its supervisor relays that idle only once both
# streams have passed the mark, so a cell's last lines are never counted in the next cell.
CELL_END_MARK = b"\x1ehvdmagic:cell-end\x1e"  # asks a rank for its stacks (faulthandler.register: no Python code runs)


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
class Blob:
    """A large buffer of a payload, sent apart from it and named by its content.

    A task fetches each blob its host lacks from the kernel's blob server (``blob_transfer``)
    into the host's cache (``task.blob_cache``), once per host; ranks map it from there.
    """

    digest: str  # BLAKE3 of the content, hex: a fetched blob is checked against it
    size: int
    label: str = ""  # what it holds, for messages: "X (numpy.ndarray)"


@dataclass(frozen=True)
class Payload:
    """What the ranks run: the pickled ``(fn, args, kwargs)``, its large buffers out of band.

    ``head`` is a protocol-5 pickle whose out-of-band buffers are the blobs ``buffers``
    names, in order; a captured global's own buffers are named inside it
    (``CellFunction.global_buffers``). ``blobs`` lists every blob the ranks map. A head too
    large to travel inline is itself a blob, ``head_blob``, and ``head`` is then empty.
    """

    head: bytes
    buffers: tuple[str, ...] = ()
    blobs: tuple[Blob, ...] = ()
    head_blob: str | None = None

    @property
    def size(self) -> int:
        return len(self.head) + sum(blob.size for blob in self.blobs)

    def to_json(self) -> dict:
        return {"head": base64.b64encode(self.head).decode("ascii"), "buffers": list(self.buffers),
                "blobs": [[b.digest, b.size, b.label] for b in self.blobs], "head_blob": self.head_blob}

    @classmethod
    def from_json(cls, fields: dict) -> Payload:
        return cls(base64.b64decode(fields["head"]), tuple(fields["buffers"]),
                   tuple(Blob(*blob) for blob in fields["blobs"]), fields["head_blob"])


@dataclass(frozen=True)
class TaskSpec:
    """Everything a task needs, shipped in the Spark closure (or handed to a thread)."""

    job_id: str
    driver_host: str
    channel_port: int
    rendezvous_port: int
    secret: bytes
    payload: Payload
    blob_port: int = 0  # the kernel's blob server, on driver_host: where the payload's blobs come from
    env: tuple[tuple[str, str], ...] = ()  # job-wide extra variables for every rank (e.g. HOROVOD_TIMELINE)
    controller: str = "gloo"  # or "mpi": mpirun starts the ranks, and the task adopts its own
    results: str = "all"  # which ranks send their value back: a ResultPolicy
    framework: str = "horovod"  # whose collectives the ranks use: a Framework
    session: bool = False  # the ranks stay up and run cells as they come (launch.warm_ranks)
    elastic: bool = False  # Horovod elastic: a task runs a rank each time the driver says go (launch.elastic)
    # The modules a host's rank template imports, its ranks forked from it (task.rank_template); () spawns each
    # rank. The secret is the kernel's: a template outlives the job that started it.
    template: tuple[str, ...] = ()
    template_secret: bytes = b""
    # Seconds a task whose connection to the kernel broke goes on reconnecting, its rank training and its
    # events buffered, before it gives up and ends its rank (task.kernel_link).
    reconnect_grace: float = 120.0


class Framework(StrEnum):
    """Whose collectives the ranks use, and so which rendezvous and environment they get."""

    HOROVOD = "horovod"  # %%horovod: Horovod's Gloo rendezvous (or mpirun), HOROVOD_* variables
    TORCH = "torch"  # %%torchrun: torch.distributed's env:// rendezvous, torchrun's variables


class ResultPolicy(StrEnum):
    """Which ranks send their return value back to the kernel, and what an unpicklable one does."""

    ALL = "all"  # hvdmagic.run: every rank's, in rank order; an unpicklable value fails its rank
    ALL_OR_REPR = "all_or_repr"  # the magic: every rank's, an unpicklable one replaced by its repr (an UnsentResult)
    RANK0 = "rank0"  # HorovodRunner: rank 0's only (the others are never used); an unpicklable one fails rank 0


# -- the messages -------------------------------------------------------------
# Each message is a JSON object, so each is a TypedDict: the views and the record read
# them as the dicts they arrive as, and the metrics path (thousands of events a second)
# pays for no conversion into objects. Each is built by its function below and nowhere
# else, so a field added here reaches every mode. ``rank`` on a rank's own event is added
# by its supervisor as it relays the line (``task.lines.relayed``).


def _builder(shape: type, kind: Event, **defaults):
    """The function that builds a ``shape`` message: its fields positionally, in the order
    they are declared, or by name; a missing or unknown field is a TypeError."""
    fields = [name for name in shape.__annotations__ if name != "type"]
    required = shape.__required_keys__ - {"type"}

    def build(*values, **named):
        message = {"type": kind, **defaults, **dict(zip(fields, values)), **named}
        if len(values) > len(fields) or required - message.keys():
            raise TypeError(f"{shape.__name__} takes {', '.join(fields)}; got {values} {named}")
        if unknown := message.keys() - shape.__annotations__.keys():
            raise TypeError(f"{shape.__name__} has no field {', '.join(sorted(unknown))}")
        return message

    build.__name__ = build.__qualname__ = kind.name.lower()
    build.__doc__ = f"A {shape.__name__} message ({kind.value!r}): {', '.join(fields)}."
    return build


# task -> driver
class Hello(TypedDict):
    type: Literal[Event.HELLO]
    task: int  # the task's index in the stage
    attempt: int  # Spark's attempt number: an elastic task's Horovod host name tells attempts apart
    host: str  # the task's address toward the driver: names its host in the layout
    gpus: list[str]  # the devices Spark gave the task
    rows: int | None  # --data: the rows of the task's shard
    hostname: str
    pid: int
    versions: dict[str, str | None]  # its Python's and the packages' that must match the kernel's


class Output(TypedDict):
    type: Literal[Event.OUTPUT]
    rank: int
    stream: str  # "stdout" or "stderr"
    lines: list[str]  # complete lines
    transient: str | None  # the latest \r update of the line being written, or None


class Exit(TypedDict):
    type: Literal[Event.EXIT]
    rank: int
    code: int  # the process's return code: negative for a signal
    aborted: bool  # the supervisor's own signal ended it


class Ready(TypedDict):
    type: Literal[Event.READY]
    task: int


class Resources(TypedDict):
    type: Literal[Event.RESOURCES]
    rank: int
    cpu: float  # percent of one core, summed over the rank's process tree (200 = two cores busy)
    rss: int  # bytes, summed over the rank's process tree
    gpus: list[dict]  # per GPU the rank uses (task.resources.gpu_usage): index, util, used, total, rank_used


# rank -> driver (a rank's own events; "rank" is added by its supervisor)
class Result(TypedDict, total=False):
    type: Literal[Event.RESULT]
    data: str | None  # the cloudpickled value, base64; None when the policy does not send it back
    unpicklable: str  # ResultPolicy.ALL_OR_REPR: the type of a value that could not be pickled
    repr: str
    reason: str
    cell: int  # a session's cell
    world_rank: int  # elastic: the rank at the end of the run
    rank: int


class Error(TypedDict, total=False):
    type: Literal[Event.ERROR]
    exc_type: str
    message: str
    traceback: str  # the user's frames only
    time: float  # when it was raised: the driver tells the first failure from its fallout
    cell: int  # a session's cell
    broken: bool  # a session: the ranks' collectives cannot be trusted any more
    rank: int


class Note(TypedDict, total=False):
    type: Literal[Event.NOTE]
    text: str
    once: str  # a note a rank sends once per run, whoever calls for it
    rank: int
    # Its text has "{ranks}" where the ranks that sent it go: the kernel shows one note naming them all.
    ranked: bool


class StageReached(TypedDict, total=False):
    type: Literal[Event.STAGE]
    stage: Stage
    rank: int  # absent: the driver reached it
    # A rank's, with stage IMPORTING: the framework it starts importing ("tensorflow"), "" once that
    # import is done (rank.framework_imports); absent from every other stage message.
    importing: str


class Idle(TypedDict):
    type: Literal[Event.IDLE]
    cell: int | None  # the cell it finished; None when the rank first comes up
    rss: int  # bytes


class DebugPrompt(TypedDict, total=False):
    type: Literal[Event.DEBUG_PROMPT]
    text: str  # what pdb wrote since its last prompt ("> <horovod-cell-3>(5)<module>()", p's answer)
    prompt: str  # "(Pdb) "
    raised: str  # the exception it debugs, "ValueError: bad input"
    cell: int | None  # the session's cell that raised it
    rank: int


class DebugEnd(TypedDict, total=False):
    type: Literal[Event.DEBUG_END]
    text: str  # what pdb wrote since its last prompt
    kept: bool  # False: the rank holds no traceback (no cell failed on it), and no pdb ran
    rank: int


class Held(TypedDict, total=False):
    type: Literal[Event.HELD]
    seconds: float  # how long it waits for a DEBUG before it ends
    rank: int


class Worker(TypedDict, total=False):
    type: Literal[Event.WORKER]
    key: str  # Horovod's "host:local_rank"
    secret: str  # the notification service's, base64
    addresses: dict[str, list[list]]  # by interface: [address, port] pairs
    world_rank: int
    size: int


class Sync(TypedDict, total=False):
    type: Literal[Event.SYNC]
    id: int  # the rank's count of its syncs: an answer to an earlier one, come late, is told apart
    delivered: bool  # in the task's answer only: whether the kernel had it all (KernelLink.delivered)


class Reset(TypedDict, total=False):
    type: Literal[Event.RESET]
    commit: dict  # the plain values of the commit it restored
    world_rank: int
    size: int


# driver -> task
class Go(TypedDict):
    type: Literal[Event.GO]
    slot: dict  # a Slot's fields
    devices: list | None  # [CUDA_VISIBLE_DEVICES, the rank's index in it], or None without GPUs
    rows_per_rank: int | None  # --data: every shard is padded to this many rows


class Cell(TypedDict):
    type: Literal[Event.CELL]
    id: int
    payload: dict  # Payload.to_json(): its blobs come from the session's blob server
    ranks: list[int] | None  # the ranks that run it (--ranks); None: every rank. The others stay idle


class Debug(TypedDict):
    type: Literal[Event.DEBUG]
    rank: int  # the one rank whose pdb starts; the job sends it to that rank's task alone


class DebugInput(TypedDict):
    type: Literal[Event.DEBUG_INPUT]
    rank: int
    line: str | None  # what the user typed at the prompt; None ends pdb, as EOF does


class Exec(TypedDict):
    type: Literal[Event.EXEC]
    id: int
    command: str


class Bare(TypedDict):
    """ABORT, INTERRUPT, STOP_RANK, HEARTBEAT, GONE and the driver's STACKS carry nothing but their kind."""

    type: Event


class Contact(TypedDict, total=False):
    type: Literal[Event.CONTACT]
    lost: bool  # the connection broke (True), or the task is back (False)
    since: float  # time.time() when it broke
    rank: int  # added by the job, for the views
    host: str


class Gone(TypedDict, total=False):
    type: Literal[Event.GONE]
    why: str  # "closed": the task closed its connection (its process ended); "grace": it did not come back in time
    since: float | None  # time.time() when its connection broke, for "grace"
    grace: float


class LinkFrame(TypedDict, total=False):
    """The resumable channel's own frame (channel.Peer, task.kernel_link)."""

    type: Literal[Event.LINK]
    attach: str  # task -> kernel, a connection's first frame: the task's name for its place
    new: bool  # its first connection
    received: int  # how many of the other side's frames this side has
    attached: bool  # kernel -> task: the place is the task's, with "received"
    refused: str  # kernel -> task: no place for it, and why
    ack: int  # either way: how many of the other side's frames this side has (also a beat)
    sync: bool  # task -> kernel: acknowledge now


def type_marker(kind: Event) -> bytes:
    """How an encoded message of ``kind`` starts, as every builder here encodes it (``json.dumps`` with
    compact separators): a relayed frame's kind, read without decoding it."""
    return b'{"type":"' + kind.encode()


# rsh agent <-> driver <-> task
class Rsh(TypedDict):
    type: Literal[Event.RSH]
    host: str
    command: str


class RshExit(TypedDict, total=False):
    type: Literal[Event.RSH_EXIT]
    code: int
    id: int  # the EXEC request it answers (task -> driver only)


# driver -> the run's views
class Launching(TypedDict):
    type: Literal[Event.LAUNCHING]
    description: str
    job_group: str | None
    channel: list  # [host, port]
    backend: str  # where the tasks run, as the run's header names it: "spark", "spark connect", "local"


class Placed(TypedDict):
    type: Literal[Event.PLACED]
    rank: int
    host: str


class Lost(TypedDict):
    type: Literal[Event.LOST]
    rank: int
    reason: str


class World(TypedDict):
    type: Literal[Event.WORLD]
    rank: int  # the task's row
    world_rank: int
    size: int | None


class Stacks(TypedDict):
    type: Literal[Event.STACKS]
    rank: int
    # What the rank's fault handler wrote: every thread's stack ("" if it wrote nothing), then,
    # where py-spy is installed, NATIVE_STACKS_MARK and its dump.
    text: str


class FlightRecord(TypedDict):
    type: Literal[Event.FLIGHT_RECORD]
    rank: int
    digest: dict  # hvdmagic.flight_records.summarise: the last entries, and where the whole dump is


class Shipping(TypedDict):
    type: Literal[Event.SHIPPING]
    text: str  # "sending X (numpy.ndarray) to 2 hosts: 61 %, 380 MB/s"
    requested: int  # bytes the hosts asked for so far
    sent: int  # bytes the hosts received, from the kernel or from each other
    hosts: dict[str, int]  # bytes received, by the address of the host that asked
    done: bool  # every byte asked for was received
    from_kernel: int  # of ``sent``, the bytes the kernel itself sent (the rest went host to host)


class Resumed(TypedDict):
    type: Literal[Event.RESUMED]
    reset: Any  # launch.elastic.Reset: driver-side only, never on the wire


class Predicted(TypedDict):
    type: Literal[Event.PREDICTED]
    task: str  # Spark's stage.partition.attempt (task.transform_reports)
    rows: int  # predicted so far
    state: str  # "running", "done" or "failed"


hello = _builder(Hello, Event.HELLO)
output = _builder(Output, Event.OUTPUT, transient=None)
exit_ = _builder(Exit, Event.EXIT)
ready = _builder(Ready, Event.READY)
resources = _builder(Resources, Event.RESOURCES)
result = _builder(Result, Event.RESULT)
error = _builder(Error, Event.ERROR)
note = _builder(Note, Event.NOTE)
stage_reached = _builder(StageReached, Event.STAGE)
idle = _builder(Idle, Event.IDLE)
reset = _builder(Reset, Event.RESET)
sync = _builder(Sync, Event.SYNC)
exec_command = _builder(Exec, Event.EXEC)
rsh = _builder(Rsh, Event.RSH)
rsh_exit = _builder(RshExit, Event.RSH_EXIT)
launching = _builder(Launching, Event.LAUNCHING)
placed = _builder(Placed, Event.PLACED)
contact = _builder(Contact, Event.CONTACT)
gone = _builder(Gone, Event.GONE)
link_frame = _builder(LinkFrame, Event.LINK)
lost = _builder(Lost, Event.LOST)
world = _builder(World, Event.WORLD)
resumed = _builder(Resumed, Event.RESUMED)
stacks = _builder(Stacks, Event.STACKS)
flight_record = _builder(FlightRecord, Event.FLIGHT_RECORD)
shipping = _builder(Shipping, Event.SHIPPING)
predicted = _builder(Predicted, Event.PREDICTED)
debug = _builder(Debug, Event.DEBUG)
debug_input = _builder(DebugInput, Event.DEBUG_INPUT)
debug_prompt = _builder(DebugPrompt, Event.DEBUG_PROMPT)
debug_end = _builder(DebugEnd, Event.DEBUG_END)
held = _builder(Held, Event.HELD)


def ends_a_cell(line: bytes) -> bool:
    """Whether a rank's event line is its "idle" after a cell (the one at start-up names no cell)."""
    return b'"type":"idle"' in line and json.loads(line).get("cell") is not None


def follows_output(line: bytes) -> bool:
    """Whether a rank's event line comes after a mark on its streams (``rank.outcome.mark_output_end``):
    its "idle" after a cell (the one at start-up names no cell), or its error. Checked on the raw
    line, which the supervisor relays without decoding it."""
    return b'"type":"error"' in line or ends_a_cell(line)


def bare(kind: Event) -> Bare:
    return {"type": kind}


def go(slot: Slot, devices: list | None, rows_per_rank: int | None = None) -> Go:
    return {"type": Event.GO, "slot": slot.to_dict(), "devices": devices, "rows_per_rank": rows_per_rank}


def slot_of(message: Go) -> Slot:
    return Slot(**message["slot"])


def cell(cell_id: int, payload: Payload, ranks: list[int] | None = None) -> Cell:
    return {"type": Event.CELL, "id": cell_id, "payload": payload.to_json(), "ranks": ranks}


def cell_payload(message: Cell) -> Payload:
    return Payload.from_json(message["payload"])


def worker(key: str, secret: bytes, addresses: dict, **world_fields: int) -> Worker:
    return {"type": Event.WORKER, "key": key, "secret": base64.b64encode(secret).decode("ascii"),
            "addresses": {nic: [list(address) for address in listed] for nic, listed in addresses.items()},
            **world_fields}


def report_line(progress_json: str, metrics_json: str | None) -> str:
    """A REPORT event as the JSON line a rank writes, encoded by hand: log_metrics calls this
    thousands of times a second, and the pieces are JSON already."""
    metrics = f',"metrics":{metrics_json}' if metrics_json else ""
    return f'{{"type":"{Event.REPORT}","progress":{progress_json}{metrics}}}\n'


# -- what a rank runs ---------------------------------------------------------------
# One framing carries a payload from the kernel to a rank, for a one-shot cell (which
# travels in the TaskSpec) and a session's cells (in CELL messages) alike. The supervisor
# writes the rank's Boot, then each payload, to the rank's stdin: a pipe to its own child,
# fed only from the TaskSpec or from frames that passed the job's HMAC check. Only a
# payload's head (small: its large buffers are blobs the rank maps from its host's cache)
# goes down the pipe. A session's rank also reads control messages there, between a cell's
# payloads (``write_control``: its debugger's start and its input lines).


@dataclass(frozen=True)
class Boot:
    """What a supervisor tells its rank before any payload."""

    rank: int  # the rank's row: its rank, or an elastic task's index
    results: str = "all"  # a ResultPolicy
    session: bool = False  # run payloads as they come, in one namespace, until stdin closes
    elastic: bool = False


_LENGTH = 8


def write_boot(stream, boot: Boot) -> None:
    _write_frame(stream, pickle.dumps(boot))


def read_boot(stream) -> Boot | None:
    body = _read_frame(stream)
    return None if body is None else pickle.loads(body)


class CellRequest(NamedTuple):
    """A payload as a rank reads it from its stdin (``read_request``)."""

    cell: int | None  # the session's cell; None for a one-shot cell
    payload: Payload  # its ``blobs`` stay with the supervisor, which fetched them
    ranks: tuple[int, ...] | None = None  # a session cell run on these ranks only (--ranks); None: on every rank


def write_payload(stream, payload: Payload, cell_id: int | None = None, ranks: list[int] | None = None) -> None:
    """One payload: its cell's id (None for a one-shot cell), blob names and the ranks that run it
    (None: every rank), then its head."""
    _write_frame(stream, json.dumps([cell_id, payload.buffers, payload.head_blob, ranks]).encode())
    _write_frame(stream, payload.head)


def write_control(stream, message: dict) -> None:
    """A control message for a session's rank, between its cells (a DEBUG, a DEBUG_INPUT): one frame,
    a JSON object where a payload's header is a JSON list."""
    _write_frame(stream, json.dumps(message).encode())


def read_request(stream) -> CellRequest | dict | None:
    """The next thing written on a rank's stdin: a ``CellRequest`` (``write_payload``), a control
    message (``write_control``), or None at EOF."""
    header = _read_frame(stream)
    if header is None:
        return None
    fields = json.loads(header)
    if isinstance(fields, dict):
        return fields
    head = _read_frame(stream)
    if head is None:
        return None
    cell_id, buffers, head_blob, *rest = fields  # a header of three: written before --ranks existed
    ranks = rest[0] if rest else None
    return CellRequest(cell_id, Payload(head, tuple(buffers), (), head_blob), None if ranks is None else tuple(ranks))


def read_payload(stream) -> tuple[int | None, Payload] | None:
    """The next ``(cell id, payload)`` written by ``write_payload``, or None at EOF (a one-shot
    rank's stdin carries no control message)."""
    request = read_request(stream)
    return (request.cell, request.payload) if isinstance(request, CellRequest) else None


def _write_frame(stream, body: bytes) -> None:
    stream.write(len(body).to_bytes(_LENGTH, "big"))
    stream.write(body)
    stream.flush()


def _read_frame(stream) -> bytes | None:
    header = _read_exactly(stream, _LENGTH)
    return None if header is None else _read_exactly(stream, int.from_bytes(header, "big"))


def _read_exactly(stream, size: int) -> bytes | None:
    data = stream.read(size)  # a buffered reader returns short only at EOF
    return data if len(data) == size else None


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
