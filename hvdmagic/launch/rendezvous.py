"""Horovod's own Gloo RendezvousServer, bound to the one address the ranks use.

RendezvousServer.start() listens on every interface of the driver. We keep
horovod's class (its init/stop and its HTTP handler) and override start(), so
the key-value store is reachable on the driver address alone, and the handler's
DELETE, which in horovod 0.28.1 forgets other scopes' progress (``ScopedHandler``),
and its GET, which answers a key not yet there at once (``LONG_POLL``).
"""

from __future__ import annotations

import sys
import threading

from horovod.runner.http.http_server import OK, RendezvousHandler, RendezvousHTTPServer, RendezvousServer
from horovod.runner.util.threads import in_thread

# Gloo's HTTPStore waits for a key by asking for it every 10 ms, each time on a new connection
# (horovod/common/gloo/http_store.cc, HTTPStore::wait): while 48 ranks waited in hvd.init() for
# slower ones, that cost the kernel 0.65 s of CPU a rank (docs/performance.md, "128 ranks on 16
# hosts"). A request for a missing key is held this long, or until a PUT brings the key, so a
# waiting rank asks twice a second instead of a hundred times. Horovod's client has no
# read timeout, and the handler's socket timeout (3 s) is longer.
LONG_POLL = 0.5


class ScopedHandler(RendezvousHandler):
    """horovod's handler, but a Gloo scope whose ranks have all finalized clears its own list only.

    Each rank DELETEs its key of a scope (``global``, ``local_<host>``, ``cross_<n>``) when
    ``hvd.shutdown()`` finalizes its Gloo context; once the scope's last rank has, the server
    drops the scope's addresses. horovod 0.28.1 then clears every scope's list of finalized
    ranks: a scope still half finalized (two ranks of ``local_<host>``, while a one-rank
    ``cross_<n>`` completes at once) never completes, and its addresses outlive it. The next
    ``hvd.init()`` in the same processes (``hvd.shutdown(); hvd.init()``, as horovod's own test
    suite does between tests) may read a dead peer's address: Gloo's connect throws in horovod's
    background thread and the rank dies of SIGABRT (docs/frameworks.md).

    A GET for a key not there yet waits for it up to ``LONG_POLL``.
    """

    def do_GET(self):
        parts = self.path.split("/")
        if len(parts) == 3:
            _, scope, key = parts
            with self.server.key_arrived:
                self.server.key_arrived.wait_for(lambda: self._get_value(scope, key) is not None, LONG_POLL)
        super().do_GET()

    def do_PUT(self):
        super().do_PUT()
        with self.server.key_arrived:
            self.server.key_arrived.notify_all()

    def do_DELETE(self):
        parts = self.path.split("/")
        server = self.server
        if len(parts) != 3 or parts[1] not in server.scope_size:
            return super().do_DELETE()  # a malformed path, or an ad-hoc scope: horovod's own handling
        _, scope, key = parts
        with server.finished_list_lock:
            finished = server.finished_list[scope]
            finished.append(key)
            if len(finished) == server.scope_size[scope]:
                with server.cache_lock:
                    server.cache.get(scope, {}).clear()
                finished.clear()
        self.send_status_code(OK)


class QuietServer(RendezvousHTTPServer):
    """Horovod's server, quiet about a rank gone mid-request: Stop ends ranks while they wait in
    hvd.init(), and a lost host's ranks vanish, so an answer may meet a reset connection. Python's
    socket server prints a traceback to the kernel's stderr then, which is the cell's output: red
    text under a Stop's one line. The rank's own end says what happened; any other error still prints."""

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):  # ConnectionResetError, BrokenPipeError, a timeout
            super().handle_error(request, client_address)


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

    def start(self, handler_cls=ScopedHandler) -> int:
        self._httpd = QuietServer((self._host, 0), handler_cls, self._verbose)
        self._httpd.key_arrived = threading.Condition()  # ScopedHandler's long poll
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
