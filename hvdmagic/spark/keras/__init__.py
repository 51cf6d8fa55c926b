"""``KerasEstimator`` and ``KerasModel``: not built yet (docs/workflow.md, section 8)."""

raise ImportError("hvdmagic.spark.keras (KerasEstimator) is not built yet: hvdmagic.spark.torch.TorchEstimator is; "
                  "for a Keras model, train it in a %%horovod cell with --data (docs/workflow.md).")
