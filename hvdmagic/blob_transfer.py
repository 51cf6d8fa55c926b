"""Large buffers from the kernel to a host: the blob server and its client.

A payload's blobs (``protocol.Blob``) do not travel in the Spark closure or the event
channel, which copy, base64 and bound what they carry: a task asks the kernel's
``BlobServer`` for each blob its host lacks and streams it straight into its cache file.

A request is one channel frame (``channel.Link``: HMAC under the job's secret, with a
nonce per connection), so only the job's tasks are served. The bytes then flow raw,
and the client checks them against the BLAKE3 digest it asked for, which it read from
an authenticated source (the TaskSpec, a CELL frame): a blob that does not match is
dropped, never unpickled.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hvdmagic import channel
from hvdmagic.protocol import Blob

CHUNK = 4 << 20
REQUEST_TIMEOUT = 30.0


class BlobError(OSError):
    """A blob could not be fetched: the server does not have it, the bytes did not match, the link broke."""


@dataclass
class Progress:
    """Bytes asked for and sent, by client host, and what they hold."""

    requested: int = 0
    sent: int = 0
    hosts: dict[str, int] = field(default_factory=dict)
    labels: list[str] = field(default_factory=list)
    started: float | None = None  # monotonic: the first request

    def describe(self, now: float) -> str:
        """"sending X (400 MiB) to 2 hosts: 61 %, 380 MB/s", or "sent ..." once done."""
        what = ", ".join(self.labels) or "the cell's data"
        hosts = f"{len(self.hosts)} host{'s' if len(self.hosts) != 1 else ''}"
        elapsed = max(now - (self.started or now), 1e-6)
        rate = f"{self.sent / elapsed / 1e6:.0f} MB/s"
        if self.sent < self.requested:
            return f"sending {what} to {hosts}: {100 * self.sent / self.requested:.0f} %, {rate}"
        return f"sent {what} to {hosts}: {_megabytes(self.sent)} in {elapsed:.1f} s, {rate}"


def format_size(size: float) -> str:
    """A size in bytes as messages give it: "512 B", "16.0 MiB", "2.0 GiB"."""
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.0f} MB" if size < 1e9 else f"{size / 1e9:.1f} GB"


class BlobServer:
    """Serves the buffers ``publish`` names, to clients that know the job's secret.

    Runs in the kernel beside the job's channel server. ``progress`` counts what was asked
    for and sent since ``reset_progress``, and by which client host (the address it
    connected from): what the dashboard shows, and what "once per host" is checked by.
    """

    def __init__(self, host: str, secret: bytes):
        self._secret = secret
        self._buffers: dict[str, memoryview] = {}
        self._labels: dict[str, str] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._progress = Progress()
        self._sock = socket.create_server((host, 0))
        self.address = (host, self._sock.getsockname()[1])
        self._thread = threading.Thread(target=self._accept_loop, name="hvdmagic-blobs", daemon=True)
        self._thread.start()

    def publish(self, buffers: dict[str, memoryview], labels: dict[str, str] | None = None) -> None:
        """Make these buffers (by digest) available; they stay so until ``withdraw``."""
        with self._lock:
            self._buffers.update(buffers)
            self._labels.update(labels or {})

    def progress(self) -> Progress:
        with self._lock:
            return Progress(self._progress.requested, self._progress.sent, dict(self._progress.hosts),
                            list(self._progress.labels), self._progress.started)

    def reset_progress(self) -> None:
        with self._lock:
            self._progress = Progress()

    def withdraw(self, digests) -> None:
        with self._lock:
            for digest in digests:
                self._buffers.pop(digest, None)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, (peer, *_) = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, peer), name="hvdmagic-blob-send", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            sock.settimeout(REQUEST_TIMEOUT)  # a peer that connects and says nothing holds no thread for long
            nonce = secrets.token_bytes(channel.NONCE_SIZE)
            sock.sendall(nonce)
            link = channel.Link(sock, self._secret, nonce, is_server=True)
            request = link.recv()  # a frame that fails the MAC check raises: nothing is sent
            digest = str(request.get("digest", ""))
            with self._lock:
                view = self._buffers.get(digest)
                progress = self._progress
                if view is not None:
                    progress.requested += view.nbytes
                    progress.started = progress.started or time.monotonic()
                    label = self._labels.get(digest, "")
                    if label and label not in progress.labels:
                        progress.labels.append(label)
            if view is None:
                link.send({"size": None})
                return
            link.send({"size": view.nbytes})
            for start in range(0, view.nbytes, CHUNK):
                if self._closed.is_set():
                    return
                chunk = view[start:start + CHUNK]
                sock.sendall(chunk)
                with self._lock:
                    progress.sent += chunk.nbytes
                    progress.hosts[peer] = progress.hosts.get(peer, 0) + chunk.nbytes
        except (channel.ChannelError, OSError):
            pass  # the client sees the short read and says so
        finally:
            sock.close()

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)
        with self._lock:
            self._buffers.clear()


def fetch(address: tuple[str, int], secret: bytes, blob: Blob, into: memoryview,
          on_progress: Callable[[int], None] = lambda n: None, timeout: float = 60.0) -> None:
    """Stream ``blob`` into ``into`` (``blob.size`` bytes: a mapped file) and check its digest.

    ``timeout`` bounds each wait for the server, not the transfer: a large blob takes as
    long as the network needs, and a stalled one fails.
    """
    import blake3

    link = channel.connect(*address, secret, timeout=timeout)
    sock = link.sock
    try:
        sock.settimeout(timeout)
        link.send({"digest": blob.digest})
        size = link.recv().get("size")
        if size is None:
            raise BlobError(f"the kernel no longer holds {blob.label or blob.digest} (its cell ended?)")
        if size != blob.size:
            raise BlobError(f"the kernel offered {size} bytes for {blob.label or blob.digest}, not {blob.size}")
        hasher = blake3.blake3()
        received = 0
        last_report = time.monotonic()
        while received < size:
            got = sock.recv_into(into[received:received + CHUNK])
            if not got:
                raise BlobError(f"the connection to the kernel closed after {received} of {size} bytes of "
                                f"{blob.label or blob.digest}")
            hasher.update(into[received:received + got])
            received += got
            if time.monotonic() - last_report > 0.25:
                on_progress(received)
                last_report = time.monotonic()
        on_progress(received)
        if hasher.hexdigest() != blob.digest:
            raise BlobError(f"{blob.label or blob.digest} arrived altered (its BLAKE3 digest does not match): "
                            "dropped unread")
    except TimeoutError as exc:
        raise BlobError(f"the kernel's blob server at {address[0]}:{address[1]} did not answer within "
                        f"{timeout:g} s") from exc
    except channel.ChannelError as exc:
        raise BlobError(f"the kernel's blob server at {address[0]}:{address[1]}: {exc}") from exc
    finally:
        link.close()
