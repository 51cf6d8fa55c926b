"""A fitted model's way to the executors for ``transform``: inside the UDF when small, else once per host.

Runs in the kernel. A model's pickled bytes up to ``INLINE_MAX`` travel inside the pandas UDF,
as any closure does. A larger model would travel with every task on Spark Connect (the server
sends a UDF's bytes with each task), and a classic session broadcasts it once per executor and
once per transform. So its bytes are published on this kernel's blob server instead
(``blob_transfer``), and the UDF carries only their name (``task.batch_inference.ModelSource``):
each host's first task fetches them once into the host's blob cache (``task.blob_cache``), the
hosts after it read them from a host that has them (the fan-out), and each Python worker loads
them once. A later transform with the same model finds them on the host and fetches nothing.

The server is the kernel's own for transforms, with its own secret, and lives as long as the
kernel: a transformed DataFrame is lazy and runs its plan whenever an action asks. It holds the
bytes of the models that transforms named, the latest first, within ``KEPT_BYTES`` (the latest
always): a plan whose model was let go fails in one paragraph that says to call transform again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from hvdmagic import blob_transfer, channel
from hvdmagic.launch.shipment import digest
from hvdmagic.protocol import Blob
from hvdmagic.task.batch_inference import ModelSource

# Spark's own threshold for broadcasting a UDF's bytes on a classic session (1 MiB): below it, the
# bytes cost each task less than a connection to the kernel would.
INLINE_MAX = 1 << 20
KEPT_BYTES = 2 << 30


class _ModelServer:
    """The blob server of one kernel address, and the models it holds, least recently named first."""

    def __init__(self, host: str):
        self.secret = channel.new_secret()
        self.blobs = blob_transfer.BlobServer(host, self.secret)
        self._held: OrderedDict[str, int] = OrderedDict()  # digest -> size

    def offer(self, view: memoryview, name: str, label: str) -> None:
        self.blobs.publish({name: view}, {name: label})
        self._held[name] = view.nbytes
        self._held.move_to_end(name)
        while len(self._held) > 1 and sum(self._held.values()) > KEPT_BYTES:
            self.blobs.withdraw([self._held.popitem(last=False)[0]])


_servers: dict[str, _ModelServer] = {}  # by the address the executors reach this kernel at
_lock = threading.Lock()


def source_for(model_bytes: bytes, kernel_host: str, label: str) -> ModelSource:
    """How the executors get ``model_bytes``: inline if small, else from this kernel at ``kernel_host``."""
    view = memoryview(model_bytes)
    name = digest(view)
    if view.nbytes <= INLINE_MAX:
        return ModelSource(name, inline=model_bytes)
    with _lock:
        server = _servers.get(kernel_host)
        if server is None:
            server = _servers[kernel_host] = _ModelServer(kernel_host)
        server.offer(view, name, label)
    return ModelSource(name, blob=Blob(name, view.nbytes, label), address=server.blobs.address,
                       secret=server.secret)

