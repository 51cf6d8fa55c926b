"""The task's side of its channel to the kernel: one connection at a time, as many as the network needs.

A connection between an executor and the kernel crosses the cluster's network, where NAT gateways,
load balancers and switches reset connections or silently stop carrying them. A rank must not end
for that: ``KernelLink`` keeps its task attached to the kernel's ``channel.Peer`` across connections.

- ``send`` never waits for the network: it appends to a buffer that a writer thread drains, so a
  rank whose events the task relays trains on while the connection is down.
- A broken connection (a reset, an error, ``channel.SILENT`` seconds without a byte) is replaced,
  with backoff, for ``grace`` seconds. Each new connection authenticates as the first did and
  attaches to the same peer; the kernel says how much it has, and the rest goes again, in order.
- The buffer is bounded (``BUFFER_LIMIT`` bytes waiting to go): past it, the oldest heartbeats,
  resource samples and progress-only reports go first, then output lines; metrics, results, errors
  and exits never. What was dropped is said in a note once the kernel is back.
- It ends for good when the kernel closes the connection (a FIN: the job ended, or the kernel's
  process died), refuses the task, cannot be reached at all (nothing listens on its port), or
  stays away past the grace. Then ``recv`` raises ``channel.ChannelError``, and the supervisor
  ends its rank: a kernel that is gone leaves no rank behind.
"""

from __future__ import annotations

import contextlib
import json
import queue
import secrets
import threading
import time
from collections import Counter, deque
from typing import Any

from hvdmagic import channel, protocol
from hvdmagic.channel import ChannelError, Link, PeerClosed
from hvdmagic.protocol import Event, link_frame

BUFFER_LIMIT = 64 << 20  # bytes waiting to go, past which the droppable events go first
CONNECT_TIMEOUT = 5.0  # a reconnection's connect and attach; the first connection keeps the launch's 30 s
RETRY_FIRST, RETRY_MAX = 0.25, 4.0  # the backoff between reconnections, doubling
# A kernel host that refuses connections this long (its port closed: no process listens there) has no job
# for this task: the kernel died or the job ended. A network that drops packets never refuses.
REFUSED_FINAL = 3.0
TICK = channel.ACK_EVERY / 2

# In the order they are dropped: what a later event of the same kind makes good.
_DROPPABLE = ((protocol.type_marker(Event.HEARTBEAT), "heartbeats"),
              (protocol.type_marker(Event.RESOURCES), "resource samples"),
              (protocol.type_marker(Event.REPORT), "progress updates"),
              (protocol.type_marker(Event.OUTPUT), "output lines"))


class Refused(ChannelError):
    """The kernel's channel knows this task no more (its grace ran out there)."""


def _kind(payload: bytes) -> str | None:
    """Which droppable kind ``payload`` is, or None: a report that carries metrics is never dropped."""
    for marker, kind in _DROPPABLE:
        if payload.startswith(marker):
            return None if kind == "progress updates" and b'"metrics":' in payload else kind
    return None


