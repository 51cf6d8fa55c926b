"""Issue 60: every horovod.spark param of the three estimators takes effect, each shown by what it changes.

Few fits, each carrying many params whose effects show apart: in the fitted weights (what the model learned),
the history, the fitted optimizer's step count, the ranks' bars and logs, and the run's notes. The model and
callbacks print what only the ranks see (the batches' shapes, the seed, an environment variable). Every
assertion fails where its param is ignored: each param's value differs from its default in what it shows.
docs/workflow.md ("From horovod.spark") lists which test shows each param.
"""

from __future__ import annotations

import csv
import os
import re
import sys

import numpy as np
import pytest
from test_spark_estimators import _embedded_spark

import hvdmagic
from hvdmagic.spark.common.backend import SparkBackend
from hvdmagic.spark.torch import TorchEstimator

POISON = 40.0  # added to the label of every fourth row, whose sample weight is 0


def _frame(spark, rows: int = 384, seed: int = 0):
    """y = 2·x0 − 3·x1 + 0.5 (plus POISON on the rows of weight w = 0), y2 = [x0, x1], the features as a vector."""
    from pyspark.ml.feature import VectorAssembler

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 2))
    y = 2 * x[:, 0] - 3 * x[:, 1] + 0.5
    poisoned = np.arange(rows) % 4 == 0
    data = [(float(a), float(b), float(t + POISON * p), 0.0 if p else 1.0)
            for (a, b), t, p in zip(x, y, poisoned)]
    df = spark.createDataFrame(data, ["x0", "x1", "y", "w"])
    df = VectorAssembler(inputCols=["x0", "x1"], outputCol="y2").transform(df)
    return VectorAssembler(inputCols=["x0", "x1"], outputCol="features").transform(df)


def _lines(log: str, prefix: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith(prefix)]


# -- torch --------------------------------------------------------------------------------------------------------
def _two_heads():
    """A model that prints, in the ranks, what it is fed: head1 predicts y from the features, head2 y2; in eval
    mode with ``reveal``, head1 gives the forward pass's batch size (for transform_batch_size)."""
    import torch

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head1, self.head2 = torch.nn.Linear(2, 1), torch.nn.Linear(2, 2)
            self.reveal = False
            self.seen: set = set()

        def forward(self, x):
            mode = "train" if self.training else "eval"
            if (mode, tuple(x.shape)) not in self.seen:
                self.seen.add((mode, tuple(x.shape)))
                print(f"probe {mode} input {tuple(x.shape)} seed {torch.initial_seed()} env "
                      f"{os.environ.get('PROBE_ENV')}", flush=True)
            if not self.training:
                print(f"probe eval batch {len(x)}", flush=True)
            flat = x.reshape(len(x), 2)
            if self.reveal:
                return torch.full((len(x), 1), float(len(x))), self.head2(flat)
            return self.head1(flat), self.head2(flat)

    return TwoHeads()


def shifted_mse():
    """head1's loss: the model learns label + 5."""
    def loss(output, label, reduction="mean"):
        each = ((output - label - 5.0) ** 2).reshape(len(output), -1).mean(dim=1)
        return each if reduction == "none" else each.mean()
    return loss


def printing_mse():
    """head2's loss: plain MSE, printing the label's shape once (label_shapes gives it)."""
    printed = []

    def loss(output, label, reduction="mean"):
        if not printed:
            print(f"probe label2 {tuple(label.shape)}", flush=True)
            printed.append(True)
        each = ((output - label.reshape(output.shape)) ** 2).mean(dim=1)
        return each if reduction == "none" else each.mean()
    return loss


def label_mean(output, label):
    """A metric: the batch's mean label (equal every epoch when the same rows come in the same order)."""
    return label.mean()


def negated_label(frame):
    """transformation_fn: the label negated, in each rank's pandas batch."""
    return frame.assign(y=-frame["y"])


class MarkingCompression:
    """A Horovod compressor that leaves gradients as they are and says once that it ran."""

    used = False

    @staticmethod
    def compress(tensor):
        if not MarkingCompression.used:
            MarkingCompression.used = True
            print("probe compressed", flush=True)
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


