"""Large buffers from the kernel to the hosts: the blob server, its client, and the relay order.

A payload's blobs (``protocol.Blob``) do not travel in the Spark closure or the event
channel, which copy, base64 and bound what they carry: a task asks the kernel's
``BlobServer`` for each blob its host lacks and streams it straight into its cache file.

Many hosts: the kernel sends each blob about once. A host that asks while another host
already receives the blob is told to read it from that host instead (``task.blob_relay``
serves a blob while it arrives), so the hosts form a pipelined chain in the order they
asked: kernel -> first host -> second host -> ... Each link carries one copy, and the last
host is behind the first by a few chunks, not by a copy: 16 hosts take about the time of
one. (A tree would send each copy 2 or more times from every inner host; pulling chunks
from any holder, as Ray does, copes better with uneven links but needs per-chunk
bookkeeping on every host. On one cluster's even links the chain is the shortest.)
A host whose source breaks, stalls for ``PEER_STALL`` seconds or sends a chunk that
does not match asks again, naming it: the kernel gives it the nearest live host before
it in the chain, or itself, and it resumes from its last good chunk. A host whose link is
slow would hold back every host behind it; for a large blob the kernel keeps the chain in
step with the hosts' pace and moves such a host to the chain's end (``RelayOrder``), and the
host before it goes on serving it after its own rank has ended (``task.supervisor``).

Every request is one channel frame (``channel.Link``: HMAC under the job's secret, with
a nonce per connection), so only the job's tasks are served, by the kernel or by a host.
The bytes then flow raw. From the kernel, the client checks the whole blob against the
BLAKE3 digest it asked for, which it read from an authenticated source (the TaskSpec, a
CELL frame); from a host, it checks each chunk against the chunk digests the kernel sent
it in an authenticated frame. A blob or chunk that does not match is dropped, never
unpickled.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hvdmagic import channel
from hvdmagic.protocol import Blob

CHUNK = 4 << 20  # the unit of a chunk digest, of a resume, and of one read
REQUEST_TIMEOUT = 30.0
# "0" in the kernel's environment: every host reads from the kernel (hosts that cannot reach
# each other's ports; the benchmark's baseline).
RELAY_ENV = "HVDMAGIC_BLOB_RELAY"
# A host that sends nothing for this long is given up for another source (the kernel's link
# is not: it is the last source there is, and ``fetch``'s ``timeout`` bounds it).
PEER_STALL = 5.0
_REPORT_EVERY = 0.25
# The chain follows the hosts' pace (RelayOrder) for blobs this large: a slow host then costs only
# itself. A smaller blob is through before a pace can be measured.
PACE_MIN = 256 << 20
PACE_WINDOW = 3.0  # seconds of a host's bytes that its rate is taken over
SLOW = 0.5  # a host receiving at under this many times its source's rate holds back the hosts behind it
MAX_KERNEL_CLOSES = 4  # early ends of the kernel's stream a host asks again after, before it gives up
# A reset or refused connection to the kernel (the network between them) is asked again after, from where the
# blob stopped, with this backoff, until ``fetch``'s ``timeout`` passes without a byte.
RETRY_FIRST, RETRY_MAX = 0.25, 4.0


class BlobError(OSError):
    """A blob could not be fetched: the server does not have it, the bytes did not match, the link broke."""


@dataclass
class Progress:
    """Bytes asked for and received by the hosts, and by which host, since ``reset_progress``."""

    requested: int = 0  # each blob's size, once for each host that asked for it
    sent: int = 0  # bytes the hosts have received, from the kernel or from each other
    from_kernel: int = 0  # of those, the bytes the kernel itself sent
    hosts: dict[str, int] = field(default_factory=dict)  # received, by the address a host asked from
    labels: list[str] = field(default_factory=list)
    started: float | None = None  # monotonic: the first request
    slow: list[str] = field(default_factory=list)  # hosts moved to the chain's end for their pace

    def describe(self, now: float) -> str:
        """"sending X (400 MiB) to 2 hosts: 61 %, 380 MB/s", or "sent ..." once done."""
        what = ", ".join(self.labels) or "the cell's data"
        hosts = f"{len(self.hosts)} host{'s' if len(self.hosts) != 1 else ''}"
        elapsed = max(now - (self.started or now), 1e-6)
        rate = f"{self.sent / elapsed / 1e6:.0f} MB/s"
        slow = (f"; {', '.join(self.slow)} received slowly, so {'they' if len(self.slow) > 1 else 'it'} "
                f"read last, behind the others" if self.slow else "")
        if self.sent < self.requested:
            return f"sending {what} to {hosts}: {100 * self.sent / self.requested:.0f} %, {rate}{slow}"
        relayed = (f" ({_megabytes(self.from_kernel)} from the kernel, the rest host to host)"
                   if self.from_kernel < self.sent else "")
        return f"sent {what} to {hosts}: {_megabytes(self.sent)} in {elapsed:.1f} s, {rate}{relayed}{slow}"


def format_size(size: float) -> str:
    """A size in bytes as messages give it: "512 B", "16.0 MiB", "2.0 GiB"."""
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.0f} MB" if size < 1e9 else f"{size / 1e9:.1f} GB"


def chunk_digests(view: memoryview) -> list[str]:
    """BLAKE3 of each CHUNK of ``view``, hex: what a host checks bytes from another host against."""
    import blake3

    return [blake3.blake3(view[start:start + CHUNK]).hexdigest() for start in range(0, view.nbytes, CHUNK)]


class RelayOrder:
    """Which host a host reads a blob from: the hosts of each blob in the order they asked, kept in
    step with how fast each receives.

    A host reads from the nearest host before it that is not known to be down, or from the
    kernel when there is none. Only earlier hosts are ever a source, so no host waits on
    one that waits on it. A host is down once another host names it as failed, and up
    again once it asks for something itself.

    A slow host holds back every host behind it in the chain, so for a blob of ``PACE_MIN``
    bytes or more the order follows the hosts' pace (``note``, ``moves``):

    - a host that receives at under ``SLOW`` times its source's rate, over ``PACE_WINDOW``
      seconds, is moved to the end of the chain, before the hosts moved there earlier. The host
      behind it then reads from its source, and it reads from the nearest host before it that
      has its offset: the last host, whose uplink nobody else uses, unless it is behind;
    - the kernel's own rate is known only where it sends to two hosts. So the second host to
      ask reads from the kernel too, for one window: if the first host's rate is under ``SLOW``
      times the second's, the first moves to the end, and the second leads the chain;
      otherwise the second reads from the first. It costs the kernel one window of a second
      copy, a few per cent of a large blob.

    Each host moves at most once per blob, so the chain settles.
    """

    def __init__(self):
        self._order: dict[str, list[tuple[str, int]]] = {}
        self._down: set[tuple[str, int]] = set()
        self._paced: dict[str, _Pace] = {}  # the blobs large enough to follow the hosts' pace

    def source(self, digest: str, relay: tuple[str, int] | None,
               failed: list[tuple[str, int]], size: int = 0, offset: int = 0) -> tuple[str, int] | None:
        self._down.update(failed)
        order = self._order.setdefault(digest, [])
        before = order
        if relay is not None:
            self._down.discard(relay)
            if relay not in order:
                order.append(relay)
            before = order[:order.index(relay)]
            if size >= PACE_MIN:
                pace = self._paced.setdefault(digest, _Pace())
                pace.forget(relay)  # a new source: its rate so far was another link's
                if len(order) > 1 and relay == order[1] and not pace.tried:
                    pace.trial, pace.tried = (order[0], relay), True  # the second host reads from the kernel
                if pace.trial is not None and relay == pace.trial[1]:
                    return None
                if relay in pace.moved:  # it may be ahead of the hosts now before it: one that has its offset
                    ahead = [host for host in before if host not in self._down and pace.received(host) >= offset]
                    if ahead:
                        return ahead[-1]
        return next((host for host in reversed(before) if host not in self._down), None)

    def note(self, digest: str, host: tuple[str, int], received: int, now: float) -> None:
        """``host`` has ``received`` bytes of ``digest`` (a large one's): its pace."""
        if (pace := self._paced.get(digest)) is not None:
            pace.note(host, received, now)

    def moves(self, digest: str, size: int, now: float) -> list[tuple[str, int]]:
        """The hosts that must ask for a source again, after the order changed by pace; usually none."""
        pace = self._paced.get(digest)
        if pace is None:
            return []
        order = [host for host in self._order[digest] if host not in self._down]
        if pace.trial is not None:
            first, second = pace.trial
            ahead, behind = pace.rate(first, now), pace.rate(second, now)
            if first not in order or second not in order or pace.done(first, size) or pace.done(second, size):
                pace.trial = None
                return [second] if second in order else []
            if ahead is None or behind is None:
                return []
            pace.trial = None
            # The first host's link is the slow one, or the second overtook it (reading from the first,
            # it would wait for bytes it has): the second leads on.
            if ahead < SLOW * behind or pace.received(second) > pace.received(first):
                return self._to_end(digest, first, pace, follower=False)
            return [second]  # the kernel was the limit: the second reads from the first again
        for i, host in enumerate(order[1:-1], start=1):
            source = order[i - 1]
            if host in pace.moved or pace.done(host, size) or pace.done(source, size):
                continue
            mine, theirs = pace.rate(host, now), pace.rate(source, now)
            if mine is not None and theirs is not None and mine < SLOW * theirs:
                return self._to_end(digest, host, pace)
        return []

    def slow(self, digest: str) -> list[tuple[str, int]]:
        """The hosts moved to the end of ``digest``'s chain for their pace."""
        pace = self._paced.get(digest)
        return sorted(pace.moved) if pace else []

    def _to_end(self, digest: str, host: tuple[str, int], pace: _Pace, follower: bool = True
                ) -> list[tuple[str, int]]:
        """Move ``host`` to the end of the chain, but before the hosts moved there earlier (a host on a
        slow link serves nobody); it asks again, and so do the host that read from it and the one that
        now reads from it."""
        order = self._order[digest]
        live = [h for h in order if h not in self._down]
        behind = live[live.index(host) + 1:live.index(host) + 2] if follower else []
        order.remove(host)
        tail = next((i for i, h in enumerate(order) if h in pace.moved), len(order))
        order.insert(tail, host)
        after = [h for h in order[tail + 1:] if h not in self._down][:1]
        pace.moved.add(host)
        asked = list(dict.fromkeys([host, *behind, *after]))
        for moved in asked:
            pace.forget(moved)
        return asked


class _Pace:
    """How fast each host of one large blob receives it: its bytes over the last PACE_WINDOW."""

    def __init__(self):
        self.seen: dict[tuple[str, int], list[tuple[float, int]]] = {}  # host: (time, bytes), oldest first
        # (first host, second host) while both read from the kernel, for the first window
        self.trial: tuple[tuple[str, int], tuple[str, int]] | None = None
        self.moved: set[tuple[str, int]] = set()
        self.tried = False  # the first window's trial has been made

    def note(self, host: tuple[str, int], received: int, now: float) -> None:
        seen = self.seen.setdefault(host, [])
        seen.append((now, received))
        while len(seen) > 2 and seen[1][0] <= now - PACE_WINDOW:
            seen.pop(0)

    def forget(self, host: tuple[str, int]) -> None:
        self.seen.pop(host, None)

    def rate(self, host: tuple[str, int], now: float) -> float | None:
        """Bytes a second over the last PACE_WINDOW; None until the host has been seen that long."""
        seen = self.seen.get(host)
        if not seen or now - seen[0][0] < PACE_WINDOW:
            return None
        return (seen[-1][1] - seen[0][1]) / max(seen[-1][0] - seen[0][0], 1e-6)

    def received(self, host: tuple[str, int]) -> int:
        seen = self.seen.get(host)
        return seen[-1][1] if seen else 0

    def done(self, host: tuple[str, int], size: int) -> bool:
        return self.received(host) >= size


def serve_each_connection(listener: socket.socket, closed: threading.Event,
                          serve: Callable[[socket.socket, str], None], name: str) -> None:
    """Accept connections until ``listener`` closes, each served by ``serve(sock, peer address)``
    on a thread of its own: the kernel's blob server and a host's relay."""
    while not closed.is_set():
        try:
            sock, (peer, *_) = listener.accept()
        except OSError:
            return
        threading.Thread(target=serve, args=(sock, peer), name=name, daemon=True).start()


def read_request(sock: socket.socket, secret: bytes) -> tuple[channel.Link, dict]:
    """A connection's link and its one request frame, authenticated under the job's secret: a
    frame that fails the MAC check raises, and nothing is sent."""
    sock.settimeout(REQUEST_TIMEOUT)  # a peer that connects and says nothing holds no thread for long
    nonce = secrets.token_bytes(channel.NONCE_SIZE)
    sock.sendall(nonce)
    link = channel.Link(sock, secret, nonce, is_server=True)
    return link, link.recv()


class BlobServer:
    """Serves the buffers ``publish`` names, to clients that know the job's secret, or tells a
    client which host to read one from (``RelayOrder``).

    Runs in the kernel beside the job's channel server. ``progress`` counts what was asked
    for and received since ``reset_progress``, and by which client host (the address it
    connected from): what the dashboard shows, and what "once per host" is checked by. A
    host reading from another host reports its bytes on the connection it asked on.
    """

    def __init__(self, host: str, secret: bytes, relays: bool | None = None):
        self._secret = secret
        self._use_relays = os.environ.get(RELAY_ENV, "1") != "0" if relays is None else relays
        self._buffers: dict[str, memoryview] = {}
        self._labels: dict[str, str] = {}
        self._chunks: dict[str, list[str]] = {}  # computed when a second host asks: one host needs none
        self._chunking = threading.Lock()  # apart from _lock, which the progress counts take meanwhile
        self._relays = RelayOrder()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._progress = Progress()
        self._received: dict[tuple[str, str], int] = {}  # (host, digest) -> bytes it has, this progress
        # (digest, relay) -> how to make that host ask for a source again (RelayOrder.moves)
        self._movers: dict[tuple[str, tuple[str, int]], Callable[[], None]] = {}
        self._sock = socket.create_server((host, 0))
        self.address = (host, self._sock.getsockname()[1])
        self._thread = threading.Thread(target=serve_each_connection, name="hvdmagic-blobs", daemon=True,
                                        args=(self._sock, self._closed, self._serve, "hvdmagic-blob-send"))
        self._thread.start()

    def publish(self, buffers: dict[str, memoryview], labels: dict[str, str] | None = None) -> None:
        """Make these buffers (by digest) available; they stay so until ``withdraw``."""
        with self._lock:
            self._buffers.update(buffers)
            self._labels.update(labels or {})

    def progress(self) -> Progress:
        with self._lock:
            p = self._progress
            return Progress(p.requested, p.sent, p.from_kernel, dict(p.hosts), list(p.labels), p.started,
                            list(p.slow))

    def reset_progress(self) -> None:
        with self._lock:
            self._progress = Progress()
            self._received = {}

    def withdraw(self, digests) -> None:
        with self._lock:
            for digest in digests:
                self._buffers.pop(digest, None)
                self._chunks.pop(digest, None)

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            link, request = read_request(sock, self._secret)
            digest = str(request.get("digest", ""))
            offset = int(request.get("offset", 0))
            relay = _address(request.get("relay"))
            failed = [address for a in request.get("failed", ()) if (address := _address(a))]
            with self._lock:
                view = self._buffers.get(digest)
                if view is not None:
                    self._asked(peer, digest, view.nbytes)
                    source = (self._relays.source(digest, relay, failed, view.nbytes, offset)
                              if self._use_relays else None)
            if view is None:
                link.send({"size": None})
                return
            paced = (digest, relay) if relay is not None and self._use_relays else None
            if source is None:
                link.send({"size": view.nbytes, "source": None})
                moved = threading.Event()
                self._track(paced, moved.set)
                try:
                    self._send_bytes(sock, view, offset, peer, digest, paced, moved)
                finally:
                    self._untrack(paced, moved.set)
                return
            with self._chunking:  # hosts asking at once wait for one computation, not one each
                chunks = self._chunks.get(digest)
                if chunks is None:
                    chunks = self._chunks[digest] = chunk_digests(view)  # about 0.25 s a GB
            link.send({"size": view.nbytes, "source": list(source)})
            link.send({"chunks": chunks})  # a frame of its own: a first frame may hold 64 KiB only

            def move() -> None:
                with contextlib.suppress(OSError):
                    link.send({"move": True})

            self._track(paced, move)
            try:
                while not self._closed.is_set():  # the host's reports, until it has the blob or goes
                    received = int(link.recv().get("received", 0))
                    with self._lock:
                        self._credit(peer, digest, received)
                    self._pace(paced, received, view.nbytes)
            finally:
                self._untrack(paced, move)
        except (channel.ChannelError, OSError, ValueError, TypeError):
            pass  # the client sees the short read or the closed link, and says so
        finally:
            sock.close()

    def _track(self, paced: tuple[str, tuple[str, int]] | None, mover: Callable[[], None]) -> None:
        if paced is not None:
            with self._lock:
                self._movers[paced] = mover

    def _untrack(self, paced: tuple[str, tuple[str, int]] | None, mover: Callable[[], None]) -> None:
        with self._lock:
            if paced is not None and self._movers.get(paced) == mover:  # not a later request's
                del self._movers[paced]

    def _pace(self, paced: tuple[str, tuple[str, int]] | None, received: int, size: int) -> None:
        """Note a host's bytes in the relay order's pace, and make the hosts it moves ask again."""
        if paced is None:
            return
        digest, relay = paced
        with self._lock:
            now = time.monotonic()
            self._relays.note(digest, relay, received, now)
            moved = self._relays.moves(digest, size, now)
            movers = [self._movers.get((digest, host)) for host in moved]
            if moved:  # the slow hosts change only with a move
                for host, _ in self._relays.slow(digest):
                    if host not in self._progress.slow:
                        self._progress.slow.append(host)
        for mover in movers:
            if mover is not None:  # a host between two requests asks again anyway
                mover()

    def _asked(self, peer: str, digest: str, size: int) -> None:
        progress = self._progress
        progress.started = progress.started or time.monotonic()
        if (peer, digest) not in self._received:  # a host asking again (its source failed) wants no more
            self._received[(peer, digest)] = 0
            progress.requested += size
            progress.hosts.setdefault(peer, 0)
        label = self._labels.get(digest, "")
        if label and label not in progress.labels:
            progress.labels.append(label)

    def _credit(self, peer: str, digest: str, received: int) -> None:
        """``peer`` now has ``received`` bytes of ``digest`` (called under the lock)."""
        gained = received - self._received.get((peer, digest), 0)
        if gained > 0:
            self._received[(peer, digest)] = received
            self._progress.sent += gained
            self._progress.hosts[peer] = self._progress.hosts.get(peer, 0) + gained

    def _send_bytes(self, sock: socket.socket, view: memoryview, offset: int, peer: str, digest: str,
                    paced: tuple[str, tuple[str, int]] | None, moved: threading.Event) -> None:
        """The blob from ``offset``, until it is all sent or the host is ``moved`` (it then finds the
        connection closed at a chunk's end, and asks again)."""
        for start in range(offset, view.nbytes, CHUNK):
            if self._closed.is_set() or moved.is_set():
                return
            chunk = view[start:start + CHUNK]
            sock.sendall(chunk)
            with self._lock:
                self._progress.from_kernel += chunk.nbytes
                self._credit(peer, digest, start + chunk.nbytes)
            self._pace(paced, start + chunk.nbytes, view.nbytes)

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
            self._chunks.clear()


def _address(value) -> tuple[str, int] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return str(value[0]), int(value[1])
    return None


class _SourceFailed(Exception):
    """A host we read from broke, stalled or sent a bad chunk: ask the kernel for another source."""


class _Moved(Exception):
    """The kernel moved this host in the chain (RelayOrder.moves): ask it for the new source."""


@dataclass
class Relay:
    """How the fetching host passes a blob on: the address its relay serves on, and ``ready(n)``,
    told that the first ``n`` bytes of the blob now lie in the file the relay serves (n may fall
    back, when a resume overwrites bytes)."""

    address: tuple[str, int]
    ready: Callable[[int], None]


class _Receiver:
    """The bytes of one blob arriving into ``into``, from the kernel or from hosts, checked."""

    def __init__(self, blob: Blob, into: memoryview, on_progress: Callable[[int], None], relay: Relay | None):
        import blake3

        self._hash = blake3.blake3
        self.blob = blob
        self.into = into
        self.name = blob.label or blob.digest
        self.on_progress = on_progress
        self.relay = relay
        self.chunks: list[str] | None = None  # once a host is a source: each chunk is checked
        self.whole = self._hash()  # from the kernel alone: the whole blob is checked at the end
        self.received = 0  # bytes in ``into``, in order from the start
        self.good = 0  # of those, the bytes checked (a chunk boundary), where a resume starts
        self.reported = time.monotonic()
        self.progressed = time.monotonic()  # when a byte last came

    def read(self, sock: socket.socket, source: str, report: Callable[[], None] = lambda: None) -> None:
        """Read from ``sock`` until the blob is complete; raises ``_SourceFailed`` (a host's fault),
        ``TimeoutError`` or ``BlobError``."""
        size = self.blob.size
        while self.received < size:
            got = sock.recv_into(self.into[self.received:self.received + CHUNK])
            if not got:
                raise _SourceFailed(f"the connection to {source} closed after {self.received} of {size} bytes "
                                    f"of {self.name}")
            if self.chunks is None:
                self.whole.update(self.into[self.received:self.received + got])
            self.received += got
            self.progressed = time.monotonic()
            self._check_chunks(source)
            if self.relay is not None:
                self.relay.ready(self.received)
            if time.monotonic() - self.reported > _REPORT_EVERY:
                self.reported = time.monotonic()
                self.on_progress(self.received)
                report()

    def _check_chunks(self, source: str) -> None:
        if self.chunks is None:
            self.good = self.received
            return
        while self.good < self.received:
            end = min(self.good + CHUNK, self.blob.size)
            if self.received < end:
                return
            if self._hash(self.into[self.good:end]).hexdigest() != self.chunks[self.good // CHUNK]:
                raise _SourceFailed(f"{source} sent an altered chunk of {self.name} (its BLAKE3 digest does not "
                                    "match)")
            self.good = end

    def check_from_start(self) -> None:
        """Check the bytes that came from the kernel against the chunk digests, now that a host is the
        source: they were to be checked whole at the end, which a blob from two sources cannot be."""
        checked, self.good = self.received, 0
        while (end := min(self.good + CHUNK, self.blob.size)) <= checked and self.good < checked:
            if self._hash(self.into[self.good:end]).hexdigest() != self.chunks[self.good // CHUNK]:
                raise BlobError(f"{self.name} arrived altered from the kernel (a chunk's BLAKE3 digest does not "
                                "match): dropped unread")
            self.good = end

    def resume_from_good(self) -> None:
        self.received = self.good
        if self.relay is not None:
            self.relay.ready(self.received)


def fetch(address: tuple[str, int], secret: bytes, blob: Blob, into: memoryview,
          on_progress: Callable[[int], None] = lambda n: None, timeout: float = 60.0,
          relay: Relay | None = None) -> None:
    """Stream ``blob`` into ``into`` (``blob.size`` bytes: a mapped file) and check it.

    ``address`` is the kernel's blob server, which sends the blob or names the host to read it
    from. ``relay``: this host passes the blob on to hosts that ask after it (see ``Relay``).
    ``timeout`` bounds each wait for the kernel, not the transfer: a large blob takes as long as
    the network needs, and a stalled one fails. A host as the source gets ``PEER_STALL``. A
    connection to the kernel that the network resets is made again, and the blob goes on from its
    last checked byte, until ``timeout`` passes without one.
    """
    receiver = _Receiver(blob, into, on_progress, relay)
    failed: list[list] = []
    kernel_closes = 0  # the kernel closes a stream early to move this host in the chain, or as it goes
    retry = RETRY_FIRST
    while receiver.received < blob.size or receiver.good < blob.size:
        receiver.resume_from_good()
        link = None
        try:
            link = channel.connect(*address, secret, timeout=timeout)
            link.sock.settimeout(timeout)
            link.send({"digest": blob.digest, "offset": receiver.received, "failed": failed,
                       "relay": list(relay.address) if relay else None})
            reply = link.recv()
            size = reply.get("size")
            if size is None:
                raise BlobError(f"the kernel no longer holds {receiver.name} (its cell ended?)")
            if size != blob.size:
                raise BlobError(f"the kernel offered {size} bytes for {receiver.name}, not {blob.size}")
            source = _address(reply.get("source"))
            if source is None:
                try:
                    receiver.read(link.sock, "the kernel")
                except _SourceFailed as exc:
                    kernel_closes += 1
                    if kernel_closes > MAX_KERNEL_CLOSES:
                        raise BlobError(str(exc)) from None
                continue
            if receiver.chunks is None:
                receiver.chunks = list(link.recv()["chunks"])
                receiver.check_from_start()
                receiver.resume_from_good()
            else:
                link.recv()  # the same chunk digests again
            try:
                _read_from_host(source, secret, receiver, link)
            except _Moved:
                pass
            except (_SourceFailed, OSError):  # a ChannelError and a timeout are OSErrors too
                failed.append(list(source))
        except TimeoutError as exc:
            raise BlobError(f"the kernel's blob server at {address[0]}:{address[1]} did not answer within "
                            f"{timeout:g} s") from exc
        except channel.ChannelError as exc:
            raise BlobError(f"the kernel's blob server at {address[0]}:{address[1]}: {exc}") from exc
        except BlobError:
            raise
        except OSError as exc:  # reset, aborted, refused: the network between this host and the kernel
            if time.monotonic() - receiver.progressed > timeout:
                raise BlobError(f"the kernel's blob server at {address[0]}:{address[1]}: {exc}, and no byte of "
                                f"{receiver.name} came for {timeout:g} s") from exc
            time.sleep(retry)  # a backoff between tries, not a wait for an event
            retry = min(retry * 2, RETRY_MAX)
        finally:
            if link is not None:
                link.close()
    on_progress(receiver.received)
    if receiver.chunks is None and receiver.whole.hexdigest() != blob.digest:
        raise BlobError(f"{receiver.name} arrived altered (its BLAKE3 digest does not match): dropped unread")


def _read_from_host(source: tuple[str, int], secret: bytes, receiver: _Receiver, kernel: channel.Link) -> None:
    """Read the rest of the blob from another host's relay, telling the kernel how far we are."""
    name = f"host {source[0]}"

    def report() -> None:
        try:
            kernel.send({"received": receiver.good})
            if select.select([kernel.sock], [], [], 0)[0] and kernel.recv().get("move"):
                raise _Moved
        except OSError:
            pass  # the kernel's count is for the dashboard and the order's pace: the bytes matter more

    link = channel.connect(*source, secret, timeout=PEER_STALL)
    try:
        link.sock.settimeout(PEER_STALL)
        link.send({"digest": receiver.blob.digest, "offset": receiver.received})
        if link.recv().get("size") != receiver.blob.size:
            raise _SourceFailed(f"{name} does not hold {receiver.name}")
        try:
            receiver.read(link.sock, name, report)
        except TimeoutError:
            raise _SourceFailed(f"{name} sent nothing for {PEER_STALL:g} s") from None
        report()
    finally:
        link.close()
