"""One rank's process, as its supervisor holds it: start, feed, relay, signal, reap.

Every mode of a task (one-shot, session, elastic, ``--controller mpi``) runs its
ranks through this one object. The rank is a fresh interpreter in its own process
group (``python -m hvdmagic.rank``), or, under mpirun, a process that mpirun
started and the task adopted (``task.mpi``). Its stdin carries its Boot and then
its payloads (``protocol.write_boot``/``write_payload``) and stays open: EOF tells
the rank that its supervisor is gone. Its stdout and stderr are relayed as OUTPUT
events, and its own events (one JSON line each, on the socket named by
``HVDMAGIC_EVENT_FD``) as they are, tagged with its row. A SYNC line is the one
the rank expects an answer to, on the same socket: it is answered once the kernel
has acknowledged every event the rank sent before it (``rank.telemetry.deliver``).
"""

from __future__ import annotations

import codecs
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hvdmagic import protocol
from hvdmagic.protocol import (
    CELL_END_MARK,
    CRASH_HOLD_ENV,
    EVENT_FD_ENV,
    NATIVE_STACKS_MARK,
    STACKS_ENV,
    STACKS_SIGNAL,
    SYNC_WAIT,
    Boot,
    Event,
)
from hvdmagic.task import native_stacks
from hvdmagic.task.flight_recorder import ASKED_WAIT, FlightRecorder
from hvdmagic.task.kernel_link import KernelLink
from hvdmagic.task.lines import LineSplitter, relayed, split_at_marks
from hvdmagic.task.resources import Sampler

KILL_GRACE = 3.0
STACKS_WAIT = 2.0  # seconds a rank's fault handler gets to write its stacks
MARK_WAIT = 2.0  # seconds a cell's idle waits for its output (a rank that closed its stdout sends no mark)

_SYNC_MARKER = protocol.type_marker(Event.SYNC)

# Starts the rank's process with this environment, its end of the event socket passed on;
# returns None when the start was abandoned (an abort while mpirun had not started it yet).
Starter = Callable[[dict[str, str], int], "subprocess.Popen | None"]


def spawn(env: dict[str, str], events_w: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hvdmagic.rank"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        pass_fds=(events_w,), env=env,
        start_new_session=True,  # its own process group, so cleanup takes the whole tree
    )


