"""Runs in a rank process: ``python -m hvdmagic.rank`` (``__main__``), started by its task.

What user code calls inside a rank lives here too: ``report`` (progress,
log_metrics, track), ``training`` (checkpoints, scale_lr) and ``shards``
(``hvdmagic.shard()``). Modules here import only the standard library,
``hvdmagic.protocol`` and ``hvdmagic.metric_rows`` at import time, never
IPython, Spark or widgets, so that a rank starts fast.
"""
