"""Lightning's ``TorchEstimator``: not built yet (docs/workflow.md, section 8)."""

raise ImportError("hvdmagic.spark.lightning (a TorchEstimator for a LightningModule) is not built yet: "
                  "hvdmagic.spark.torch.TorchEstimator is, for a torch.nn.Module; a LightningModule trains in a "
                  "%%torchrun cell (docs/workflow.md).")
