"""The authenticated event stream between the driver and the rank supervisors.

Each frame is ``length (4 bytes) | HMAC-SHA256 (32 bytes) | JSON payload``. The MAC
covers a nonce the server picks per connection, the direction and a frame counter,
so a frame cannot be forged without the per-job secret, nor replayed on another
connection or out of order. Payloads are JSON: nothing read from the network is
ever unpickled here. Pickled results travel base64-encoded inside an authenticated
frame and are only unpickled by the driver after this check has passed.

A task's connection is resumable (``task.kernel_link`` is its side, ``Peer`` the kernel's).
Its first frame attaches it to a peer: a random name the task picks, plus how many of the
kernel's frames it has received. The kernel answers with how many of the task's it has, and
each side sends again what the other lacks, from a log of what it sent that the other's
acknowledgements trim. A reconnection authenticates as a first connection does (a new nonce,
the job's secret), so only the job's tasks can attach, and the counts mean nothing is acted
on twice. Both sides beat every ``BEAT`` seconds and drop a connection silent for ``SILENT``.
A connection the peer closed (a FIN) means its process ended or chose to: that is final. A
reset, a timeout or silence is the network: the task reconnects for ``grace`` seconds, and
the kernel keeps the peer's place as long. Connections that do not attach (the rsh agent of
``--controller mpi``, the transform's progress) are plain, as before: their end is final.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import queue
import secrets
import socket
import struct
import threading
import time
from collections import deque
from typing import Any

from hvdmagic.protocol import Event, bare, contact, gone, link_frame

MAX_FRAME = 512 * 1024 * 1024
# Until a peer has sent one authenticated frame, it may not make us buffer more than this.
FIRST_FRAME_MAX = 64 * 1024
NONCE_SIZE = 16
_MAC_SIZE = hashlib.sha256().digest_size
_HEADER = struct.Struct(">I")
_TO_SERVER = b"S"
_TO_CLIENT = b"C"

# The resumable channel's own frames (protocol.link_frame) are never counted, never passed on.
BEAT = 3.0  # seconds: a side that has sent nothing for this long sends an acknowledgement anyway
SILENT = 10.0  # seconds without a byte from the other side (three beats): dead (a blackhole, a lost NAT entry)
ACK_EVERY = 1.0  # seconds between acknowledgements while frames arrive
DEFAULT_GRACE = 120.0  # seconds a lost connection may take to come back (TaskSpec.reconnect_grace)


def check_size(payload: bytes) -> None:
    """A frame the other side would refuse fails here, in the sender, with its size."""
    if len(payload) > MAX_FRAME:
        raise ValueError(f"event of {len(payload)} bytes exceeds the channel limit of {MAX_FRAME} bytes")


class ChannelError(ConnectionError):
    """The peer closed the connection or sent a frame that failed authentication."""


def new_secret() -> bytes:
    return secrets.token_bytes(32)


class PeerClosed(ChannelError):
    """The other side closed the connection (a FIN): its process ended, or it chose to. Not the network."""


_TCP_CLOSE = 7  # Linux's tcp_states.h: what a reset or an abort leaves; a FIN received leaves CLOSE_WAIT


def _was_reset(sock: socket.socket) -> bool:
    """Whether a read's end of stream was a reset, not the peer's FIN. A reset's error goes to whichever
    call meets it first: when this link's writer thread did, its reader then reads an empty stream, as
    after a FIN. The connection's TCP state tells them apart (Linux; elsewhere an end of stream is a FIN)."""
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == _TCP_CLOSE
    except (AttributeError, OSError):  # not Linux, or not TCP
        return False


def _recv_exact(sock: socket.socket, size: int, heard: list[float] | None = None) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(min(size - len(chunks), 1 << 20))
        if not chunk:
            if _was_reset(sock):
                raise ConnectionResetError("connection reset")
            raise PeerClosed("connection closed")
        chunks += chunk
        if heard is not None:  # a frame of 500 MB on a slow link is not silence
            heard[0] = time.monotonic()
    return bytes(chunks)


