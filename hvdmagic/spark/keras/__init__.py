"""``KerasEstimator`` and ``KerasModel``: horovod.spark.keras's, for a Keras model (Keras 3 or tf_keras)."""

from hvdmagic.spark.keras.estimator import KerasEstimator, KerasModel

__all__ = ["KerasEstimator", "KerasModel"]
