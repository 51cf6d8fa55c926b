"""Inside a rank of an elastic job: two hooks into Horovod's own elastic machinery.

Horovod's worker registers its notification service (the addresses the driver
calls when hosts come or go, and that service's secret) by a PUT to the
rendezvous' HTTP store, which the driver unpickles: an unauthenticated pickle.
Here the same registration goes to the driver over this rank's event socket and
the job's HMAC channel instead, and the driver's HTTP handler refuses the PUT. The
service itself (which checks an HMAC with that secret on every request) listens on
the rank's Gloo interface only.

After every reset (``State.on_reset``) the rank tells the driver its new world
rank and size and the commit it went back to, which the dashboard shows as
"resumed on 3 ranks from the commit at epoch 2, batch 40". Before every commit the
kernel gets the metrics it buffered, and the commit waits until the kernel has them
(``telemetry.deliver``): the steps up to a commit are never trained again, so their
rows must not die with a worker lost after it, while they are still in its task.
"""

from __future__ import annotations

import os
import socket
import sys

from hvdmagic import protocol
from hvdmagic.rank import telemetry


def install() -> None:
    import horovod.runner.elastic.worker as worker
    from horovod.common import elastic
    from horovod.runner.common.util import network

    worker.put_data_into_kvstore = _register_over_channel
    # The notification service checks an HMAC on every request, but would listen on every
    # interface; the driver reaches it on the rank's Gloo interface, so it listens there only.
    address = _address_of(os.environ.get("HOROVOD_GLOO_IFACE", ""))
    if address:
        network.find_port = lambda make_server: _listen_on(make_server, address)
    restore_and_reset = elastic.State.on_reset

    def on_reset(state) -> None:
        restore_and_reset(state)
        telemetry.flush()  # the metrics from before the reset reach the driver before it hears of the reset
        telemetry.emit(protocol.reset(committed(state), **world()))

    elastic.State.on_reset = on_reset
    save_and_check_hosts = elastic.State.commit

    def commit(state) -> None:
        # Before the save and the check's collective: once any rank is past that collective the commit
        # holds for every rank, and this rank's worker may be lost the moment after.
        telemetry.deliver()
        save_and_check_hosts(state)

    elastic.State.commit = commit


def world() -> dict:
    """This rank's Horovod rank and size now, from whichever framework binding started it."""
    for name in telemetry.HOROVOD_MODULES:
        hvd = sys.modules.get(name)
        if hvd is not None and hvd.is_initialized():
            return {"world_rank": hvd.rank(), "size": hvd.size()}
    return {}


def committed(state) -> dict:
    """The plain values of the state's last commit (epoch, batch, ...): what a reset went back to."""
    saved = getattr(state, "_saved_state", None) or {}
    return {key: value for key, value in saved.items()
            if isinstance(value, (bool, int, float, str)) and not key.startswith("_")}


def _address_of(interface: str) -> str | None:
    import psutil

    addresses = [a.address for a in psutil.net_if_addrs().get(interface, []) if a.family == socket.AF_INET]
    return addresses[0] if addresses else None


def _listen_on(make_server, address: str):
    server = make_server((address, 0))
    return server, server.socket.getsockname()[1]


def _register_over_channel(_addr, _port, _scope, key: str, value) -> None:
    addresses, secret = value
    telemetry.emit(protocol.worker(key, secret, addresses, **world()))