class Link:
    """One authenticated, ordered, bidirectional connection (either end)."""

    def __init__(self, sock: socket.socket, secret: bytes, nonce: bytes, *, is_server: bool):
        # Events are small frames, often two in a row (a result, then idle): with Nagle's
        # algorithm the second waits for the peer's delayed ACK, 40 ms on Linux.
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._secret = secret
        self._nonce = nonce
        self._send_dir, self._recv_dir = (_TO_CLIENT, _TO_SERVER) if is_server else (_TO_SERVER, _TO_CLIENT)
        self._send_seq = 0
        self._recv_seq = 0
        self._send_lock = threading.Lock()
        self.heard = [time.monotonic()]  # when a byte last came: a resumable peer's silence is counted from it
        self.sent_at = time.monotonic()  # when a frame last went
        self.dropped = False  # this side cut the connection (silence, a newer one): its EOF is not the peer's

    def drop(self) -> None:
        """Cut the connection from any thread, as the network would: this end's reads fail at once, and
        the close that follows sends a reset, never a FIN, so the other end sees a broken connection
        to come back on, not a peer that chose to leave."""
        self.dropped = True
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.sock.shutdown(socket.SHUT_RD)  # wakes a blocked recv; sends nothing

    def resumable(self) -> None:
        """A resumable connection's sends give up after SILENT seconds without progress (a blackhole
        fills the send buffer): the writer then drops it, and the frames go again on the next."""
        seconds = int(SILENT)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", seconds, 0))

    def _mac(self, direction: bytes, seq: int, payload: bytes) -> bytes:
        msg = self._nonce + direction + seq.to_bytes(8, "big") + payload
        return hmac.new(self._secret, msg, hashlib.sha256).digest()

    def send(self, event: dict[str, Any]) -> None:
        self.send_raw(json.dumps(event, separators=(",", ":")).encode())

    def send_raw(self, payload: bytes) -> None:
        """Send an already encoded JSON object (a relayed rank event) as one frame."""
        check_size(payload)
        with self._send_lock:
            mac = self._mac(self._send_dir, self._send_seq, payload)
            self._send_seq += 1
            self.sock.sendall(_HEADER.pack(len(payload)) + mac + payload)
            self.sent_at = time.monotonic()

    def recv(self) -> dict[str, Any]:
        """The next frame; raises ChannelError on EOF or on any frame that fails the check."""
        (size,) = _HEADER.unpack(_recv_exact(self.sock, _HEADER.size, self.heard))
        if size > (MAX_FRAME if self._recv_seq else FIRST_FRAME_MAX):
            raise ChannelError(f"frame of {size} bytes exceeds the limit")
        mac = _recv_exact(self.sock, _MAC_SIZE)
        payload = _recv_exact(self.sock, size, self.heard)
        if not hmac.compare_digest(mac, self._mac(self._recv_dir, self._recv_seq, payload)):
            raise ChannelError("frame failed authentication")
        self._recv_seq += 1
        try:
            event = json.loads(payload)
        except ValueError as exc:
            raise ChannelError("authenticated frame is not JSON") from exc
        if not isinstance(event, dict):
            raise ChannelError("authenticated frame is not a JSON object")
        return event

    def close(self) -> None:
        if not self.dropped:  # a dropped connection ends with its reset
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.sock.close()


def connect(host: str, port: int, secret: bytes, timeout: float = 30.0) -> Link:
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        # The server's nonce, within the same timeout: a process that is frozen (SIGSTOP) or wedged still
        # has its connections accepted by the OS, and would hold this read for ever.
        nonce = _recv_exact(sock, NONCE_SIZE)
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return Link(sock, secret, nonce, is_server=False)


class SentLog:
    """What one side of a resumable channel sent and the other has not acknowledged, by number:
    the n-th frame either side sends is frame n, on whichever connection it travels."""

    def __init__(self):
        self.frames: deque[bytes] = deque()
        self.first = 0  # the number of frames[0]
        self.bytes = 0

    @property
    def end(self) -> int:
        """The number the next frame will have."""
        return self.first + len(self.frames)

    def append(self, payload: bytes) -> None:
        self.frames.append(payload)
        self.bytes += len(payload)

    def acknowledged(self, count: int) -> None:
        """The other side has every frame below ``count``."""
        while self.frames and self.first < count:
            self.bytes -= len(self.frames.popleft())
            self.first += 1

    def since(self, count: int) -> list[bytes]:
        return list(self.frames)[max(0, count - self.first):]