class RankProcess:
    """``send`` delivers an event to the driver (and stops the rank if the driver is gone);
    ``send_raw`` an already encoded one; ``row`` tags every event the rank sends; ``link``, the
    task's channel to the kernel, answers the rank's syncs (without one they are answered at once,
    as not delivered)."""

    def __init__(self, row: int, send: Callable[[dict], None], send_raw: Callable[[bytes], None],
                 link: KernelLink | None = None):
        self.row = row
        self._send = send
        self._send_raw = send_raw
        self._link = link
        self._events: socket.socket | None = None  # this side of the rank's event socket
        self.proc: subprocess.Popen | None = None
        self._relays: list[threading.Thread] = []
        self._sent: set[int] = set()  # the signals kill() delivered while the rank was alive
        self._stacks_path = ""  # where the rank's fault handler writes its stacks when asked
        # Set by the rank's first event, which it sends after registering its fault handler:
        # before that, STACKS_SIGNAL would kill it (the signal's default action).
        self._listening = threading.Event()
        # How many marks (CELL_END_MARK) each output stream has relayed, how many the rank's events
        # that follow one (a cell's idle, an error) announced, and how many of those went out. Such an
        # event goes out once both streams passed its mark; what a stream has after a mark, after it.
        self._marks = {"stdout": 0, "stderr": 0}
        self._marks_awaited = 0
        self._marked_events_sent = 0
        self._marks_changed = threading.Condition()
        self._stdin_lock = threading.Lock()
        self._usage: Sampler | None = None  # samples the rank's CPU, memory and GPUs while it runs a cell
        self._crash: native_stacks.CrashWatch | None = None  # reads its native frames if a crash signal kills it
        self._flight: FlightRecorder | None = None  # where torch's NCCL flight recorder dumps

    def start(self, env: dict[str, str], boot: Boot, start: Starter = spawn) -> bool:
        """Start the rank and hand it its Boot; False when ``start`` gave up."""
        self._events, theirs = socket.socketpair()
        events_w = theirs.fileno()
        handle, self._stacks_path = tempfile.mkstemp(prefix="hvdmagic-stacks-")
        os.close(handle)
        self._flight = FlightRecorder(env)
        env = {**env, **self._flight.environment(), EVENT_FD_ENV: str(events_w), STACKS_ENV: self._stacks_path}
        hold = native_stacks.can_hold()
        if hold:
            env[CRASH_HOLD_ENV] = "1"
        try:
            self.proc = start(env, events_w)
        finally:
            theirs.close()
        if self.proc is None:
            self._events.close()
            self._forget_stacks()
            self._flight.close()
            return False
        self._crash = native_stacks.CrashWatch(self.proc, hold)
        self._relays = [
            threading.Thread(target=self._relay_stream, args=(self.proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._relay_stream, args=(self.proc.stderr, "stderr"), daemon=True),
            threading.Thread(target=self._relay_events, args=(self._events.makefile("rb"),), daemon=True),
        ]
        for thread in self._relays:
            thread.start()
        self._usage = Sampler(self.proc.pid, self.row, self._send, env)
        self._write(protocol.write_boot, boot)
        return True

    def feed(self, payload: protocol.Payload, cell_id: int | None = None, ranks: list[int] | None = None) -> None:
        """A payload for the rank to run: the one-shot cell, or a session's next cell (``ranks``: the
        ranks that run it, when not every rank does)."""
        if self._usage is not None:
            self._usage.busy()
        self._write(protocol.write_payload, payload, cell_id, ranks)

    def control(self, message: dict) -> None:
        """A control message for a session's rank between its cells (its debugger's start, a line for it)."""
        self._write(protocol.write_control, message)

    def _write(self, write, *args) -> None:
        proc = self.proc
        try:
            with self._stdin_lock:
                write(proc.stdin, *args)
        except (AttributeError, OSError, ValueError):
            pass  # the rank is gone (or died before reading); its exit code tells why

    def wait(self) -> int:
        """Relay until the rank exits, report its exit, and return its code."""
        code = self.proc.wait()
        if self._usage is not None:
            self._usage.stop()
        for thread in self._relays:
            thread.join(timeout=10)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        self._forget_stacks()
        if code != 0:
            # torch's watchdog dumps before it ends the rank: the digest goes out before the exit.
            self._send_flight_record(self._flight.read())
        self._flight.close()
        # "aborted" only when our own signal ended the rank: a rank that died of its
        # own SIGKILL (the OOM killer) or exit code while an abort was under way
        # is still a failure the user must see.
        self._send(protocol.exit_(self.row, code, aborted=code < 0 and -code in self._sent))
        return code

    def send_stacks(self) -> None:
        """Ask the rank's fault handler for every thread's stack and send what it wrote (a STACKS event).

        The rank writes from a C signal handler, so the dump is complete once the file stops
        growing; a rank that is gone, or that never registered the handler, sends "". Where
        py-spy is installed, its dump with the native frames follows (``task.native_stacks``).
        """
        text, proc = "", self.proc
        asked_at = time.time()
        # torch writes its dump from a thread of its own, while the fault handler and py-spy run.
        asked_flight = proc is not None and proc.poll() is None and self._flight.ask()
        if proc is not None and proc.poll() is None and self._stacks_path and self._listening.is_set():
            path = Path(self._stacks_path)
            try:
                path.write_text("")
                os.kill(proc.pid, STACKS_SIGNAL)
                deadline, size = time.monotonic() + STACKS_WAIT, 0
                while time.monotonic() < deadline:
                    time.sleep(0.1)  # polling a file another process writes: there is nothing to wait on
                    size, before = path.stat().st_size, size
                    if size and size == before:
                        break  # written, and no longer growing
                text = path.read_text(errors="replace")
            except OSError:
                pass  # the rank ended meanwhile: its exit says the rest
            # After the fault handler, not beside it: py-spy would catch the rank inside the handler.
            if proc.poll() is None and (native := native_stacks.dump(proc.pid)):
                text += f"\n{NATIVE_STACKS_MARK}\n{native}\n"
        if asked_flight:
            self._send_flight_record(self._flight.read(ASKED_WAIT - (time.time() - asked_at), newer_than=asked_at))
        self._send(protocol.stacks(self.row, text))

    def _send_flight_record(self, digest: dict | None) -> None:
        if digest is not None:
            self._send(protocol.flight_record(self.row, digest))

    def _forget_stacks(self) -> None:
        if self._stacks_path:
            Path(self._stacks_path).unlink(missing_ok=True)
            self._stacks_path = ""

    def signal(self, sig: int) -> None:
        """``sig`` to the rank's process group, as a terminal's Ctrl-C reaches a foreground job."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """Stop the rank's whole process group: TERM, then KILL after a grace period."""
        proc = self.proc
        for sig, wait in ((signal.SIGTERM, KILL_GRACE), (signal.SIGKILL, None)):
            if proc is None or proc.poll() is not None:
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

    # Each relay closes its pipe at EOF: a session restarts its ranks many times in one
    # kernel, and the supervisor and this object refer to each other, so nothing else would
    # close them before the garbage collector ran.
    def _relay_stream(self, pipe, stream: str) -> None:
        splitter = LineSplitter()
        decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character cut between two reads
        held = b""
        with pipe:
            while chunk := pipe.read1(65536):
                pieces, held = split_at_marks(held + chunk, CELL_END_MARK)
                for i, piece in enumerate(pieces):
                    if i:  # a cell ended before this piece: its output, a last partial line too, is out
                        self._send_lines(stream, splitter.finish())
                        self._passed_mark(stream)
                    lines, transient = splitter.feed(decoder.decode(piece), time.monotonic())
                    self._send_lines(stream, lines, transient)
                    if stream == "stderr":
                        self._crash.saw(lines)
        splitter.feed(decoder.decode(held, final=True), time.monotonic())
        self._send_lines(stream, splitter.finish())
        if stream == "stderr":  # after the fault handler's dump, where kernel.record reads it
            self._send_lines(stream, self._crash.lines())

    def _send_lines(self, stream: str, lines: list[str], transient: str | None = None) -> None:
        if lines or transient is not None:
            self._send(protocol.output(self.row, stream, lines, transient))

    def _passed_mark(self, stream: str) -> None:
        with self._marks_changed:
            self._marks[stream] += 1
            passed = self._marks[stream]
            self._marks_changed.notify_all()
            # The driver tells what a rank printed after its error by the order it gets them in.
            self._marks_changed.wait_for(lambda: self._marked_events_sent >= passed, MARK_WAIT)

    def _await_output(self) -> None:
        """Before a cell's idle or an error: both streams have relayed everything the rank wrote before it."""
        with self._marks_changed:
            self._marks_awaited += 1
            self._marks_changed.wait_for(lambda: min(self._marks.values()) >= self._marks_awaited, MARK_WAIT)

    def _relay_events(self, events) -> None:
        tail = b',"rank":%d}' % self.row
        with events:
            for line in events:
                self._listening.set()
                if line.startswith(_SYNC_MARKER):
                    self._answer_sync(line)
                    continue
                frame = relayed(line, tail)
                if frame is None:
                    continue
                marked = protocol.follows_output(line)
                if marked:
                    if self._usage is not None and protocol.ends_a_cell(line):
                        self._usage.idle()
                    self._await_output()
                try:
                    self._send_raw(frame)
                except ValueError as exc:  # over the frame limit: fail the rank, never drop silently
                    self._send(protocol.error("ValueError", str(exc), "", time.time(), rank=self.row))
                if marked:
                    with self._marks_changed:
                        self._marked_events_sent += 1
                        self._marks_changed.notify_all()
        if self._events is not None:
            self._events.close()  # an answer still on its way then fails on the closed socket, harmlessly

    def _answer_sync(self, line: bytes) -> None:
        """Answer the rank's sync once the kernel has every event relayed before it: counted here, in
        the relay's order, and waited for on another thread, so that the relay goes on meanwhile."""
        try:
            number = json.loads(line)["id"]
        except (ValueError, KeyError, TypeError):
            return
        link = self._link
        count = link.count() if link is not None else 0

        def answer() -> None:
            delivered = link is not None and link.delivered(count, SYNC_WAIT)
            reply = json.dumps(protocol.sync(number, delivered), separators=(",", ":")).encode() + b"\n"
            try:
                self._events.sendall(reply)
            except (AttributeError, OSError):
                pass  # the rank is gone, or stopped waiting: nobody reads the answer

        threading.Thread(target=answer, name="hvdmagic-sync", daemon=True).start()
