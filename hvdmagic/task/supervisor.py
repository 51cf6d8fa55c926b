"""One task's side of a job: its rank's supervisor, from hello to the rank's exit.

The same code runs inside a Spark task and, in local mode, in a thread on the
driver. It connects to the driver's channel, says hello, waits for the driver's
go with its place in the layout (the rendezvous must be initialised before any
rank touches it), then runs its rank (``task.rank_process``) and forwards what
the driver says to it. The modes differ only in what they feed the rank:
one-shot hands it the cell's payload; a session hands it each cell as it comes;
an elastic task runs a rank each time the driver says go, and stays after it
exits; under ``--controller mpi`` mpirun starts the rank and the task adopts it.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from hvdmagic import channel, protocol
from hvdmagic.blob_transfer import BlobError
from hvdmagic.protocol import (
    BLOB_DIR_ENV,
    CUDA_DEVICE_ENV,
    JOB_ID_ENV,
    PYTHON_ENV,
    SHARD_ENV,
    SOCKET_DIR_ENV,
    SUPERVISOR_ENV,
    TASK_GPUS_ENV,
    TOKEN_ENV,
    Boot,
    Event,
    Payload,
    Slot,
    TaskSpec,
)
from hvdmagic.rank.blobs import fail
from hvdmagic.task import mpi, rank_template
from hvdmagic.task.blob_cache import BlobCache, fetched_in_background
from hvdmagic.task.blob_relay import BlobRelay
from hvdmagic.task.environment import rank_base_environment, rank_environment
from hvdmagic.task.kernel_link import KernelLink
from hvdmagic.task.lines import MAX_LINE
from hvdmagic.task.network import interface_for
from hvdmagic.task.rank_process import RankProcess, spawn
from hvdmagic.task.shards import pad_shard
from hvdmagic.task.versions import versions

# The longest a task whose rank has ended goes on serving hosts that read a blob from it (the job's
# end stops it sooner): ten minutes, 1 GiB at under 2 MB/s.
RELAY_LINGER = 600.0


class Supervisor:
    """``gpus`` are the GPU addresses Spark assigned to this task, already mapped to
    physical device numbers."""

    def __init__(self, spec: TaskSpec, task_index: int, gpus: list[str] | None = None,
                 shard: tuple[str, int] | None = None, attempt: int = 0):
        self.spec = spec
        self.task_index = task_index
        self.gpus = list(gpus or [])
        self.shard = shard  # (path of this task's Arrow shard, its rows) with --data
        self.attempt = attempt  # Spark's attempt number of this task: an elastic host's name tells attempts apart
        self.rank: RankProcess | None = None
        self._link: KernelLink | None = None
        self._link_address = ""  # this task's end of the channel: its host's address toward the driver
        self._aborted = threading.Event()
        self._daemons: list[subprocess.Popen] = []  # mpirun's daemon, when this task leads its host
        self._blobs: BlobCache | None = None
        self._blob_server = (spec.driver_host, spec.blob_port)
        self._relay: BlobRelay | None = None  # passes the blobs this task fetches on to other hosts
        self._cells: queue.Queue = queue.Queue()  # a session's cells, fed in order once their blobs are here

    def run(self) -> int:
        self._link = link = KernelLink(self.spec.driver_host, self.spec.channel_port, self.spec.secret,
                                       self.spec.reconnect_grace)
        link.open()
        try:
            # The address this host uses to reach the driver names the host, and its
            # interface is the one the ranks can reach each other on. The driver
            # places every task from the hellos and answers each with its own go; a
            # Spark barrier allGather would do the same but costs a second (it polls).
            self._link_address = host_ip = link.address
            self._blobs = BlobCache()
            if self.spec.session or self.spec.payload.blobs:
                self._relay = BlobRelay(host_ip, self.spec.secret, self._blobs.directory)
            # While the ranks gather and start, the payload's blobs come to this host.
            fetched = (None if self.spec.session else
                       fetched_in_background(self._blobs, self.spec.payload.blobs, self._blob_server,
                                             self.spec.secret, self._relay))
            link.send(protocol.hello(self.task_index, self.attempt, host_ip, self.gpus,
                                     self.shard[1] if self.shard else None, socket.gethostname(), os.getpid(),
                                     versions()))
            return self._run_elastic(fetched) if self.spec.elastic else self._run_once(fetched)
        finally:
            self._end_daemons()
            if self._relay is not None:
                # Hosts still reading from this one finish from here, while the job runs (its end closes
                # the link, which sets _aborted): a slow host at the chain's end needs no second copy.
                self._relay.close(linger=RELAY_LINGER, stop=self._aborted)
            # The rank's last events (its result, its exit) reach the kernel before the task ends, through
            # an outage too: the kernel learns a rank's end from them, never from the task's silence.
            link.finish()
            link.close()

    def _run_once(self, fetched) -> int:
        """One rank for the job's life: a one-shot cell, or a session's cells as they come."""
        go = self._link.recv()
        if go.get("type") != Event.GO:
            return -1
        slot = protocol.slot_of(go)
        if self.shard:
            # Every rank runs the same number of steps: pad to the longest shard.
            pad_shard(Path(self.shard[0]), int(go["rows_per_rank"]))
        self.rank = RankProcess(slot.rank, self._send, self._send_raw, self._link)
        threading.Thread(target=self._listen, name="hvdmagic-abort-listener", daemon=True).start()
        env = self._rank_env(slot, go.get("devices"))
        boot = Boot(slot.rank, self.spec.results, session=self.spec.session)
        if not self.rank.start(env, boot, self._mpi_starter(slot) if self.spec.controller == "mpi"
                               else self._starter(slot.rank)):
            # aborted before mpirun started this rank
            self._send(protocol.exit_(slot.rank, -signal.SIGTERM, aborted=True))
            return -signal.SIGTERM
        if self.spec.session:
            threading.Thread(target=self._feed_cells, name="hvdmagic-cells", daemon=True).start()
        else:
            self._feed(self.spec.payload, fetched)
        if self._aborted.is_set():
            self.rank.kill()
        return self.rank.wait()

    def _run_elastic(self, fetched) -> int:
        """Horovod's elastic driver starts a rank here each time it gives this task a slot:
        first, and again after the task's host comes back from the blacklist. The task
        outlives its ranks, so a rank that dies never fails the Spark stage."""
        starts: queue.Queue = queue.Queue()
        threading.Thread(target=self._listen, args=(starts,), name="hvdmagic-abort-listener", daemon=True).start()
        while (go := starts.get()) is not None:
            self.rank = RankProcess(self.task_index, self._send, self._send_raw, self._link)
            env = self._rank_env(protocol.slot_of(go), go.get("devices"))
            env["HOROVOD_ELASTIC"] = "1"
            self.rank.start(env, Boot(self.task_index, self.spec.results, elastic=True), self._starter(self.task_index))
            self._feed(self.spec.payload, fetched)
            if self._aborted.is_set():
                self.rank.kill()
            self.rank.wait()
        return 0

    def _feed(self, payload: Payload, fetched=None, cell_id: int | None = None, ranks: list[int] | None = None) -> None:
        """Hand the rank ``payload`` once its blobs are on this host (``fetched`` waits for a fetch
        already under way); a payload that cannot come makes the rank fail with why. ``ranks``: a
        session's cell that runs on those ranks only."""
        try:
            if fetched is not None:
                fetched()
            else:
                self._blobs.ensure(payload.blobs, self._blob_server, self.spec.secret, relay=self._relay)
        except OSError as exc:  # a BlobError, or the link or disk failing under it
            reason = str(exc) if isinstance(exc, BlobError) else f"fetching the cell's data from the kernel: {exc}"
            payload = Payload(pickle.dumps((fail, (f"{reason} (host {socket.gethostname()})",), {})))
        self.rank.feed(payload, cell_id, ranks)

    def _feed_cells(self) -> None:
        while (message := self._cells.get()) is not None:
            ranks = message.get("ranks")
            if ranks is not None and self.rank.row not in ranks:
                continue  # a cell on other ranks (--ranks): this one stays idle, its state untouched
            self._feed(protocol.cell_payload(message), cell_id=message.get("id"), ranks=ranks)

    def _starter(self, rank: int):
        """Fork the rank from the host's template (``task.rank_template``); spawn it where that cannot be."""
        if not self.spec.template:
            return spawn

        def start(env: dict[str, str], events_w: int):
            try:
                template = rank_template.HostTemplate(self.spec.template_secret, self.spec.template, env)
                return template.fork(env, events_w, lambda stage: self._send(protocol.stage_reached(stage, rank=rank)))
            except rank_template.Refused as exc:
                self._send(protocol.note(f"hvdmagic: {{ranks}} on {socket.gethostname()}: spawned, not forked "
                                         f"from the host's template: {exc}.", rank=rank, ranked=True))
                return spawn(env, events_w)

        return start

    def _mpi_starter(self, slot: Slot):
        """mpirun starts this rank (through the daemon this task's host runs): wait for it and adopt it."""
        listener = mpi.listen_for_rank(self.spec.job_id, slot.rank)

        def adopt(env: dict[str, str], events_w: int):
            try:
                self._send(protocol.ready(self.task_index))
                return mpi.adopt_rank(listener, self._token(), env, events_w, self._aborted)
            finally:
                mpi.close_listener(listener)

        return adopt

    def _rank_env(self, slot: Slot, devices) -> dict[str, str]:
        env = rank_base_environment(os.environ)
        env.update(self.spec.env)
        rendezvous = (self.spec.driver_host, self.spec.rendezvous_port)
        env.update(rank_environment(slot, rendezvous, interface_for(self._link_address), self.spec.controller,
                                    self.spec.framework, self.spec.job_id, dict(self.spec.env)))
        env[JOB_ID_ENV] = self.spec.job_id
        env[SUPERVISOR_ENV] = str(os.getpid())
        env[BLOB_DIR_ENV] = str(self._blobs.directory)
        if self.shard:
            env[SHARD_ENV] = self.shard[0]
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"], first = devices[0], devices[1]
            env[TASK_GPUS_ENV] = ",".join(self.gpus)
            env[CUDA_DEVICE_ENV] = str(first)
        return env

    def _send(self, event: dict) -> None:
        try:
            self._link.send(event)
        except OSError:
            # The kernel is gone (the link reconnects through outages, and ends only past its grace):
            # nobody will read our output, so stop the rank.
            self.abort()

    def _send_raw(self, frame: bytes) -> None:
        try:
            self._link.send_raw(frame)
        except OSError:
            self.abort()

    def _listen(self, starts: queue.Queue | None = None) -> None:
        """What the driver says while the rank runs; abort (or a lost driver) ends it."""
        try:
            while (message := self._link.recv()).get("type") != Event.ABORT:
                kind = message.get("type")
                if kind == Event.EXEC:
                    self._exec(message)
                elif kind == Event.CELL and self.rank is not None:
                    # The payload came over the channel, so its frame passed the job's HMAC check; its
                    # blobs are fetched on another thread, so that Stop still reaches this one.
                    self._cells.put(message)
                elif kind == Event.INTERRUPT and self.rank is not None:
                    self.rank.signal(signal.SIGINT)
                elif kind in (Event.DEBUG, Event.DEBUG_INPUT) and self.rank is not None \
                        and message.get("rank") == self.rank.row:
                    # The rank's debugger reads these between its cells, on its stdin (rank.debugger); they
                    # came over the channel, so they passed the job's HMAC check, and the kernel sent them
                    # to this task alone (Job.send_to).
                    self.rank.control(message)
                elif kind == Event.GO and starts is not None:
                    starts.put(message)
                elif kind == Event.STOP_RANK and self.rank is not None:
                    self.rank.kill()
                elif kind == Event.STACKS and self.rank is not None:
                    threading.Thread(target=self.rank.send_stacks, name="hvdmagic-stacks", daemon=True).start()
        except (channel.ChannelError, OSError):
            pass  # a lost kernel (gone, or away past the reconnect grace) means the same as abort
        self._cells.put(None)
        self.abort()
        if starts is not None:
            starts.put(None)

    def abort(self) -> None:
        self._aborted.set()
        if self.rank is not None:
            self.rank.kill()
        self._end_daemons(grace=0)

    def _token(self) -> str:
        return mpi.rank_token(self.spec.secret, self.spec.job_id)

    def _exec(self, message: dict) -> None:
        """Run mpirun's daemon for this host, as ssh would, and report its exit.

        Open MPI 4's orted daemonizes, so the shell usually returns at once and
        mpirun itself stops the daemon; the shell is tracked for those that do not.
        """
        env = rank_base_environment(os.environ)
        env.update(mpi.as_root_env())
        env.update({SOCKET_DIR_ENV: str(mpi.socket_dir(self.spec.job_id)), TOKEN_ENV: self._token(),
                    PYTHON_ENV: sys.executable})
        daemon = subprocess.Popen(["/bin/sh", "-c", str(message.get("command", ""))], env=env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        self._daemons.append(daemon)
        row = self.rank.row if self.rank is not None else self.task_index

        def report() -> None:
            for line in daemon.stdout:
                text = line.decode("utf-8", "replace").rstrip()[:MAX_LINE]
                self._send(protocol.output(row, "stderr", [f"[mpi daemon] {text}"]))
            self._send(protocol.rsh_exit(daemon.wait(), id=message.get("id")))

        threading.Thread(target=report, name="hvdmagic-mpi-daemon", daemon=True).start()

    def _end_daemons(self, grace: float = 30.0) -> None:
        """mpirun ends its daemons once every rank is done; one still here after ``grace`` is stopped."""
        for daemon in self._daemons:
            try:
                daemon.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            if daemon.poll() is None:
                try:
                    os.killpg(daemon.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def run_task(spec: TaskSpec, task_index: int, gpus: list[str] | None = None,
             shard: tuple[str, int] | None = None, attempt: int = 0) -> int:
    return Supervisor(spec, task_index, gpus, shard, attempt).run()
