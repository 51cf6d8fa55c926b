"""torch.distributed's rendezvous for ``%%torchrun``: the store torchrun's agent would host.

torchrun starts a TCPStore in its agent and tells every rank, rank 0 included, to
join it as a client (``TORCHELASTIC_USE_AGENT_STORE``). The kernel plays that
agent: the store listens on a port the operating system picks, so two jobs never
collide, and on the driver address only. Like torchrun's, it has no authentication
of its own, and it lives only while the job runs.
"""

from __future__ import annotations

import os
import re
import socket

from hvdmagic.errors import LaunchError


class TorchStore:
    def __init__(self, host: str, np: int):
        # TCPStore binds every interface when it opens its own socket; handed a listening
        # one (master_listen_fd), it serves that and closes it when it is done.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.create_server((host, 0), family=family, backlog=socket.SOMAXCONN) as listener:
            self._store = _serve(listener, host, np)
        self.port = self._store.port

    def place(self, layout) -> None:
        pass  # torch.distributed needs no plan: every rank brings its own RANK and WORLD_SIZE

    def stop(self) -> None:
        self._store = None  # the server thread ends with the object, and closes the socket


def _serve(listener: socket.socket, host: str, np: int):
    """A TCPStore server on ``listener``. Its libuv server (torch's default from 2.4) takes a handed
    socket from torch 2.8 on; torch 2.4 to 2.7's refuses it (NotImplementedError, after an error line
    on stderr), and their classic server, which the ranks' clients speak the same protocol to, is
    asked first there. torch < 2.4 has only the classic server (no ``use_libuv``). The other choice
    stays as the fallback, so a torch that differs from this costs a retry, not the cell."""
    import torch
    from torch.distributed import TCPStore

    release = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])
    attempts: list[dict] = [{}, {"use_libuv": False}]
    if (2, 4) <= release < (2, 8):
        attempts.reverse()
    refusal: Exception | None = None
    for extra in attempts:
        fd = os.dup(listener.fileno())
        try:
            return TCPStore(host, listener.getsockname()[1], np, is_master=True, wait_for_workers=False,
                            master_listen_fd=fd, **extra)
        except (NotImplementedError, TypeError) as exc:  # TypeError: a torch without use_libuv
            os.close(fd)
            refusal = exc
        except BaseException:
            os.close(fd)
            raise
    raise LaunchError(
        f"torch {torch.__version__} cannot serve %%torchrun's rendezvous store on the driver's address "
        f"({host}): its TCPStore refused the listening socket hvdmagic hands it ({refusal}). Install a "
        "torch that hvdmagic supports (docs/runtimes.md), or use %%horovod.")
