"""hvdmagic: distributed Horovod training from a notebook cell, launched through Spark.

``%load_ext hvdmagic`` registers the ``%%horovod`` cell magic. Inside a rank,
``progress``, ``log_metrics`` and ``track`` feed the live dashboard; they are
no-ops elsewhere. Importing this package in a rank stays cheap: IPython, Spark
and widgets are only imported by the driver-side modules that need them.
"""

from __future__ import annotations

from hvdmagic.record import last_run
from hvdmagic.report import log_metrics, progress, track
from hvdmagic.shards import shard
from hvdmagic.training import load_checkpoint, save_checkpoint, scale_lr

__version__ = "0.1.0"
__all__ = ["HorovodRunner", "last_run", "load_checkpoint", "log_metrics", "progress", "run", "save_checkpoint",
           "scale_lr", "shard", "track"]


def load_ipython_extension(ipython) -> None:
    from hvdmagic.magic import HorovodMagics

    ipython.register_magics(HorovodMagics)


def __getattr__(name: str):
    # The driver-side API imports cloudpickle and the launcher; ranks importing
    # hvdmagic for progress() should not pay for that.
    if name in ("run", "HorovodRunner"):
        from hvdmagic import api

        return getattr(api, name)
    raise AttributeError(f"module 'hvdmagic' has no attribute {name!r}")
