"""One task's side of a job: start a rank process and relay everything it says.

The same code runs inside a Spark barrier task and, in local mode, in a thread
on the driver. It connects to the driver's channel, says hello, waits for the
driver's go with its place in the layout (the rendezvous must be initialised
before any rank touches it), spawns a fresh interpreter for the rank in its own session, and
forwards its output and events until it exits or the driver says abort. In an
elastic job (a plain Spark task) it stays after its rank exits, for the next go.
"""

from __future__ import annotations

import base64
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from hvdmagic import channel
from hvdmagic.protocol import (
    CUDA_DEVICE_ENV,
    EVENT_FD_ENV,
    JOB_ID_ENV,
    PYTHON_ENV,
    SHARD_ENV,
    SOCKET_DIR_ENV,
    TASK_GPUS_ENV,
    TOKEN_ENV,
    Event,
    Slot,
    TaskSpec,
)
from hvdmagic.task import mpi
from hvdmagic.task.environment import rank_base_environment, rank_environment
from hvdmagic.task.lines import MAX_LINE, LineSplitter, relayed
from hvdmagic.task.network import interface_for
from hvdmagic.task.shards import pad_shard

KILL_GRACE = 3.0


class Supervisor:
    """``gpus`` are the GPU addresses Spark assigned to this task, already mapped to
    physical device numbers."""

    def __init__(self, spec: TaskSpec, task_index: int, gpus: list[str] | None = None,
                 shard: tuple[str, int] | None = None, attempt: int = 0):
        self.spec = spec
        self.task_index = task_index
        self.gpus = list(gpus or [])
        self.shard = shard  # (path of this task's Arrow shard, its rows) with --data
        self.proc: subprocess.Popen | None = None
        self.slot: Slot | None = None
        self.row: int | None = None  # what the rank's events are tagged with: its rank, or an elastic task's index
        self._link_address = ""  # this task's end of the channel: its host's address toward the driver
        self.attempt = attempt  # Spark's attempt number of this task: an elastic host's name tells attempts apart
        self._aborted = threading.Event()
        self._sent: set[int] = set()  # the signals kill() delivered to a live rank
        self._daemons: list[subprocess.Popen] = []  # mpirun's daemon, when this task leads its host

    def run(self) -> int:
        link = channel.connect(self.spec.driver_host, self.spec.channel_port, self.spec.secret)
        try:
            return self._run(link)
        finally:
            self._end_daemons()
            link.close()

    def _run(self, link: channel.Link) -> int:
        # The address this host uses to reach the driver names the host, and its
        # interface is the one the ranks can reach each other on. The driver
        # places every task from the hellos and answers each with its own go; a
        # Spark barrier allGather would do the same but costs a second (it polls).
        self._say_hello(link)
        if self.spec.elastic:
            return self._run_elastic(link)
        reply = link.recv()
        if reply.get("type") != Event.GO:
            return -1
        self.slot = slot = Slot(**reply["slot"])
        self.row = slot.rank
        if self.shard:
            # Every rank runs the same number of steps: pad to the longest shard.
            pad_shard(Path(self.shard[0]), int(reply["rows_per_rank"]))
        listener = mpi.listen_for_rank(self.spec.job_id, slot.rank) if self.spec.controller == "mpi" else None
        threading.Thread(target=self._listen, args=(link,), name="hvdmagic-abort-listener", daemon=True).start()
        events_r, events_w = os.pipe()
        env = self._rank_env(slot, reply.get("devices"), events_w)
        try:
            if listener is None:
                self.proc = self._spawn(env, events_w)
            else:
                self._send(link, {"type": Event.READY, "task": self.task_index})
                self.proc = mpi.adopt_rank(listener, self._token(), env, events_w, self._aborted)
        finally:
            os.close(events_w)
            if listener is not None:
                mpi.close_listener(listener)
        if self.proc is None:  # aborted before mpirun started this rank
            os.close(events_r)
            self._send(link, {"type": Event.EXIT, "rank": slot.rank, "code": -signal.SIGTERM, "aborted": True})
            return -signal.SIGTERM
        if self._aborted.is_set():
            self.kill()
        return self._relay_until_exit(link, events_r, {"session": self.spec.session})

    def _run_elastic(self, link: channel.Link) -> int:
        """Horovod's elastic driver starts a rank here each time it gives this task a slot:
        first, and again after the task's host comes back from the blacklist. The task
        outlives its ranks, so a rank that dies never fails the Spark stage."""
        self.row = self.task_index
        starts: queue.Queue = queue.Queue()
        threading.Thread(target=self._listen, args=(link, starts), name="hvdmagic-abort-listener",
                         daemon=True).start()
        while (go := starts.get()) is not None:
            self.slot = Slot(**go["slot"])
            self._sent.clear()
            events_r, events_w = os.pipe()
            try:
                env = self._rank_env(self.slot, go.get("devices"), events_w)
                env["HOROVOD_ELASTIC"] = "1"
                self.proc = self._spawn(env, events_w)
            finally:
                os.close(events_w)
            if self._aborted.is_set():
                self.kill()
            self._relay_until_exit(link, events_r, {"elastic": True})
        return 0

    def _say_hello(self, link: channel.Link) -> None:
        self._link_address = host_ip = link.sock.getsockname()[0]
        link.send({"type": Event.HELLO, "task": self.task_index, "attempt": self.attempt, "host": host_ip,
                   "gpus": self.gpus, "rows": self.shard[1] if self.shard else None,
                   "hostname": socket.gethostname(), "pid": os.getpid()})

    def _rank_env(self, slot: Slot, devices, events_w: int) -> dict[str, str]:
        env = rank_base_environment(os.environ)
        env.update(self.spec.env)
        rendezvous = (self.spec.driver_host, self.spec.rendezvous_port)
        env.update(rank_environment(slot, rendezvous, interface_for(self._link_address), self.spec.controller,
                                    self.spec.framework, self.spec.job_id))
        env[EVENT_FD_ENV] = str(events_w)
        env[JOB_ID_ENV] = self.spec.job_id
        if self.shard:
            env[SHARD_ENV] = self.shard[0]
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"], first = devices[0], devices[1]
            env[TASK_GPUS_ENV] = ",".join(self.gpus)
            env[CUDA_DEVICE_ENV] = str(first)
        return env

    @staticmethod
    def _spawn(env: dict[str, str], events_w: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "hvdmagic.rank"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(events_w,), env=env,
            start_new_session=True,  # its own process group, so cleanup takes the whole tree
        )

    def _relay_until_exit(self, link: channel.Link, events_r: int, boot: dict) -> int:
        """Hand the rank its bootstrap, relay what it says until it exits, report the exit."""
        relays = [
            threading.Thread(target=self._relay_stream, args=(link, self.proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._relay_stream, args=(link, self.proc.stderr, "stderr"), daemon=True),
            threading.Thread(target=self._relay_events, args=(link, os.fdopen(events_r, "rb")), daemon=True),
        ]
        for thread in relays:
            thread.start()
        try:
            self.proc.stdin.write(pickle.dumps({"payload": self.spec.payload, "rank": self.row,
                                                "results": self.spec.results, **boot}))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the rank died before reading; its exit code tells why
        code = self.proc.wait()
        for thread in relays:
            thread.join(timeout=10)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        # "aborted" only when our own signal ended the rank: a rank that died of its
        # own SIGKILL (the OOM killer) or exit code while an abort was under way
        # is still a failure the user must see.
        aborted = code < 0 and -code in self._sent
        self._send(link, {"type": Event.EXIT, "rank": self.row, "code": code, "aborted": aborted})
        return code

    def _send(self, link: channel.Link, event: dict) -> None:
        try:
            link.send(event)
        except OSError:
            # The driver is gone: nobody will read our output, so stop the rank.
            self.abort()

    def _listen(self, link: channel.Link, starts: queue.Queue | None = None) -> None:
        try:
            while (message := link.recv()).get("type") != Event.ABORT:
                kind = message.get("type")
                if kind == Event.EXEC:
                    self._exec(link, message)
                elif kind == Event.CELL:
                    self._send_cell(message)
                elif kind == Event.INTERRUPT:
                    self._signal(signal.SIGINT)
                elif kind == Event.GO and starts is not None:
                    starts.put(message)
                elif kind == Event.STOP_RANK:
                    self.kill()
        except (channel.ChannelError, OSError):
            pass  # a lost driver means the same as abort
        self.abort()
        if starts is not None:
            starts.put(None)

    def _send_cell(self, message: dict) -> None:
        """A session's cell, to the rank's stdin as a length-prefixed pickle.

        The payload came over the channel, so its frame passed the job's HMAC check; the
        pipe leads only to our own child.
        """
        frame = pickle.dumps({"id": message.get("id"), "payload": base64.b64decode(message.get("payload", ""))})
        try:
            self.proc.stdin.write(len(frame).to_bytes(4, "big") + frame)
            self.proc.stdin.flush()
        except (AttributeError, OSError, ValueError):
            pass  # the rank is gone; its exit tells the driver

    def _signal(self, sig: int) -> None:
        """``sig`` to the rank's process group, as a terminal's Ctrl-C reaches a foreground job."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    def abort(self) -> None:
        self._aborted.set()
        self.kill()
        self._end_daemons(grace=0)

    def _token(self) -> str:
        return mpi.rank_token(self.spec.secret, self.spec.job_id)

    def _exec(self, link: channel.Link, message: dict) -> None:
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

        def report() -> None:
            for line in daemon.stdout:
                text = line.decode("utf-8", "replace").rstrip()[:MAX_LINE]
                self._send(link, {"type": Event.OUTPUT, "rank": self.row, "stream": "stderr",
                                  "lines": [f"[mpi daemon] {text}"], "transient": None})
            self._send(link, {"type": Event.RSH_EXIT, "id": message.get("id"), "code": daemon.wait()})

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

    def kill(self) -> None:
        """Stop the rank's whole process group: TERM, then KILL after a grace period."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, KILL_GRACE), (signal.SIGKILL, None)):
            if proc.poll() is not None:
                return
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            self._sent.add(int(sig))
            try:
                proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def _relay_stream(self, link: channel.Link, pipe, stream: str) -> None:
        splitter = LineSplitter()
        rank = self.row
        while True:
            chunk = pipe.read1(65536)
            if not chunk:
                break
            lines, transient = splitter.feed(chunk.decode("utf-8", "replace"), time.monotonic())
            if lines or transient is not None:
                self._send(link, {"type": Event.OUTPUT, "rank": rank, "stream": stream, "lines": lines,
                                  "transient": transient})
        tail = splitter.finish()
        if tail:
            self._send(link, {"type": Event.OUTPUT, "rank": rank, "stream": stream, "lines": tail, "transient": None})

    def _relay_events(self, link: channel.Link, events) -> None:
        tail = b',"rank":%d}' % self.row
        for line in events:
            frame = relayed(line, tail)
            if frame is None:
                continue
            try:
                link.send_raw(frame)
            except OSError:
                self.abort()  # the driver is gone: nobody will read our output, so stop the rank
            except ValueError as exc:  # over the frame limit: fail the rank, never drop silently
                self._send(link, {"type": Event.ERROR, "rank": self.row, "time": time.time(),
                                  "exc_type": "ValueError", "message": str(exc), "traceback": ""})


def run_task(spec: TaskSpec, task_index: int, gpus: list[str] | None = None,
             shard: tuple[str, int] | None = None, attempt: int = 0) -> int:
    return Supervisor(spec, task_index, gpus, shard, attempt).run()