class Peer:
    """One task as the kernel knows it, across its connections: the job loop's events name it,
    and the job sends to it. ``send`` never waits for a lost connection: the frame waits in the
    log and goes when the task is back."""

    def __init__(self, name: str):
        self.name = name
        self.link: Link | None = None
        self.received = 0  # the task's frames queued for the job
        self.acked = 0  # the count this side last acknowledged
        self.log = SentLog()
        self.lost_at: float | None = None  # time.time() since when it has had no connection
        self.gone = False
        self._send_lock = threading.Lock()  # the log and the link, for what goes out
        self._recv_lock = threading.Lock()  # received, and which connection may deliver; taken before _send_lock

    def send(self, event: dict[str, Any]) -> None:
        self.send_raw(json.dumps(event, separators=(",", ":")).encode())

    def send_raw(self, payload: bytes) -> None:
        check_size(payload)
        with self._send_lock:
            if self.gone:
                raise ChannelError("the task is gone")
            self.log.append(payload)
            link = self.link
            if link is not None:
                try:
                    link.send_raw(payload)
                except OSError:
                    link.drop()  # its reader finds it lost; the frame is in the log

    def _attach(self, link: Link, they_received: int) -> bool:
        """Make ``link`` this peer's connection: tell the task how much of its output is here, and
        send again what it lacks of ours. The connection it replaces is cut; True if there was one."""
        link.resumable()
        with self._recv_lock, self._send_lock:
            old, self.link, self.lost_at = self.link, link, None
            try:
                link.send(link_frame(attached=True, received=self.received))
                self.log.acknowledged(they_received)
                for payload in self.log.since(they_received):
                    link.send_raw(payload)
            finally:
                if old is not None:
                    old.drop()
        return old is not None

    def _deliver(self, link: Link, put: Any, event: dict[str, Any]) -> bool:
        """Queue one of the task's frames, unless a newer connection has taken this one's place."""
        with self._recv_lock:
            if self.link is not link:
                return False
            put(event)
            self.received += 1
        return True

    def _lose(self, link: Link) -> bool:
        """The connection broke (not closed by the task): the grace starts, if it was the current one."""
        with self._recv_lock, self._send_lock:
            if self.link is not link or self.gone:
                return False
            self.link, self.lost_at = None, time.time()
        return True

    def _acknowledge(self, force: bool = False) -> None:
        """Tell the task how much of its output is here; with nothing new, only as a beat. Never waits
        on a send that is blocked (a blackholed connection): the silence check must go on."""
        link = self.link
        if link is None or not (force or self.received != self.acked or time.monotonic() - link.sent_at > BEAT):
            return
        if not self._send_lock.acquire(blocking=force):
            return
        try:
            received = self.received
            link.send(link_frame(ack=received))
            self.acked = received
        except OSError:
            link.drop()
        finally:
            self._send_lock.release()