def test_the_torch_estimators_params_each_take_effect():
    """One fit, each param away from its default; its transform; and a second fit with horovod's own step.
    Over 60 s on this 2-core machine while other work loads it (76 s at a load average of 14, its Spark session
    already up): two fits, of which the second (horovod's step function, one rank) is mostly its launch, and three
    transform jobs, the last the use_gpu failure that a worker's cached model hid."""
    import torch
    from pyspark.sql import functions as F

    df = _frame(_embedded_spark())
    torch.manual_seed(0)
    model = _two_heads()
    head2 = [p.detach().clone() for p in model.head2.parameters()]
    epochs, steps, passes = 4, 30, 2
    estimator = TorchEstimator(
        backend=SparkBackend(num_proc=2, env={"PROBE_ENV": "from-backend"}), model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.1),
        loss_constructors=[shifted_mse, printing_mse], loss_weights=[1.0, 0.0], metrics=[label_mean],
        feature_cols=["features"], label_cols=["y", "y2"], input_shapes=[[-1, 2, 1]],
        label_shapes=[[-1, 1], [-1, 1, 2]], sample_weight_col="w", transformation_fn=negated_label,
        validation=0.25, batch_size=16, val_batch_size=8, epochs=epochs, train_steps_per_epoch=steps,
        validation_steps_per_epoch=2, backward_passes_per_step=passes, gradient_compression=MarkingCompression,
        random_seed=7, shuffle=False, verbose=0, output_cols=["p1", "p2"], transform_batch_size=5,
        inmemory_cache_all=True, transformation_edit_fields=[("y", np.float64, (), False)])
    fitted = estimator.fit(df)
    record = hvdmagic.last_run()
    learned = fitted.getModel()

    # What the model learned: −y (transformation_fn) + 5 (loss_constructors), the poisoned rows left out
    # (sample_weight_col: with them, the bias would be 10 lower); head2 untouched (its loss weight is 0).
    weight, bias = learned.head1.weight.detach().numpy()[0], float(learned.head1.bias.detach())
    assert np.allclose(weight, [-2, 3], atol=0.3) and abs(bias - 4.5) < 0.5, (weight, bias)
    assert all(torch.equal(a, b) for a, b in zip(learned.head2.parameters(), head2)), "head2 learned"
    # backward_passes_per_step: Adam stepped once every two batches.
    assert [int(s["step"]) for s in fitted.getOptimizer().state_dict()["state"].values()] == \
        [epochs * steps // passes] * 4
    history = fitted.getHistory()
    # metrics, named per label; shuffle=False: every epoch the same rows, in the same order.
    assert {"label_mean_y", "label_mean_y2", "val_label_mean_y", "val_label_mean_y2"} <= set(history), history
    assert len(set(history["label_mean_y"])) == 1, history["label_mean_y"]
    for rank in record.ranks:
        log = record.logs[rank.rank]
        assert (rank.bars["batch"].step, rank.bars["batch"].total) == (steps, steps)  # train_steps_per_epoch
        # input_shapes, batch_size, val_batch_size, random_seed, the backend's env
        assert "probe train input (16, 2, 1) seed 7 env from-backend" in log, log
        assert "probe eval input (8, 2, 1) seed 7 env from-backend" in log, log
        assert len(_lines(log, "probe eval batch 8")) == epochs * 2, log  # validation_steps_per_epoch
        assert "probe label2 (16, 1, 2)" in log, log  # label_shapes
        assert "probe compressed" in log, log  # gradient_compression
        assert not _lines(log, "epoch 1/"), log  # verbose=0
    assert any("inmemory_cache_all, transformation_edit_fields tune Petastorm's reader" in note
               for note in record.notes), record.notes  # Petastorm's knobs

    # transform: output_cols, and transform_batch_size rows per forward pass (head1 says how many).
    learned.reveal = True
    predicted = fitted.transform(df)
    assert predicted.columns == [*df.columns, "p1", "p2"]
    assert predicted.select(F.max("p1")).first()[0] == 5.0
    with pytest.raises(Exception, match="use_gpu=True, but this Spark task was given no GPU"):
        fitted.copy({fitted.use_gpu: True}).transform(df).select("p1").collect()

    # train_minibatch_fn: horovod's own step function (9 arguments since horovod 0.26), called for every batch.
    def train_minibatch(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights,
                        backward_passes_per_step, batch_idx):
        print(f"probe minibatch {batch_idx}", flush=True)
        if batch_idx % backward_passes_per_step == 0:
            if batch_idx != 0:
                optimizer.step()
            optimizer.zero_grad()
        outputs, labels = transform_outputs(model(*inputs), labels)
        loss = loss_fn(outputs, labels, sample_weights)
        loss.backward()
        return outputs, loss

    model = _two_heads()
    again = TorchEstimator(num_proc=1, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.1),
                           loss=torch.nn.MSELoss(), loss_weights=[1.0, 0.0], feature_cols=["features"],
                           label_cols=["y", "y2"], batch_size=16, epochs=2, train_steps_per_epoch=3,
                           train_minibatch_fn=train_minibatch).fit(df)
    record = hvdmagic.last_run()
    assert len(record.ranks) == 1  # num_proc (the session's default parallelism is 2)
    for rank in record.ranks:
        assert _lines(record.logs[rank.rank], "probe minibatch") == [f"probe minibatch {i}" for i in [0, 1, 2] * 2]
    # its optimizer steps, and the loop's after each epoch: 3 an epoch
    assert {int(s["step"]) for s in again.getOptimizer().state_dict()["state"].values()} == {6}
    assert _lines(record.logs[0], "epoch 1/2: loss"), record.logs[0]  # verbose's default, 1


