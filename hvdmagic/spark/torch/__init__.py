"""``TorchEstimator`` and ``TorchModel``: horovod.spark.torch's, for a ``torch.nn.Module``."""

from hvdmagic.spark.torch.estimator import TorchEstimator, TorchModel

__all__ = ["TorchEstimator", "TorchModel"]
