"""How long this rank waits in Horovod's collectives: what tells a straggler among ranks in step.

Ranks that meet in an allreduce every step make the same number of steps a second, the
straggler among them too: the others wait for it in each collective. What differs is that
wait. horovod.torch waits for every collective in ``mpi_ops.synchronize`` (``hvd.allreduce``
and friends, and the ``DistributedOptimizer``'s step alike), so this wraps it and adds up the
seconds spent there (``telemetry.add_wait``); each bar's state then carries the sum, and the
kernel leaves those seconds out of the rank's step rate (``kernel/stragglers.py``). The cost
is two clock reads per collective.

Not seen: TensorFlow's collectives (graph ops, waited for inside TensorFlow's C++) and
torch DDP's (launched from autograd hooks in C++): there every rank's rate includes the
wait, and only ranks that do not wait for each other can be told apart.
"""

from __future__ import annotations

import functools
import sys
import time

from hvdmagic.rank import telemetry


def adopt_horovod_torch(package) -> None:
    """Time ``synchronize`` wherever horovod.torch keeps a name for it (imported: ``package``)."""
    mpi_ops = sys.modules.get("horovod.torch.mpi_ops")
    original = getattr(mpi_ops, "synchronize", None)
    if original is None or getattr(original, "_hvdmagic_timed", False):
        return

    @functools.wraps(original)
    def synchronize(handle):
        started = time.perf_counter()
        try:
            return original(handle)
        finally:
            telemetry.add_wait(time.perf_counter() - started)

    synchronize._hvdmagic_timed = True
    # mpi_ops calls it by its global name; the optimizer and the package imported the name itself.
    for module in (mpi_ops, sys.modules.get("horovod.torch.optimizer"), package):
        if module is not None and getattr(module, "synchronize", None) is original:
            module.synchronize = synchronize
    _say_init_done(mpi_ops, package)


def _say_init_done(mpi_ops, package) -> None:
    original = getattr(mpi_ops, "init", None)
    if original is None:
        return

    @functools.wraps(original)
    def init(*args, **kwargs):
        value = original(*args, **kwargs)
        telemetry.send_horovod_stage()
        return value

    for module in (mpi_ops, package):
        if getattr(module, "init", None) is original:
            module.init = init
