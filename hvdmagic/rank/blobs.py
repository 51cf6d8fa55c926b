"""A payload's blobs, as a rank maps them from its host's cache.

The supervisor fetched every blob of the payload into the host's cache
(``task.blob_cache``) before handing the rank its head, and named the cache in
``HVDMAGIC_BLOB_DIR``. Each blob is mapped copy-on-write: the host's ranks share its pages,
and a rank that writes to an array it was given changes its own copy only, as it would
have with a pickled one.
"""

from __future__ import annotations

import mmap
import os
import pickle
from pathlib import Path

from hvdmagic.protocol import BLOB_DIR_ENV, Payload


class PayloadError(RuntimeError):
    """The payload's blobs could not reach this host (``fail``): raised in the rank, reported as its error."""


def mapped(digest: str) -> memoryview:
    path = Path(os.environ[BLOB_DIR_ENV]) / digest
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE))


def load(head, digests) -> object:
    """Unpickle ``head`` with the blobs ``digests`` names as its out-of-band buffers."""
    return pickle.loads(head, buffers=[mapped(digest) for digest in digests])


def load_payload(payload: Payload) -> tuple:
    """The ``(fn, args, kwargs)`` of a payload read from stdin."""
    head = mapped(payload.head_blob) if payload.head_blob else payload.head
    return load(head, payload.buffers)


def fail(message: str):
    """What a supervisor hands its rank instead of a payload whose blobs it could not fetch: the
    rank reports the error as it would its cell's own (its traceback trimmed to nothing)."""
    raise PayloadError(message)
