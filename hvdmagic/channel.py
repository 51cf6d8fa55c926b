"""The authenticated event stream between the driver and the rank supervisors.

Each frame is ``length (4 bytes) | HMAC-SHA256 (32 bytes) | JSON payload``. The MAC
covers a nonce the server picks per connection, the direction and a frame counter,
so a frame cannot be forged without the per-job secret, nor replayed on another
connection or out of order. Payloads are JSON: nothing read from the network is
ever unpickled here. Pickled results travel base64-encoded inside an authenticated
frame and are only unpickled by the driver after this check has passed.
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
from typing import Any

from hvdmagic.protocol import Event, bare

MAX_FRAME = 512 * 1024 * 1024
# Until a peer has sent one authenticated frame, it may not make us buffer more than this.
FIRST_FRAME_MAX = 64 * 1024
NONCE_SIZE = 16
_MAC_SIZE = hashlib.sha256().digest_size
_HEADER = struct.Struct(">I")
_TO_SERVER = b"S"
_TO_CLIENT = b"C"


class ChannelError(ConnectionError):
    """The peer closed the connection or sent a frame that failed authentication."""


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(min(size - len(chunks), 1 << 20))
        if not chunk:
            raise ChannelError("connection closed")
        chunks += chunk
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

    def _mac(self, direction: bytes, seq: int, payload: bytes) -> bytes:
        msg = self._nonce + direction + seq.to_bytes(8, "big") + payload
        return hmac.new(self._secret, msg, hashlib.sha256).digest()

    def send(self, event: dict[str, Any]) -> None:
        self.send_raw(json.dumps(event, separators=(",", ":")).encode())

    def send_raw(self, payload: bytes) -> None:
        """Send an already encoded JSON object (a relayed rank event) as one frame."""
        if len(payload) > MAX_FRAME:
            raise ValueError(f"event of {len(payload)} bytes exceeds the channel limit of {MAX_FRAME} bytes")
        with self._send_lock:
            mac = self._mac(self._send_dir, self._send_seq, payload)
            self._send_seq += 1
            self.sock.sendall(_HEADER.pack(len(payload)) + mac + payload)

    def recv(self) -> dict[str, Any]:
        """The next frame; raises ChannelError on EOF or on any frame that fails the check."""
        (size,) = _HEADER.unpack(_recv_exact(self.sock, _HEADER.size))
        if size > (MAX_FRAME if self._recv_seq else FIRST_FRAME_MAX):
            raise ChannelError(f"frame of {size} bytes exceeds the limit")
        mac = _recv_exact(self.sock, _MAC_SIZE)
        payload = _recv_exact(self.sock, size)
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


class ChannelServer:
    """Accepts supervisor connections and merges their events into one bounded queue.

    Each queued item is ``(link, event)``. A connection that sends a bad frame is
    dropped and counted in ``rejected``; the job itself carries on.
    """

    def __init__(self, host: str, secret: bytes, *, maxsize: int = 10_000):
        self._secret = secret
        self.events: queue.Queue[tuple[Link, dict[str, Any]]] = queue.Queue(maxsize)
        self.rejected = 0
        self._links: list[Link] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sock = socket.create_server((host, 0))
        self.address = (host, self._sock.getsockname()[1])
        self._threads = [threading.Thread(target=self._accept_loop, name="hvdmagic-channel", daemon=True)]
        self._threads[0].start()

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
                self._threads.append(reader)
            reader.start()

    def _read_loop(self, link: Link) -> None:
        authenticated = False
        try:
            while True:
                event = link.recv()
                authenticated = True
                # Block (and so push back on the sender) while the driver catches up,
                # but never past close(), or this thread would outlive the job.
                while not self._closed.is_set():
                    try:
                        self.events.put((link, event), timeout=0.2)
                        break
                    except queue.Full:
                        continue
        except ChannelError as exc:
            if str(exc) != "connection closed" and not self._closed.is_set():
                self.rejected += 1
        except OSError:
            pass
        finally:
            with self._lock:
                if link in self._links:
                    self._links.remove(link)
            link.close()
            if authenticated and not self._closed.is_set():
                # An elastic job must learn that a task vanished (its executor lost) to
                # stop waiting for that task's rank; other jobs ignore it. A peer that
                # never sent an authenticated frame was never a task.
                with contextlib.suppress(queue.Full):
                    self.events.put((link, bare(Event.GONE)), timeout=1.0)

    def broadcast(self, event: dict[str, Any]) -> None:
        with self._lock:
            links = list(self._links)
        for link in links:
            try:
                link.send(event)
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
            links, self._links = self._links, []
        for link in links:
            link.close()
        for thread in self._threads:
            thread.join(timeout=5)