class ChannelServer:
    """Accepts supervisor connections and merges their events into one bounded queue.

    Each queued item is ``(peer, event)``: a ``Peer`` for a task that attached (resumable), else
    the ``Link`` itself. A connection that sends a bad frame is dropped and counted in
    ``rejected``; the job itself carries on. A peer whose connection broke is announced with
    ``Event.CONTACT`` (``lost``), and again when it is back; one that closed its connection, or
    did not come back within ``grace`` seconds, with ``Event.GONE``.
    """

    def __init__(self, host: str, secret: bytes, *, maxsize: int = 10_000, grace: float = DEFAULT_GRACE):
        self._secret = secret
        self.grace = grace
        self.events: queue.Queue[tuple[Any, dict[str, Any]]] = queue.Queue(maxsize)
        self.rejected = 0
        self._links: list[Link] = []  # every open connection, for close()
        self._plain: list[Link] = []  # those whose first frame was not an attach: broadcast reaches them
        self._peers: dict[str, Peer] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sock = socket.create_server((host, 0))
        self.address = (host, self._sock.getsockname()[1])
        self._threads = [threading.Thread(target=self._accept_loop, name="hvdmagic-channel", daemon=True),
                         threading.Thread(target=self._keep, name="hvdmagic-channel-keeper", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            nonce = secrets.token_bytes(NONCE_SIZE)
            try:
                sock.sendall(nonce)
            except OSError:
                sock.close()
                continue
            link = Link(sock, self._secret, nonce, is_server=True)
            with self._lock:
                if self._closed.is_set():
                    link.close()
                    return
                self._links.append(link)
                reader = threading.Thread(target=self._read_loop, args=(link,), name="hvdmagic-channel-reader",
                                          daemon=True)
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(reader)
            reader.start()

    def _put(self, item: tuple[Any, dict[str, Any]]) -> None:
        # Block (and so push back on the sender) while the driver catches up,
        # but never past close(), or this thread would outlive the job.
        while not self._closed.is_set():
            try:
                self.events.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def _read_loop(self, link: Link) -> None:
        plain = False
        peer = None
        try:
            event = link.recv()
            if event.get("type") == Event.LINK and "attach" in event:
                peer = self._attach(link, event)
                if peer is not None:
                    self._read_peer(peer, link)
                return
            with self._lock:
                self._plain.append(link)
            plain = True
            self._put((link, event))
            while True:
                self._put((link, link.recv()))
        except ChannelError as exc:
            if not isinstance(exc, PeerClosed) and not self._closed.is_set():
                self.rejected += 1
            if peer is not None:
                self._ended(peer, link, closed=isinstance(exc, PeerClosed))
        except OSError:
            if peer is not None:
                self._ended(peer, link, closed=False)
        finally:
            with self._lock:
                if link in self._links:
                    self._links.remove(link)
                if link in self._plain:
                    self._plain.remove(link)
            link.close()
            if plain and not self._closed.is_set():
                # An elastic job must learn that a task vanished (its executor lost) to
                # stop waiting for that task's rank; other jobs ignore it. A peer that
                # never sent an authenticated frame was never a task.
                with contextlib.suppress(queue.Full):
                    self.events.put((link, bare(Event.GONE)), timeout=1.0)

    def _attach(self, link: Link, hello: dict[str, Any]) -> Peer | None:
        name, they_received = str(hello.get("attach")), hello.get("received")
        with self._lock:
            peer = self._peers.get(name)
            if peer is None and hello.get("new") and they_received == 0 and not self._closed.is_set():
                peer = self._peers[name] = Peer(name)
        if peer is None or peer.gone or not isinstance(they_received, int):
            # A task the job no longer waits for (its grace ran out): it must stop its rank.
            with contextlib.suppress(OSError):
                link.send(link_frame(refused="this job no longer has a place for the task"))
            return None
        back = peer.lost_at is not None
        try:
            replaced = peer._attach(link, they_received)
        except OSError:
            replaced = False  # the new connection broke at once: its reader tells of the outage
            link.drop()
        if replaced and not back:
            # The task found its connection broken and came back before this side's reader did (a reset
            # the task met first; a reader not yet scheduled, under load): the same outage, told the same way.
            self._put((peer, contact(lost=True, since=time.time())))
            back = True
        if back:
            self._put((peer, contact(lost=False)))
        return peer

    def _read_peer(self, peer: Peer, link: Link) -> None:
        while True:
            event = link.recv()
            if event.get("type") == Event.LINK:
                if isinstance(event.get("ack"), int):
                    with peer._send_lock:
                        peer.log.acknowledged(event["ack"])
                if event.get("sync"):
                    peer._acknowledge(force=True)
                continue
            if not peer._deliver(link, self._put, (peer, event)):
                return

    def _ended(self, peer: Peer, link: Link, closed: bool) -> None:
        if self._closed.is_set() or (link.dropped and peer.link is not link):
            return  # the job is over, or a newer connection took this one's place
        if closed and not link.dropped:
            self._gone(peer, "closed")
        elif peer._lose(link):
            self._put((peer, contact(lost=True, since=peer.lost_at)))

    def _gone(self, peer: Peer, why: str) -> None:
        with self._lock:
            if peer.gone:
                return
            peer.gone = True
            self._peers.pop(peer.name, None)
        with peer._send_lock:
            link, peer.link = peer.link, None
        if link is not None:
            link.drop()
        self._put((peer, gone(why=why, since=peer.lost_at, grace=self.grace)))

    def _keep(self) -> None:
        """Acknowledge, beat, find silent connections, and give up on peers past their grace."""
        while not self._closed.wait(ACK_EVERY / 2):
            with self._lock:
                peers = list(self._peers.values())
            now = time.monotonic()
            for peer in peers:
                link = peer.link
                if link is not None and now - link.heard[0] > SILENT:
                    link.drop()  # its reader finds it lost
                elif link is not None:
                    peer._acknowledge()
                elif peer.lost_at is not None and time.time() - peer.lost_at > self.grace:
                    self._gone(peer, "grace")

    def broadcast(self, event: dict[str, Any]) -> None:
        with self._lock:
            targets = [*self._plain, *self._peers.values()]
        for target in targets:
            try:
                target.send(event)
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            links, self._links, self._plain = self._links, [], []
            self._peers.clear()
        for link in links:
            link.close()
        for thread in self._threads:
            thread.join(timeout=5)
