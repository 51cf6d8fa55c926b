"""A host's blob cache: each blob of a payload fetched once per host, kept for later cells.

Runs in the task (a Spark task's Python worker, or a local-mode thread in the kernel).
The host's tasks share one directory: the first to need a blob takes its lock and
fetches it (``blob_transfer.fetch``) into a file there, and the others, waiting on the
lock, find it done. With a relay (``task.blob_relay``), that task passes the blob on to
the job's other hosts while it arrives. Its ranks map the file (``rank.blobs``). A blob stays for the next
cell or job that reads the same content, until the cache outgrows its budget; the least
recently used go first, never one the current payload needs.

The directory is in the temporary directory: the files live in the page cache while they
are used, so ranks map them at memory speed, and the operating system may reclaim that
memory once they are not (a directory in ``/dev/shm`` would pin it until evicted, since
nothing cleans a worker host when the notebook ends). ``HVDMAGIC_BLOB_CACHE`` names another
directory and ``HVDMAGIC_BLOB_CACHE_BYTES`` sets the budget (by default a quarter of the
file system, at most 16 GiB); a blob unused for a day goes at the next fetch. The directory
belongs to this user alone (0700).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from hvdmagic.blob_transfer import BlobError, fetch, format_size
from hvdmagic.protocol import Blob
from hvdmagic.task.blob_relay import BlobRelay

DIR_ENV = "HVDMAGIC_BLOB_CACHE"
BUDGET_ENV = "HVDMAGIC_BLOB_CACHE_BYTES"
_MAX_BUDGET = 16 << 30
_IDLE_LIMIT = 24 * 3600.0
# Room left free beside a blob, so that fetching it does not fill the disk for everyone else.
_HEADROOM = 64 << 20
# A partial file older than this was left by a task that died mid-fetch.
_STALE_PART = 3600.0


class NoRoom(BlobError):
    """The host cannot hold a blob: too little memory or disk where the cache lives."""


def cache_dir() -> Path:
    configured = os.environ.get(DIR_ENV)
    directory = Path(configured) if configured else Path(tempfile.gettempdir()) / f"hvdmagic-blobs-{os.getuid()}"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    status = directory.stat()
    if status.st_uid != os.getuid() or status.st_mode & 0o077:
        raise BlobError(f"the blob cache {directory} is not this user's own (it must be mode 0700): set "
                        f"{DIR_ENV} to a private directory")
    return directory


def _budget(directory: Path) -> int:
    configured = os.environ.get(BUDGET_ENV)
    return int(configured) if configured else min(_MAX_BUDGET, shutil.disk_usage(directory).total // 4)


class BlobCache:
    def __init__(self, directory: Path | None = None):
        self.directory = directory or cache_dir()

    def path(self, blob: Blob) -> Path:
        return self.directory / blob.digest

    def ensure(self, blobs: Iterable[Blob], address: tuple[str, int], secret: bytes,
               on_progress: Callable[[Blob, int], None] = lambda blob, n: None,
               relay: BlobRelay | None = None) -> None:
        """Every blob in the cache, fetching each one missing through the kernel at ``address``
        (``relay``: passing each on to the hosts that ask after this one)."""
        blobs = list(blobs)
        for blob in blobs:
            path = self.path(blob)
            if self._touch(path):
                continue
            with self._locked(blob):
                if self._touch(path):
                    continue  # another task of this host fetched it meanwhile
                self._make_room(blob, keep={b.digest for b in blobs})
                self._fetch(blob, address, secret, lambda n, blob=blob: on_progress(blob, n), relay)

    @staticmethod
    def _touch(path: Path) -> bool:
        """Whether the blob is here; marks it as just used (the eviction order)."""
        try:
            os.utime(path)
            return True
        except FileNotFoundError:
            return False

    @contextlib.contextmanager
    def _locked(self, blob: Blob):
        with open(self.directory / f"{blob.digest}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _fetch(self, blob: Blob, address: tuple[str, int], secret: bytes, on_progress,
               relay: BlobRelay | None) -> None:
        partial = self.directory / f"{blob.digest}.part-{os.getpid()}"
        fd = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if not blob.size:
                os.rename(partial, self.path(blob))
                return
            try:
                os.posix_fallocate(fd, 0, blob.size)  # fail now, not at a page fault mid-copy
            except OSError as exc:
                raise self._no_room(blob) from exc
            # The relay serves the arriving file until it has its name: a host asking in between
            # then opens it by that name.
            with (relay.offering(blob, fd) if relay else contextlib.nullcontext()) as passing_on:
                with mmap.mmap(fd, blob.size) as into:
                    view = memoryview(into)
                    try:
                        fetch(address, secret, blob, view, on_progress, relay=passing_on)
                    finally:
                        view.release()
                os.rename(partial, self.path(blob))
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    def _make_room(self, blob: Blob, keep: set[str]) -> None:
        """Evict least recently used blobs until ``blob`` fits the budget and the free space."""
        budget = _budget(self.directory)
        now = time.time()
        entries = []
        for path in self.directory.iterdir():
            name = path.name
            try:
                status = path.stat()
            except FileNotFoundError:
                continue
            if ".part-" in name:
                if now - status.st_mtime > _STALE_PART:
                    path.unlink(missing_ok=True)
            elif not name.endswith(".lock") and name not in keep:
                entries.append((status.st_mtime, status.st_size, path))
        entries.sort()
        held = sum(size for _, size, _ in entries)
        for used, size, path in entries:
            fits = held + blob.size <= budget and shutil.disk_usage(self.directory).free >= blob.size + _HEADROOM
            if fits and now - used < _IDLE_LIMIT:
                break
            path.unlink(missing_ok=True)
            held -= size
        if shutil.disk_usage(self.directory).free < blob.size + _HEADROOM:
            raise self._no_room(blob)

    def _no_room(self, blob: Blob) -> NoRoom:
        free = shutil.disk_usage(self.directory).free
        return NoRoom(
            f"{blob.label or 'a value the cell reads'} ({format_size(blob.size)}) does not fit on this host: "
            f"{self.directory} has {format_size(free)} free. Pass large data with --data (a Spark DataFrame, "
            f"sharded across the ranks), or load it inside the cell from a file every rank can read; "
            f"or point {DIR_ENV} at a larger directory.")


def fetched_in_background(cache: BlobCache, blobs: Iterable[Blob], address: tuple[str, int], secret: bytes,
                          relay: BlobRelay | None = None):
    """Start fetching now; the returned function waits for it and raises what it raised."""
    import concurrent.futures

    blobs = list(blobs)
    if not blobs:  # most payloads: no thread for nothing
        return lambda: None

    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hvdmagic-blob-fetch")
    future = executor.submit(cache.ensure, blobs, address, secret, relay=relay)
    executor.shutdown(wait=False)
    return future.result
