"""Framework integrations that run in a rank, each in its own module so importing one never imports another framework.

- ``lightning``: ``HvdmagicCallback`` (progress and metrics to the dashboard) and
  ``HorovodStrategy`` (Lightning 2.x on Horovod ranks), for ``import lightning.pytorch``;
- ``pytorch_lightning``: the same for ``import pytorch_lightning``;
- ``_lightning``: both of those, written once and built on the Lightning namespace given;
- ``keras``: ``HvdmagicCallback``, epoch and batch progress and Keras' logs in the dashboard.

User code imports them in a cell, so they run in a rank process (and, outside a run, in
plain Python, where their calls to the dashboard do nothing). They may import their
framework, horovod and ``hvdmagic.rank`` (``rank.telemetry`` feeds the dashboard), never
``hvdmagic.kernel``, ``launch`` or ``task``. Logging a finished run to MLflow runs in the
kernel instead: ``hvdmagic.kernel.mlflow_export``.
"""
