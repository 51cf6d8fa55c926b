"""hvdmagic: distributed training from a notebook, on Horovod or torch.distributed ranks launched through Spark.

Entry points. ``%load_ext hvdmagic`` registers the magics:

- ``%%horovod``: run the cell on Horovod ranks (``--np N``: one Spark barrier stage of N tasks;
  ``--np -N``: N processes on the driver; no ``--np``: the session's ranks) and return rank 0's result;
- ``%%torchrun``: the same for ``torch.distributed`` code, each rank with torchrun's environment;
- ``%horovod start|stop|status`` (and ``%torchrun start|stop|status``): a session of warm
  ranks that keep their imports and state, on which later cells without ``--np`` run.

From Python:

- ``run(fn, np)``: call ``fn`` on every rank and return their results;
- ``HorovodRunner``: a drop-in for Databricks' ``sparkdl.HorovodRunner``;
- ``TorchDistributor`` and ``DeepspeedTorchDistributor``: drop-ins for pyspark's;
- ``distributed``: a drop-in for Databricks' serverless GPU ``@distributed`` (``install_serverless_gpu()``
  lets its unchanged imports work where Databricks' package is not installed);
- ``session(np)``: a session of warm ranks for ``run(fn, session=s)``;
- ``last_run()``: the record of the latest run (metrics, logs, timings, result);
- ``debug()``: pdb in the rank whose session cell failed, as ``%debug`` (which the extension makes
  rank-aware, as it does ``%pdb on``).

Inside a rank, ``progress``, ``log_metrics`` and ``track`` feed the live dashboard (no-ops
elsewhere); ``shard`` reads the rank's share of ``--data``; ``save_checkpoint``,
``load_checkpoint`` and ``scale_lr`` help training code. ``hvdmagic.callbacks`` holds
Lightning and Keras callbacks, and ``python -m hvdmagic.build_horovod`` builds horovod for
the frameworks installed.

The package is laid out by the process its code runs in; each package's docstring lists
its modules and what they may import. Imports go one way, top to bottom:

- ``kernel/``: the notebook kernel: the magics, the Python API, sessions, capture, the run
  record, the views; it may import ``launch``, ``rank``'s payload types and the shared modules;
- ``spark/``: horovod.spark's Spark ML estimators (``hvdmagic.spark.torch.TorchEstimator``), in the
  kernel; they run through ``kernel``'s runner, and ship ``rank`` and ``task`` code;
- ``callbacks/``: framework integrations that run in a rank; they import only ``rank``;
- ``launch/``: the driver's side of a job: the launcher core and its backends;
- ``task/``: a Spark barrier task: the supervisor of one rank;
- ``rank/``: a rank process, and what user code calls there;
- ``protocol`` (what travels between them), ``channel`` (the authenticated stream),
  ``blob_transfer`` (large buffers to each host, once), ``pickling`` (cloudpickle that keeps
  shipped code's file names and leaves large buffers out of band), ``metric_rows``
  (the metric columns' wire form), ``stacks`` and ``flight_records`` (a rank's stacks and
  torch's flight recorder dumps, read) and ``errors`` are shared;
- ``build_horovod`` stands apart: a command that builds a horovod wheel.

Importing this package in a rank stays cheap: it imports only ``rank``'s user-facing
functions, and the kernel's API (``run``, ``HorovodRunner``, ``TorchDistributor``, ``distributed``,
``session``, ``last_run``) is imported on first use.
"""

from __future__ import annotations

from hvdmagic.rank.shards import shard
from hvdmagic.rank.telemetry import log_metrics, progress, track
from hvdmagic.rank.training import load_checkpoint, save_checkpoint, scale_lr

__version__ = "0.1.0"
__all__ = ["DeepspeedTorchDistributor", "HorovodRunner", "TorchDistributor", "debug", "distributed",
           "install_serverless_gpu", "last_run", "load_checkpoint", "log_metrics", "progress", "run", "save_checkpoint",
           "scale_lr", "session", "shard", "track", "where"]

_KERNEL_API = {"run": "hvdmagic.kernel.api", "HorovodRunner": "hvdmagic.kernel.api",
               "TorchDistributor": "hvdmagic.kernel.api", "DeepspeedTorchDistributor": "hvdmagic.kernel.api",
               "distributed": "hvdmagic.kernel.serverless_gpu", "session": "hvdmagic.kernel.warm_sessions",
               "install_serverless_gpu": "hvdmagic.kernel.serverless_gpu", "last_run": "hvdmagic.kernel.record",
               "where": "hvdmagic.kernel.api", "debug": "hvdmagic.kernel.rank_debugger"}


def load_ipython_extension(ipython) -> None:
    from hvdmagic.kernel import rank_debugger
    from hvdmagic.kernel.magic import HorovodMagics
    from hvdmagic.launch.spark_session import prefer_this_python

    prefer_this_python()  # before the notebook makes its own SparkSession
    ipython.register_magics(HorovodMagics)
    rank_debugger.install(ipython)  # %debug and %pdb on open pdb in the rank an hvdmagic cell failed in


def __getattr__(name: str):
    # The kernel's API imports cloudpickle and the launcher; ranks importing
    # hvdmagic for progress() should not pay for that.
    if name in _KERNEL_API:
        import importlib

        return getattr(importlib.import_module(_KERNEL_API[name]), name)
    raise AttributeError(f"module 'hvdmagic' has no attribute {name!r}")
