"""Framework integrations, each in its own module so importing one never imports another framework.

- ``hvdmagic.callbacks.lightning``: ``HvdmagicCallback`` (progress and metrics to the
  dashboard) and ``HorovodStrategy`` (Lightning 2.x on Horovod ranks), for
  ``import lightning.pytorch``; ``hvdmagic.callbacks.pytorch_lightning`` is the same
  for ``import pytorch_lightning``.
- ``hvdmagic.callbacks.mlflow``: ``log_run`` logs a finished run's rank-0 metrics to MLflow.
- ``hvdmagic.callbacks.keras``: ``HvdmagicCallback``, epoch and batch progress and Keras' logs in the dashboard.
"""
