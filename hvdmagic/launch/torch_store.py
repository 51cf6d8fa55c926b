"""torch.distributed's rendezvous for ``%%torchrun``: the store torchrun's agent would host.

torchrun starts a TCPStore in its agent and tells every rank, rank 0 included, to
join it as a client (``TORCHELASTIC_USE_AGENT_STORE``). The kernel plays that
agent: the store listens on a port the operating system picks, so two jobs never
collide, and on the driver address only. Like torchrun's, it has no authentication
of its own, and it lives only while the job runs.
"""

from __future__ import annotations

import os
import socket


class TorchStore:
    def __init__(self, host: str, np: int):
        from torch.distributed import TCPStore

        # TCPStore binds every interface when it opens its own socket; handed a listening
        # one (master_listen_fd), it serves that and closes it when it is done.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.create_server((host, 0), family=family, backlog=socket.SOMAXCONN) as listener:
            fd = os.dup(listener.fileno())
            try:
                self._store = TCPStore(host, listener.getsockname()[1], np, is_master=True, wait_for_workers=False,
                                       master_listen_fd=fd)
            except BaseException:
                os.close(fd)
                raise
        self.port = self._store.port

    def place(self, layout) -> None:
        pass  # torch.distributed needs no plan: every rank brings its own RANK and WORLD_SIZE

    def stop(self) -> None:
        self._store = None  # the server thread ends with the object, and closes the socket
