"""A host's relay: the blobs this host fetched, served to the job's other hosts.

Runs in the task that fetches a blob for its host (``task.blob_cache``), beside the
fetch. The kernel's blob server tells a host that asks for a blob after this one to
read it from here (``blob_transfer.RelayOrder``), so the kernel sends each blob about
once, whatever the number of hosts. A blob is served while it arrives, from the file
it arrives into: a reader gets each byte once it is there, and waits for the rest,
so the hosts form a pipeline, not a queue.

Only the job's tasks are served: a request is a channel frame under the job's secret.
The reader checks each chunk against the digests the kernel gave it, so a relay that
serves wrong bytes (a bug, a disk error) is dropped, not believed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

from hvdmagic import channel
from hvdmagic.blob_transfer import PEER_STALL, Relay, read_request, serve_each_connection
from hvdmagic.protocol import Blob


class _Arriving:
    """A blob this host is fetching: the file it arrives into, and how much of it is there."""

    def __init__(self, fd: int, size: int):
        self.fd = fd
        self.size = size
        self.ready = 0
        self.failed = False
        self.changed = threading.Condition()

    def set_ready(self, ready: int) -> None:
        with self.changed:
            self.ready = ready
            self.changed.notify_all()

    def end(self, failed: bool) -> None:
        with self.changed:
            self.failed = failed
            self.changed.notify_all()

    def wait_beyond(self, position: int, timeout: float) -> int:
        """The bytes ready once there are more than ``position`` (or ``timeout`` passed); -1 if
        the fetch failed."""
        with self.changed:
            self.changed.wait_for(lambda: self.ready > position or self.failed, timeout)
            return -1 if self.failed else self.ready


class BlobRelay:
    """Serves blobs of ``directory`` (the host's cache) and those arriving there, on ``host``."""

    def __init__(self, host: str, secret: bytes, directory: Path):
        self._secret = secret
        self._directory = directory
        self._arriving: dict[str, _Arriving] = {}
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified as each reader ends
        self._closed = threading.Event()
        self._readers: set[socket.socket] = set()
        self._sock = socket.create_server((host, 0))
        self.address = (host, self._sock.getsockname()[1])
        threading.Thread(target=serve_each_connection, name="hvdmagic-relay", daemon=True,
                         args=(self._sock, self._closed, self._serve, "hvdmagic-relay-send")).start()

    @contextlib.contextmanager
    def offering(self, blob: Blob, fd: int):
        """While the body fetches ``blob`` into the file ``fd``: serve it as it arrives. Yields the
        ``blob_transfer.Relay`` to hand the fetch."""
        arriving = _Arriving(os.dup(fd), blob.size)
        with self._lock:
            self._arriving[blob.digest] = arriving
        failed = True
        try:
            yield Relay(self.address, arriving.set_ready)
            failed = False
        finally:
            with self._lock:
                self._arriving.pop(blob.digest, None)
            arriving.end(failed)
            os.close(arriving.fd)  # readers hold their own duplicate

    def _open(self, digest: str) -> tuple[int, _Arriving | None]:
        """A descriptor of the blob's file (the reader's own), and its arrival while it arrives."""
        with self._lock:
            arriving = self._arriving.get(digest)
            if arriving is not None:
                return os.dup(arriving.fd), arriving
        if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
            raise FileNotFoundError(digest)  # a name, never a path
        return os.open(self._directory / digest, os.O_RDONLY), None

    def _serve(self, sock: socket.socket, peer: str) -> None:
        fd = -1
        with self._lock:
            self._readers.add(sock)
        try:
            link, request = read_request(sock, self._secret)
            position = int(request.get("offset", 0))
            try:
                fd, arriving = self._open(str(request.get("digest", "")))
            except OSError:
                link.send({"size": None})
                return
            size = arriving.size if arriving else os.fstat(fd).st_size
            link.send({"size": size})
            while position < size and not self._closed.is_set():
                # Wait for more bytes a little less than the reader waits for us: a relay
                # whose own source is slow must not look stalled to its reader only for that.
                ready = arriving.wait_beyond(position, PEER_STALL / 2) if arriving else size
                if ready < 0:
                    return  # our own fetch failed: the reader asks the kernel for another source
                if ready > position:
                    # socket.sendfile, not os.sendfile: it honours the socket's timeout
                    with os.fdopen(fd, "rb", buffering=0, closefd=False) as file:
                        position += sock.sendfile(file, position, ready - position)
        except (channel.ChannelError, OSError, ValueError, TypeError):
            pass  # the reader sees the short read and asks for another source
        finally:
            with self._idle:
                self._readers.discard(sock)
                self._idle.notify_all()
            if fd >= 0:
                os.close(fd)
            sock.close()

    def close(self, linger: float = 0.0, stop: threading.Event | None = None) -> None:
        """Stop serving. ``linger``: first go on serving, for up to that many seconds, while any host
        is reading from here, unless ``stop`` is set meanwhile. A host behind this one in the chain
        (a slow one, moved to its end) would otherwise read the rest from the kernel: one more copy."""
        deadline = time.monotonic() + linger
        with self._idle:
            while self._readers and time.monotonic() < deadline and not (stop is not None and stop.is_set()):
                self._idle.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        self._closed.set()
        with self._lock:
            readers = list(self._readers)
        for sock in [self._sock, *readers]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