# -- Keras ----------------------------------------------------------------------------------------------------------
def _keras_probe(keras):
    """A two-headed Keras 3 model whose input's length is unknown to it (so input_shapes must give it), through a
    layer of the notebook's own (so custom_objects must name it), and a callback that prints what the rank saw."""
    import tensorflow as tf

    class Same(keras.layers.Layer):
        def call(self, x):
            return x

    class Counts(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            print(f"probe seed {tf.compat.v1.random.get_seed(None)[0]}", flush=True)

        def on_epoch_begin(self, epoch, logs=None):
            self.batches, self.updates, self.validated = 0, 0, 0
            self.bias = self.model.get_layer("head1").get_weights()[1].copy()

        def on_train_batch_end(self, batch, logs=None):
            bias = self.model.get_layer("head1").get_weights()[1]
            self.batches, self.updates = self.batches + 1, self.updates + int((bias != self.bias).any())
            self.bias = bias.copy()

        def on_test_batch_end(self, batch, logs=None):
            self.validated += 1

        def on_epoch_end(self, epoch, logs=None):
            print(f"probe epoch batches {self.batches} updates {self.updates} validated {self.validated}", flush=True)

    inputs = keras.Input((None, 1))
    flat = Same()(keras.layers.Reshape((2,))(inputs))
    model = keras.Model(inputs, [keras.layers.Dense(1, name="head1")(flat), keras.layers.Dense(2, name="head2")(flat)])
    return model, Same, Counts()


def printing_keras_mse(y_true, y_pred):
    """head2's loss: plain MSE, printing the label's shape as Keras traces it (label_shapes gives it)."""
    import keras

    print(f"probe label2 {tuple(y_true.shape)}", flush=True)
    return keras.ops.mean(keras.ops.square(y_pred - keras.ops.reshape(y_true, keras.ops.shape(y_pred))), axis=-1)


def batch_rows(y_true, y_pred):
    """A metric: the batch's rows."""
    import keras

    return keras.ops.cast(keras.ops.shape(y_true)[0], "float32")


def keras_label_mean(y_true, y_pred):
    """A metric: the batch's mean label (equal every epoch when the same rows come in the same order)."""
    import keras

    return keras.ops.mean(y_true)


def test_the_keras_estimators_params_each_take_effect():
    """One fit of a Keras 3 model, each param away from its default; tf_keras's refusal of backward_passes_per_step.
    (output_cols, transform_batch_size and use_gpu's transform are the shared transform's, shown by the torch test.)"""
    import cloudpickle
    import keras
    import tf_keras

    from hvdmagic.spark.common.estimator import FitFailed
    from hvdmagic.spark.keras import KerasEstimator

    df = _frame(_embedded_spark())
    keras.utils.set_random_seed(0)
    model, same, counts = _keras_probe(keras)
    head2 = [w.copy() for w in model.get_layer("head2").get_weights()]
    epochs, steps, passes = 4, 30, 2
    estimator = KerasEstimator(
        num_proc=2, model=model, optimizer=keras.optimizers.Adam(0.1), loss=["mse", printing_keras_mse],
        loss_weights=[1.0, 0.0], metrics=[batch_rows, keras_label_mean], custom_objects={"Same": same},
        feature_cols=["features"], label_cols=["y", "y2"], input_shapes=[[-1, 2, 1]],
        label_shapes=[[-1, 1], [-1, 1, 2]], sample_weight_col="w", transformation_fn=negated_label,
        validation=0.25, batch_size=16, val_batch_size=8, epochs=epochs, train_steps_per_epoch=steps,
        validation_steps_per_epoch=2, backward_passes_per_step=passes, gradient_compression=MarkingCompression,
        callbacks=[counts], random_seed=7, shuffle=False, verbose=0)
    # This module's functions travel by value, as a notebook's do (the torch test's model class takes them along).
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        fitted = estimator.fit(df)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    record = hvdmagic.last_run()
    learned = fitted.getModel()

    # −y (transformation_fn), the poisoned rows left out (sample_weight_col); head2 untouched (loss_weights).
    kernel, bias = learned.get_layer("head1").get_weights()
    assert np.allclose(kernel[:, 0], [-2, 3], atol=0.3) and abs(bias[0] + 0.5) < 0.5, (kernel, bias)
    assert all(np.array_equal(a, b) for a, b in zip(learned.get_layer("head2").get_weights(), head2)), "head2 learned"
    history = fitted.getHistory()
    rows = {name: values for name, values in history.items() if name.endswith("batch_rows")}
    assert rows and all(set(values) == {8.0 if name.startswith("val_") else 16.0} for name, values in rows.items()) \
        and any(name.startswith("val_") for name in rows), history  # metrics, batch_size, val_batch_size
    means = [values for name, values in history.items() if name.endswith("label_mean") and not name.startswith("val")]
    assert means and all(len(set(values)) == 1 for values in means), history  # shuffle=False
    for rank in record.ranks:
        log = record.logs[rank.rank]
        # callbacks; train_steps_per_epoch; backward_passes_per_step, one update every two batches;
        # validation_steps_per_epoch
        assert _lines(log, "probe epoch") == [f"probe epoch batches {steps} updates {steps // passes} validated 2"] \
            * epochs, log
        assert "probe seed 7" in log, log  # random_seed
        assert re.search(r"probe label2 \(\w+, 1, 2\)", log), log  # label_shapes
        assert "probe compressed" in log, log  # gradient_compression
        assert not _lines(log, "epoch 1/"), log  # verbose=0
    # custom_objects: the ranks could not have loaded the model without them (its layer is the test's own).

    legacy = tf_keras.Sequential([tf_keras.Input((2,)), tf_keras.layers.Dense(1)])
    with pytest.raises(FitFailed, match=r"backward_passes_per_step=2 becomes the optimizer's "
                                        r"gradient_accumulation_steps, which Keras 3's optimizers have and tf_keras's"):
        KerasEstimator(num_proc=2, model=legacy, optimizer=tf_keras.optimizers.SGD(0.1), loss="mse",
                       feature_cols=["features"], label_cols=["y"], backward_passes_per_step=2).fit(df)


# -- Lightning ------------------------------------------------------------------------------------------------------
def _lightning_probe(pl):
    """A LightningModule that logs, per epoch, what its batches held and what its Trainer did."""
    import torch
    import torch.nn.functional as F

    class Probe(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)
            self.steps = 0

        def forward(self, features):
            return self.linear(features.reshape(len(features), 2))

        def training_step(self, batch, batch_idx):
            features, label, weight = batch["features"], batch["y"], batch["w"]
            self.steps += 1
            for name, value in {"feature_dims": features.dim(), "label_dims": label.dim(), "rows": len(label),
                                "label_mean": label.mean(), "seed": torch.initial_seed()}.items():
                self.log(name, float(value), on_step=False, on_epoch=True)
            loss = ((F.mse_loss(self(features), label.reshape(-1, 1), reduction="none")[:, 0]) * weight).mean()
            self.log("step_loss", loss, on_step=True, on_epoch=False)
            return loss

        def on_train_epoch_end(self):
            self.log("steps", float(self.steps))
            self.log("optimizer_steps", float(self.trainer.global_step))
            self.steps = 0

        def validation_step(self, batch, batch_idx):
            self.log("val_rows", float(len(batch["y"])))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Probe()


def test_the_lightning_estimators_params_each_take_effect(tmp_path):
    """One fit, each param away from its default, transformation_fn among them (horovod.spark's Lightning estimator
    ignores it: horovod #3540); loss_weights refused. train_steps_per_epoch, validation_steps_per_epoch, callbacks
    and profiler show in tests/test_spark_lightning_estimator.py's fit of a PyTorch Lightning 1.x module."""
    pl = pytest.importorskip("lightning.pytorch", reason="Lightning is not installed")
    from hvdmagic.spark.common.estimator import FitFailed
    from hvdmagic.spark.lightning import TorchEstimator as LightningEstimator

    df = _frame(_embedded_spark())
    epochs = 2
    fitted = LightningEstimator(
        num_proc=2, model=_lightning_probe(pl), feature_cols=["features"], label_cols=["y"],
        input_shapes=[[-1, 2, 1]], label_shapes=[[-1, 1]], sample_weight_col="w", transformation_fn=negated_label,
        validation=0.25, batch_size=16, val_batch_size=8, epochs=epochs, train_steps_per_epoch=6,
        trainer_args={"limit_train_batches": 4}, backward_passes_per_step=2, random_seed=7, shuffle=False,
        verbose=0, logger=pl.loggers.CSVLogger(str(tmp_path), name="probe"), log_every_n_steps=1,
        metrics=[label_mean]).fit(df)
    record = hvdmagic.last_run()
    history = fitted.getHistory()
    assert history["feature_dims"] == [3.0] * epochs and history["label_dims"] == [2.0] * epochs, history
    assert history["rows"] == [16.0] * epochs and history["val_rows"] == [8.0] * epochs, history
    assert history["seed"] == [7.0] * epochs, history  # random_seed
    # transformation_fn: the labels negated (their mean is about +10.8); shuffle=False: the same rows every epoch
    assert history["label_mean"][0] < -5 and len(set(history["label_mean"])) == 1, history
    assert history["steps"] == [4.0] * epochs, history  # trainer_args' limit_train_batches, over the 6 steps
    assert history["optimizer_steps"] == [2.0, 4.0], history  # backward_passes_per_step: Lightning's accumulation
    # logger, and log_every_n_steps=1: a row for each of the 4 optimizer steps (the default here, 6, logs none)
    [metrics] = (tmp_path / "probe").rglob("metrics.csv")
    with metrics.open() as rows:
        steps = [row["step"] for row in csv.DictReader(rows) if row["step_loss"]]
    assert steps == ["0", "1", "2", "3"], metrics.read_text()
    assert not _lines(record.logs[0], "epoch 1/") and "| Name" not in record.logs[0], record.logs[0]  # verbose=0
    assert any("metrics change nothing with a LightningModule" in note for note in record.notes), record.notes

    with pytest.raises(FitFailed, match="loss_weights cannot be given with a LightningModule"):
        LightningEstimator(num_proc=2, model=_lightning_probe(pl), feature_cols=["features"], label_cols=["y"],
                           loss_weights=[1.0]).fit(df)
