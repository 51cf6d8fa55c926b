"""Runs in a rank process: ``python -m hvdmagic.rank``, started by its task's supervisor, or
forked from its host's template (``python -m hvdmagic.rank --template``).

- ``__main__``: the rank's entry point: reads its Boot and payload, runs the cell once.
- ``cell_loop``: a session's rank: runs each cell's payload as it comes, in one namespace.
- ``debugger``: ``ChannelPdb``, pdb whose prompt is the notebook's input box, on a failed
  cell's frame (``%debug``), or on a running cell's at ``breakpoint()`` (``sys.breakpointhook``).
- ``error_hold``: ``--hold-on-error``: a fresh cell's failed rank waits for ``%debug``, its frames kept.
- ``cell``: ``CellFunction``, a notebook cell as a rank runs it, and the notebook sources
  that make its tracebacks name cells as IPython does.
- ``outcome``: the cell's result or error, as the events the driver reads.
- ``telemetry``: what user code calls to report (``progress``, ``log_metrics``, ``track``),
  batched onto the rank's event socket with its stages and heartbeats.
- ``framework_bars``: tqdm's and Keras' own progress bars report through ``telemetry``
  instead of printing; adopted as they are imported.
- ``training``: checkpoints and ``scale_lr``; ``shards``: ``hvdmagic.shard()`` (``--data``).
- ``elastic``: Horovod elastic's hooks, so resets and worker addresses reach the driver.
- ``mpi_shim``: under ``--controller mpi``, hands the process mpirun started to its task.
- ``template``: the host's rank template: imports the ranks' frameworks, forks ranks on request
  once it has checked a fork is safe, and turns each child into a rank.
- ``scripts``: runs a script as ``__main__`` (the TorchDistributor drop-in's scripts).
- ``databricks_apis``: ``@distributed``'s call and ``DeepspeedTorchDistributor``'s script start.
- ``crash_hold``: keeps a rank that a crash signal kills alive until its supervisor has read
  its native frames (py-spy), where its supervisor asks for that.
- ``subset_guard``: while a session's cell runs on some of its ranks (``--ranks``), refuses the
  collectives the other ranks would never join, before they start.

Modules here import only the standard library, ``hvdmagic.protocol`` and
``hvdmagic.metric_rows`` at import time (cloudpickle, ``hvdmagic.pickling`` and the
frameworks lazily), never IPython, Spark or widgets, so that a rank starts fast.
"""
