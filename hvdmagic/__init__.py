"""hvdmagic: distributed Horovod training from a notebook cell, launched through Spark.

``%load_ext hvdmagic`` registers the ``%%horovod`` cell magic. Inside a rank,
``progress``, ``log_metrics`` and ``track`` feed the live dashboard; they are
no-ops elsewhere.

The package is laid out by the process its code runs in:

- ``kernel/``: the notebook kernel: the magic, capture, the run record, the views;
- ``launch/``: the driver's side of a job: the launcher core and its backends;
- ``task/``: a Spark barrier task: the supervisor of one rank;
- ``rank/``: a rank process, and what user code calls there;
- ``protocol`` (what travels between them), ``channel`` (the authenticated stream),
  ``pickling`` (cloudpickle that keeps shipped code's file names), ``metric_rows``
  (the metric columns' wire form) and ``errors`` are shared.

Importing this package in a rank stays cheap: the kernel's API (``run``,
``HorovodRunner``, ``TorchDistributor``, ``last_run``) is imported on first use.
"""

from __future__ import annotations

from hvdmagic.rank.report import log_metrics, progress, track
from hvdmagic.rank.shards import shard
from hvdmagic.rank.training import load_checkpoint, save_checkpoint, scale_lr

__version__ = "0.1.0"
__all__ = ["HorovodRunner", "TorchDistributor", "last_run", "load_checkpoint", "log_metrics", "progress", "run",
           "save_checkpoint", "scale_lr", "session", "shard", "track"]

_KERNEL_API = {"run": "hvdmagic.kernel.api", "HorovodRunner": "hvdmagic.kernel.api",
               "TorchDistributor": "hvdmagic.kernel.api", "session": "hvdmagic.kernel.sessions",
               "last_run": "hvdmagic.kernel.record"}


def load_ipython_extension(ipython) -> None:
    from hvdmagic.kernel.magic import HorovodMagics

    ipython.register_magics(HorovodMagics)


def __getattr__(name: str):
    # The kernel's API imports cloudpickle and the launcher; ranks importing
    # hvdmagic for progress() should not pay for that.
    if name in _KERNEL_API:
        import importlib

        return getattr(importlib.import_module(_KERNEL_API[name]), name)
    raise AttributeError(f"module 'hvdmagic' has no attribute {name!r}")
