"""Lightning's ``TorchEstimator`` and ``TorchModel``: horovod.spark.lightning's, for a ``LightningModule``."""

from hvdmagic.spark.lightning.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
