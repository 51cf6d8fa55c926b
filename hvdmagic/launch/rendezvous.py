"""Horovod's own Gloo RendezvousServer, bound to the one address the ranks use.

RendezvousServer.start() listens on every interface of the driver. We keep
horovod's class (its init/stop and its HTTP handler) and override only start()
so the key-value store is reachable on the driver address alone.
"""

from __future__ import annotations

from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer, RendezvousServer
from horovod.runner.util.threads import in_thread


class Rendezvous(RendezvousServer):
    """``start=False``: the caller starts it with a handler of its own (an elastic driver's)."""

    def __init__(self, host: str, np: int = 0, verbose: int = 0, start: bool = True):
        super().__init__(verbose)
        self._host = host
        self._stopped = False
        self._httpd = None
        self.port = self.start() if start else 0

    def place(self, layout) -> None:
        """The plan of every rank; horovod's ranks must not join before it is set."""
        from hvdmagic.launch.layout import horovod_plan

        self.init(horovod_plan(layout))

    def start(self, handler_cls=RendezvousHandler) -> int:
        self._httpd = RendezvousHTTPServer((self._host, 0), handler_cls, self._verbose)
        # stop() must not wait for requests still being served: an elastic driver stops the
        # rendezvous from the very barrier that a rank's request waits at.
        self._httpd.daemon_threads, self._httpd.block_on_close = True, False
        # A short poll interval: shutdown() waits for it, at the end of every job.
        self._listen_thread = in_thread(target=self._httpd.serve_forever, args=(0.05,))
        self.port = self._httpd.server_address[1]
        return self.port

    def stop(self) -> None:
        if self._stopped or self._httpd is None:
            return
        self._stopped = True
        super().stop()
        self._httpd.server_close()
