"""What the kernel ships for a run: the payload, and the buffers behind its blobs.

Runs in the kernel. ``pack`` pickles ``(fn, args, kwargs)`` with its large buffers out of
band (``pickling.dumps_out_of_band``) and names each by its content (``digest``), so the
payload itself stays small: the buffers are served by the job's blob server
(``blob_transfer``) to each host that lacks them, once per host.

Naming a buffer takes a BLAKE3 pass over it (0.1-0.2 s/GB here), which the hosts check
it against. An unchanged buffer (a session's next cell reading the same 1 GB array) is
recognised by an xxh3 pass instead, at memory speed, and keeps its name: its hosts have it
cached already, and nothing is sent. The content is read each time, never trusted from the
object's identity: an array changed in place between cells is shipped again.
"""

from __future__ import annotations

import dis
import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from hvdmagic import pickling
from hvdmagic.protocol import Blob, Payload

# A head beyond this (a large list or dict of Python objects) goes as a blob too: inline, it
# would be copied into the Spark closure or base64'd into a channel frame.
HEAD_INLINE_MAX = 8 << 20
# The digests remembered, by content fingerprint: enough for a session's globals.
_REMEMBERED = 256


@dataclass
class Shipment:
    payload: Payload
    buffers: dict[str, memoryview] = field(default_factory=dict)  # by digest: what the blob server serves
    imports: tuple[str, ...] = ()  # the frameworks the function imports: what a host's rank template imports ahead

    @property
    def size(self) -> int:
        return self.payload.size

    @property
    def labels(self) -> dict[str, str]:
        return {blob.digest: blob.label for blob in self.payload.blobs}


class _Digests:
    """BLAKE3 digests, each computed once per content: an xxh3 fingerprint finds it again."""

    def __init__(self):
        self._known: OrderedDict[tuple[bytes, int], str] = OrderedDict()
        self._lock = threading.Lock()

    def of(self, view: memoryview) -> str:
        import blake3
        import xxhash

        key = (xxhash.xxh3_128_digest(view), view.nbytes)
        with self._lock:
            digest = self._known.get(key)
            if digest is not None:
                self._known.move_to_end(key)
                return digest
        digest = blake3.blake3(view, max_threads=blake3.blake3.AUTO).hexdigest()
        with self._lock:
            self._known[key] = digest
            while len(self._known) > _REMEMBERED:
                self._known.popitem(last=False)
        return digest


digest = _Digests().of


def blobs_of(views: list[memoryview], label: str) -> tuple[tuple[str, ...], dict[str, Blob], dict[str, memoryview]]:
    """Name each buffer: its digests in order, its blobs and its buffers by digest."""
    digests = tuple(digest(view) for view in views)
    blobs = {d: Blob(d, view.nbytes, label) for d, view in zip(digests, views)}
    return digests, blobs, dict(zip(digests, views))


def pack(obj, *, label: str = "the function and its arguments", blobs: dict[str, Blob] | None = None,
         buffers: dict[str, memoryview] | None = None, imports: list[str] | None = None) -> Shipment:
    """``obj`` (``(fn, args, kwargs)``) as a shipment; ``blobs``/``buffers``: those of values it
    carries already pickled (a cell's captured globals); ``imports``: the modules it imports, where
    the caller knows them from the source (else read from the function's bytecode)."""
    head, views = pickling.dumps_out_of_band(obj)
    digests, own_blobs, own_buffers = blobs_of(views, label)
    blobs = {**(blobs or {}), **own_blobs}
    buffers = {**(buffers or {}), **own_buffers}
    head_blob = None
    if len(head) > HEAD_INLINE_MAX:
        view = memoryview(head)
        head_blob = digest(view)
        blobs[head_blob] = Blob(head_blob, len(head), label)
        buffers[head_blob] = view
        head = b""
    if imports is not None:
        preloaded = tuple(name for name in imports if _preloadable(name))
    else:
        preloaded = framework_imports(obj[0]) if isinstance(obj, tuple) and obj and callable(obj[0]) else ()
    return Shipment(Payload(head, digests, tuple(blobs.values()), head_blob), buffers, preloaded)


# Packages whose import is the ranks' wait (seconds each), and which start no thread a fork would
# break when imported (rank.template checks that again before each fork).
_PRELOADED = {"numpy", "torch", "torchvision", "tensorflow", "tf_keras", "keras", "lightning", "pytorch_lightning"}
_HOROVOD_FRAMEWORKS = {"torch", "tensorflow", "keras"}


def framework_imports(fn) -> tuple[str, ...]:
    """The framework modules ``fn``'s code imports, with its nested functions', its closure's and
    what it wraps: read from the bytecode's IMPORT_NAME, nothing imported or run."""
    names: dict[str, None] = {}
    seen: set[int] = set()

    def visit_code(code) -> None:
        if id(code) in seen:
            return
        seen.add(id(code))
        for instruction in dis.get_instructions(code):
            if instruction.opname == "IMPORT_NAME" and _preloadable(str(instruction.argval)):
                names.setdefault(str(instruction.argval))
        for const in code.co_consts:
            if hasattr(const, "co_code"):
                visit_code(const)

    def visit(obj, depth: int = 0) -> None:
        if depth > 3 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, functools.partial):
            visit(obj.func, depth + 1)
        code = getattr(obj, "__code__", None)
        if code is not None:
            visit_code(code)
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if callable(contents):
                visit(contents, depth + 1)
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is not None:
            visit(wrapped, depth + 1)

    visit(fn)
    return tuple(names)


def _preloadable(module: str) -> bool:
    parts = module.split(".")
    if parts[0] == "horovod":
        return len(parts) > 1 and parts[1] in _HOROVOD_FRAMEWORKS
    return parts[0] in _PRELOADED
