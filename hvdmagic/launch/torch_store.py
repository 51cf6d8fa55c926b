"""torch.distributed's rendezvous for ``%%torchrun``: the store torchrun's agent would host.

torchrun starts a TCPStore in its agent and tells every rank, rank 0 included, to
join it as a client (``TORCHELASTIC_USE_AGENT_STORE``). The kernel plays that
agent: the store listens on a port the operating system picks, so two jobs never
collide; the ranks reach it at the driver address. TCPStore itself listens on
every interface, and, like torchrun's, has no authentication of its own; it lives
only while the job runs.
"""

from __future__ import annotations


class TorchStore:
    def __init__(self, host: str, np: int):
        from torch.distributed import TCPStore

        self._store = TCPStore(host, 0, np, is_master=True, wait_for_workers=False)
        self.port = self._store.port

    def place(self, layout) -> None:
        pass  # torch.distributed needs no plan: every rank brings its own RANK and WORLD_SIZE

    def stop(self) -> None:
        self._store = None  # the server thread ends with the object