class KernelLink:
    """The ``channel.Link`` interface the supervisor uses (``send``, ``send_raw``, ``recv``), over a
    connection that is replaced when the network breaks it."""

    def __init__(self, host: str, port: int, secret: bytes, grace: float = channel.DEFAULT_GRACE):
        self._to = (host, port)
        self._secret = secret
        self.grace = grace
        self._name = secrets.token_hex(16)  # this task's place in the kernel's channel; sent only under the HMAC
        self._cond = threading.Condition()
        self._link: Link | None = None
        self._sent = channel.SentLog()  # written on a connection, not yet acknowledged
        self._pending: deque[bytes] = deque()  # not yet written; numbered from _sent.end on
        self._pending_bytes = 0
        self._received = 0  # the kernel's frames this side has
        self._acked = 0  # the count last acknowledged to the kernel
        self._sync = False  # finish() asks the kernel for an acknowledgement now
        self._dropped: Counter[str] = Counter()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._over: str | None = None  # why the channel ended for good
        self._closing = threading.Event()
        self.address = ""
        self.lost_at: float | None = None  # time.monotonic() since the current outage, while there is one
        self.outages = 0

    # -- what the supervisor calls ------------------------------------------------------------

    def open(self, timeout: float = 30.0) -> None:
        """The first connection; an OSError here is the task's "cannot reach the kernel"."""
        link = self._attach(timeout, new=True)
        self.address = link.sock.getsockname()[0]
        self._link = link
        for target, name in ((self._read, "hvdmagic-kernel-link"), (self._write, "hvdmagic-kernel-link-writer"),
                             (self._keep, "hvdmagic-kernel-link-keeper")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def send(self, event: dict[str, Any]) -> None:
        self.send_raw(json.dumps(event, separators=(",", ":")).encode())

    def send_raw(self, payload: bytes) -> None:
        channel.check_size(payload)
        with self._cond:
            if self._over is not None:
                raise ChannelError(self._over)
            self._pending.append(payload)
            self._pending_bytes += len(payload)
            if self._pending_bytes > BUFFER_LIMIT:
                self._drop_droppable()
            self._cond.notify_all()

    def recv(self) -> dict[str, Any]:
        """The kernel's next message; ChannelError once the channel has ended for good."""
        event = self._inbox.get()
        if event is None:
            self._inbox.put(None)  # for the next caller too
            raise ChannelError(self._over or "closed")
        return event

    def finish(self, timeout: float | None = None) -> bool:
        """Wait until the kernel has everything sent, or the channel has ended (a connection that goes
        silent is found within ``channel.SILENT``, and the outage that follows lasts the grace at most);
        say whether the kernel has it all. ``timeout``: give up sooner."""
        return self._await(self._all_acknowledged, timeout)

    def count(self) -> int:
        """How many frames this side has sent: every frame sent before the call is below the number."""
        with self._cond:
            return self._sent.end + len(self._pending)

    def delivered(self, count: int, timeout: float) -> bool:
        """Wait until the kernel has acknowledged every frame below ``count`` (from ``count()``), and say
        whether it has. It waits while the connection is up, ``timeout`` seconds at most (a kernel under
        load acknowledges late, but it does), and gives up at once while it is down: the frames then
        wait in the buffer, and a commit must not wait out an outage. (A frame dropped from a full
        buffer moves the later ones down, so this may wait for some sent after ``count()``: never for
        less than asked.)"""
        return self._await(lambda: self._sent.first >= count or self._all_acknowledged(), timeout,
                           while_connected=True)

    def _all_acknowledged(self) -> bool:
        return not (self._pending or self._sent.frames)

    def _await(self, done, timeout: float | None, while_connected: bool = False) -> bool:
        """Ask the kernel to acknowledge now, until ``done()``, the channel's end or ``timeout`` (or,
        ``while_connected``, the connection's loss)."""
        deadline = time.monotonic() + timeout if timeout is not None else float("inf")
        with self._cond:
            while self._over is None and not done():
                left = deadline - time.monotonic()
                if left <= 0 or (while_connected and self._link is None):
                    return False
                self._sync = True
                self._cond.notify_all()
                self._cond.wait(min(left, 1.0))
            return done()

    def close(self) -> None:
        self._closing.set()
        self._end("closed")

    # -- the connection's life ----------------------------------------------------------------

    def _attach(self, timeout: float, new: bool = False) -> Link:
        """A new connection, authenticated, attached to this task's place, the log rewound to what
        the kernel lacks."""
        link = channel.connect(*self._to, self._secret, timeout=timeout)
        try:
            link.sock.settimeout(timeout)
            link.send(link_frame(attach=self._name, received=self._received, new=new))
            reply = link.recv()
            link.sock.settimeout(None)
            link.resumable()
            if reply.get("type") != Event.LINK or not isinstance(reply.get("received"), int):
                raise Refused(str(reply.get("refused") or "the kernel did not take the task back"))
        except BaseException:
            link.close()
            raise
        with self._cond:
            # Everything the kernel lacks goes again, first, in its order.
            self._sent.acknowledged(reply["received"])
            self._pending.extendleft(reversed(self._sent.frames))
            self._pending_bytes += self._sent.bytes
            self._sent = channel.SentLog()
            self._sent.first = reply["received"]
        return link

    def _read(self) -> None:
        """Read the kernel's frames; when the connection breaks, replace it, until the grace runs out."""
        link = self._link
        while link is not None:
            try:
                while True:
                    self._take(link.recv())
            except PeerClosed:
                if not link.dropped:
                    self._end("the kernel closed the connection: its job ended, or the kernel is gone")
                    break
            except (ChannelError, OSError):
                pass
            link = self._replace(link)

    def _take(self, event: dict[str, Any]) -> None:
        if event.get("type") != Event.LINK:
            self._received += 1
            self._inbox.put(event)
        elif isinstance(event.get("ack"), int):
            with self._cond:
                self._sent.acknowledged(event["ack"])
                self._cond.notify_all()

    def _replace(self, broken: Link) -> Link | None:
        with self._cond:
            self._link = None
            self.lost_at = time.monotonic()
            self.outages += 1
            self._cond.notify_all()  # a wait for the kernel's acknowledgement while connected ends now
        broken.drop()
        broken.close()
        if self._closing.is_set():
            return None
        deadline, delay, refused_since = self.lost_at + self.grace, RETRY_FIRST, None
        while not self._closing.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                self._end(f"no contact with the kernel for {self.grace:g} s (the reconnect grace)")
                return None
            try:
                link = self._attach(min(CONNECT_TIMEOUT, left))
            except Refused as exc:
                self._end(f"the kernel refused the task: {exc}")
                return None
            except ConnectionRefusedError:
                refused_since = refused_since or time.monotonic()
                if time.monotonic() - refused_since >= REFUSED_FINAL:
                    self._end("nothing listens on the kernel's port any more: its job ended, or the kernel is gone")
                    return None
            except (OSError, ChannelError):
                refused_since = None
            else:
                with self._cond:
                    self._link, self.lost_at = link, None
                    self._note_dropped()
                    self._cond.notify_all()
                return link
            self._closing.wait(min(delay, max(left, 0)))
            delay = min(delay * 2, RETRY_MAX)
        return None

    def _write(self) -> None:
        """Drain the buffer onto the current connection, in order; a failed write leaves the frames
        in the log, which the next connection starts from."""
        while True:
            with self._cond:
                while self._over is None and (self._link is None or not (self._pending or self._control_due())):
                    self._cond.wait()
                if self._over is not None:
                    return
                link = self._link
                batch = list(self._pending)
                self._pending.clear()
                self._pending_bytes = 0
                for payload in batch:
                    self._sent.append(payload)
                control = []
                if self._received != self._acked or self._sync or time.monotonic() - link.sent_at > channel.BEAT:
                    control.append(link_frame(ack=self._received, **({"sync": True} if self._sync else {})))
                    self._acked, self._sync = self._received, False
            try:
                for payload in batch:
                    link.send_raw(payload)
                for frame in control:
                    link.send(frame)
            except OSError:
                link.drop()  # the reader finds it broken and replaces it

    def _control_due(self) -> bool:
        return self._sync or (self._received != self._acked and time.monotonic() - self._link.sent_at > TICK) \
            or time.monotonic() - self._link.sent_at > channel.BEAT

    def _keep(self) -> None:
        """Find a silent connection, and wake the writer for acknowledgements and beats."""
        while not self._closing.wait(TICK):
            with self._cond:
                if self._over is not None:
                    return
                link = self._link
                if link is not None and time.monotonic() - link.heard[0] > channel.SILENT:
                    link.drop()  # a blackhole: the reader's recv fails at once, and it reconnects
                self._cond.notify_all()

    def _drop_droppable(self) -> None:
        """Make room in the buffer: the oldest of the first droppable kind there is, then the next,
        down to three quarters of the limit, so that this runs once per many sends."""
        target = BUFFER_LIMIT * 3 // 4
        for _, kind in _DROPPABLE:
            if self._pending_bytes <= target:
                return
            kept: deque[bytes] = deque()
            for payload in self._pending:
                if self._pending_bytes > target and _kind(payload) == kind:
                    self._pending_bytes -= len(payload)
                    self._dropped[kind] += 1
                else:
                    kept.append(payload)
            self._pending = kept

    def _note_dropped(self) -> None:
        if not self._dropped:
            return
        what = ", ".join(f"{count} {kind}" for kind, count in self._dropped.items())
        text = (f"hvdmagic: while a task's connection to the kernel was down, its buffer passed "
                f"{BUFFER_LIMIT >> 20} MiB and dropped the oldest {what}; no metric, result or error was dropped")
        self._dropped.clear()
        payload = json.dumps(protocol.note(text), separators=(",", ":")).encode()
        self._pending.append(payload)
        self._pending_bytes += len(payload)

    def _end(self, why: str) -> None:
        with self._cond:
            if self._over is None:
                self._over = why
            link, self._link = self._link, None
            self._cond.notify_all()
        if link is not None:
            with contextlib.suppress(OSError):
                link.close()
        self._inbox.put(None)
