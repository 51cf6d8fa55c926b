"""Keras (2, as ``tf.keras`` or ``tf_keras``) in a ``%%horovod`` cell: progress and metrics in the dashboard.

    model.fit(x, y, epochs=5, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                         HvdmagicCallback()])

Each rank shows an epoch bar over the fit and a batch bar inside the epoch, and
logs Keras' ``logs`` per batch (``loss``, ``accuracy``, ...; Keras 2 reports the
epoch's running mean there) and per epoch (``epoch_loss``, ``val_loss``, ...),
with the global batch number as the step. Rank 0's are charted. Outside a
``%%horovod`` run the calls are no-ops, so the same ``fit`` runs on one machine.

hvdmagic runs Keras 2 on the ranks: with Keras 3, horovod.tensorflow.keras's
DistributedOptimizer does not average the gradients (see docs/frameworks.md).
"""

from __future__ import annotations

try:
    import tensorflow as _tf
except ImportError as exc:
    raise ImportError("hvdmagic.callbacks.keras needs TensorFlow in the notebook's and every rank's environment: "
                      "run the README's set-up command, which installs it and builds horovod for it "
                      "(docs/frameworks.md).") from exc

from hvdmagic.rank.framework_bars import callback_reports
from hvdmagic.rank.framework_bars import keras_numbers as _numbers
from hvdmagic.rank.telemetry import log_metrics, progress

_Callback = _tf.keras.callbacks.Callback


class HvdmagicCallback(_Callback):
    """Per-rank epoch and batch progress, and Keras' logs as hvdmagic metrics.

    Args:
        batch_metrics: log ``logs`` after every batch (the default); False logs per epoch only.
        epoch_desc: the name of the outer bar.
        batch_desc: the name of the inner bar, which restarts every epoch.

    Example::

        %%horovod --np 2
        import horovod.tensorflow.keras as hvd
        from hvdmagic.callbacks.keras import HvdmagicCallback
        hvd.init()
        model.fit(x, y, epochs=3, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), HvdmagicCallback()])
    """

    def __init__(self, batch_metrics: bool = True, epoch_desc: str = "epoch", batch_desc: str = "batch"):
        super().__init__()
        self.batch_metrics = batch_metrics
        self.epoch_desc = epoch_desc
        self.batch_desc = batch_desc
        self._step = 0  # batches since the start of fit: the metrics' step

    def on_train_begin(self, logs=None) -> None:
        self._step = 0
        progress(0, self.params.get("epochs"), self.epoch_desc)

    def on_epoch_begin(self, epoch: int, logs=None) -> None:
        if self.params.get("verbose") == 1:  # fit(verbose=1)'s adopted bar (rank.framework_bars) then stays silent
            callback_reports(self.model)
        progress(0, self.params.get("steps"), self.batch_desc)

    def on_train_batch_end(self, batch: int, logs=None) -> None:
        self._step += 1
        progress(batch + 1, self.params.get("steps"), self.batch_desc)
        if self.batch_metrics and (numbers := _numbers(logs)):
            log_metrics(step=self._step, **numbers)

    def on_epoch_end(self, epoch: int, logs=None) -> None:
        progress(epoch + 1, self.params.get("epochs"), self.epoch_desc)
        if numbers := _numbers(logs, prefix="epoch_"):
            log_metrics(step=self._step, **numbers)
