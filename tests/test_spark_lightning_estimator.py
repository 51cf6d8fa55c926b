"""hvdmagic.spark.lightning: TorchEstimator fits a LightningModule through the launcher (Lightning's ddp on
torch.distributed ranks), PyTorch Lightning 1.x modules and callbacks included, and transforms on the executors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from digits_mnist import write_libsvm
from helpers import users_shell
from test_spark_estimators import _embedded_spark

import hvdmagic
from hvdmagic.spark.common.store import Store
from hvdmagic.spark.lightning import TorchEstimator, TorchModel

HERE = Path(__file__).parent
# A runtime profile without Lightning (Databricks ships none) skips this module, visibly.
lightning = pytest.importorskip("lightning.pytorch", reason="Lightning is not installed")
pytorch_lightning = pytest.importorskip("pytorch_lightning", reason="PyTorch Lightning 1.x's package is not installed")


def _regression(spark, rows: int = 256, seed: int = 0):
    """y = 2·x0 − 3·x1 + 0.5, the features as one vector; ``holdout`` marks every fourth row."""
    from pyspark.ml.feature import VectorAssembler

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 2))
    y = 2 * x[:, 0] - 3 * x[:, 1] + 0.5
    df = spark.createDataFrame([(float(a), float(b), float(t), i % 4 == 0) for i, ((a, b), t) in enumerate(zip(x, y))],
                               ["x0", "x1", "y", "holdout"])
    return VectorAssembler(inputCols=["x0", "x1"], outputCol="features").transform(df)


class Regression(lightning.LightningModule):
    """A Lightning 2 module: its batches are dicts by column, as horovod.spark's are."""

    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, features):
        return self.linear(features)

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self(batch["features"]).squeeze(-1), batch["y"])
        self.log("loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self(batch["features"]).squeeze(-1), batch["y"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def _estimator(**params):
    torch.manual_seed(0)
    defaults = dict(num_proc=2, model=Regression(), feature_cols=["features"], label_cols=["y"], batch_size=16,
                    epochs=4, verbose=0)
    return TorchEstimator(**{**defaults, **params})


@pytest.mark.unit
def test_horovods_lightning_params_reach_the_trainer_arguments_and_the_estimator_saves_and_loads(tmp_path):
    estimator = TorchEstimator(model=Regression(lr=0.3), feature_cols="features", label_cols=["y"], profiler="simple",
                               log_every_n_steps=5, trainer_args={"log_every_n_steps": 2, "gradient_clip_val": 1.0},
                               store=Store.create(tmp_path / "store"), run_id="r1", inmemory_cache_all=True)
    assert estimator.getProfiler() == "simple" and estimator.getLogEveryNSteps() == 5
    assert estimator._ignored == ["inmemory_cache_all"]
    # trainer_args over the estimator's own (horovod.spark's order); Lightning's logs in the store
    assert estimator._spec().trainer_args == {"default_root_dir": str(tmp_path / "store" / "runs" / "r1" / "logs"),
                                              "profiler": "simple", "log_every_n_steps": 2, "gradient_clip_val": 1.0}
    estimator.write().save(str(tmp_path / "estimator"))
    loaded = TorchEstimator.load(str(tmp_path / "estimator"))
    assert loaded.getProfiler() == "simple" and loaded.getTrainerArgs()["gradient_clip_val"] == 1.0
    assert loaded.getModel().hparams.lr == 0.3
    assert torch.equal(loaded.getModel().linear.weight, estimator.getModel().linear.weight)


@pytest.mark.profile
def test_a_lightning_module_trains_resumes_from_its_run_id_and_its_model_transforms_saves_and_loads(tmp_path):
    from pyspark.sql import types as T

    df = _regression(_embedded_spark())
    store = Store.create(tmp_path / "store")
    first = _estimator(store=store, run_id="lit", validation=0.25).fit(df)
    history = first.getHistory()
    assert len(history["loss"]) == 4 and len(history["val_loss"]) == 4, history
    assert history["loss"][-1] < history["loss"][0] / 4, history
    assert first.fit_info["collectives"] == "torch.distributed" and first.fit_info["epochs_run"] == 4, first.fit_info
    record = hvdmagic.last_run()
    assert record.command == "TorchEstimator.fit" and len(record.ranks) == 2
    assert any("strategy ddp" in note for note in record.notes), record.notes
    assert not any("bridged" in note for note in record.notes), "a Lightning 2 module needs no bridge"
    steps = 96 // 16  # 3/4 of 128 rows a rank (about: the split is random) in batches of 16
    for rank in record.ranks:  # the estimator's bars, and not the adopted Trainer's "fit" bar beside them
        bars = {desc: (bar.step, bar.total) for desc, bar in rank.bars.items()}
        assert set(bars) == {"epoch", "batch"} and bars["epoch"] == (4, 4), f"rank {rank.rank}: {bars}"
        assert abs(bars["batch"][1] - steps) <= 2 and bars["batch"][0] == bars["batch"][1], bars
    charted = record.metrics[record.metrics["rank"] == 0]
    assert list(charted["step"]) == [0, 1, 2, 3] and np.allclose(charted["loss"], history["loss"]), charted
    checkpoints = tmp_path / "store" / "runs" / "lit" / "checkpoint"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-3.pt"]
    assert any((tmp_path / "store" / "runs" / "lit" / "logs").rglob("hparams.yaml")), "Lightning's logger in the store"

    again = _estimator(store=store, run_id="lit", validation=0.25, epochs=6).fit(df)
    assert again.fit_info["epochs_run"] == 2, again.fit_info
    assert again.getHistory()["loss"][:4] == history["loss"] and len(again.getHistory()["loss"]) == 6
    assert again.getHistory()["loss"][-1] < history["loss"][-1], again.getHistory()

    predicted = again.transform(df)
    assert predicted.schema["y__output"].dataType == T.DoubleType()  # a scalar label, one value out
    before = predicted.select("y", "y__output").toPandas()
    error = (before["y__output"] - before["y"]).abs().max()
    assert error < 0.3, error
    path = str(tmp_path / "model")
    again.write().save(path)
    loaded = TorchModel.load(path)
    assert isinstance(loaded, TorchModel) and isinstance(loaded.getModel(), Regression)
    assert loaded.getHistory() == again.getHistory() and loaded.getModel().hparams.lr == 0.1
    after = loaded.transform(df).select("y__output").toPandas()["y__output"]
    assert np.allclose(before["y__output"], after), (before[:5], after[:5])


class OneXModule(pytorch_lightning.LightningModule):
    """Written for PyTorch Lightning 1.x: Lightning 2 refuses a module with training_epoch_end or
    validation_epoch_end, and never calls on_epoch_end."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        self.module_epoch_ends = 0

    def forward(self, features):
        return self.linear(features)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self(batch["features"]).squeeze(-1), batch["y"])

    def validation_step(self, batch, batch_idx):
        # PL 1.x left a step that returned None out of validation_epoch_end's outputs.
        return {"index": torch.tensor(float(batch_idx))} if batch_idx % 2 == 0 else None

    def training_epoch_end(self, outputs):
        self.log("train_outputs", float(len(outputs)))
        self.log("train_outputs_have_loss", float(all("loss" in output for output in outputs)))

    def validation_epoch_end(self, outputs):
        self.log("val_outputs", float(len(outputs)))
        self.log("val_indices", float(sum(output["index"] for output in outputs)))

    def on_epoch_end(self):
        self.module_epoch_ends += 1

    def on_train_end(self):
        print("module epoch ends:", self.module_epoch_ends, flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class OneXCallback(pytorch_lightning.Callback):
    """A PL 1.x callback: on_init_start, on_init_end, on_epoch_start, on_epoch_end, on_batch_end were removed in 1.8."""

    def __init__(self):
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def on_init_start(self, trainer):
        self._count("on_init_start")

    def on_init_end(self, trainer):
        self._count("on_init_end")

    def on_epoch_start(self, trainer, module):
        self._count("on_epoch_start")

    def on_epoch_end(self, trainer, module):
        self._count("on_epoch_end")

    def on_batch_end(self, trainer, module):
        self._count("on_batch_end")

    def on_train_epoch_end(self, trainer, module, unused=None):
        self._count("on_train_epoch_end")

    def on_validation_epoch_end(self, trainer, module, unused=None):
        self._count("on_validation_epoch_end")

    def on_train_end(self, trainer, module):
        print("1.x calls:", json.dumps(self.calls, sort_keys=True), flush=True)


@pytest.mark.parametrize("spark_kind", ["connect"], indirect=True)  # the other Lightning fits run on classic
def test_a_pytorch_lightning_1x_module_and_callback_get_their_removed_hooks_called_as_1x_called_them(spark_kind):
    """On Spark Connect, where a Lightning fit and its model's transform run as on a classic session."""
    df = _regression(spark_kind.session, rows=128)
    fitted = TorchEstimator(num_proc=2, model=OneXModule(), callbacks=[OneXCallback()], feature_cols=["features"],
                            label_cols=["y"], batch_size=8, epochs=2, validation="holdout", train_steps_per_epoch=3,
                            validation_steps_per_epoch=3, profiler="simple", verbose=1).fit(df)
    history = fitted.getHistory()
    assert history["train_outputs"] == [3.0, 3.0] and history["train_outputs_have_loss"] == [1.0, 1.0], history
    assert history["val_outputs"] == [2.0, 2.0] and history["val_indices"] == [2.0, 2.0], history  # steps 0 and 2
    record = hvdmagic.last_run()
    bridged = [note for note in record.notes if "bridged" in note]
    assert len(bridged) == 1, record.notes
    for hook in ("OneXModule.validation_epoch_end", "OneXModule.training_epoch_end", "OneXModule.on_epoch_end",
                 "OneXCallback.on_init_start", "OneXCallback.on_epoch_end", "OneXCallback.on_batch_end"):
        assert hook in bridged[0], bridged[0]
    # PL 1.x's counts: on_epoch_start/end after each train and each validation epoch, on_batch_end per step.
    expected = {"on_init_start": 1, "on_init_end": 1, "on_epoch_start": 4, "on_epoch_end": 4, "on_batch_end": 6,
                "on_train_epoch_end": 2, "on_validation_epoch_end": 2}
    for rank in record.ranks:
        calls = json.loads(re.search(r"1\.x calls: (\{.*\})", record.logs[rank.rank]).group(1))
        assert calls == expected, f"rank {rank.rank}: {calls}"
        assert "module epoch ends: 4" in record.logs[rank.rank], record.logs[rank.rank]
    assert "FIT Profiler Report" in record.logs[0], record.logs[0]  # profiler= reached Lightning's Trainer
    predicted = fitted.transform(df).select("y__output").toPandas()["y__output"]
    assert len(predicted) == 128 and np.isfinite(predicted).all(), predicted


def test_a_model_that_is_not_a_lightning_module_fails_in_one_paragraph_before_any_rank_starts():
    df = _regression(_embedded_spark(), rows=64)
    runs = hvdmagic.last_run()
    for estimator, match in (
            (_estimator(model=torch.nn.Linear(2, 1)),
             r"trains a LightningModule \(lightning.pytorch or pytorch_lightning\), not Linear.*"
             r"hvdmagic.spark.torch.TorchEstimator"),
            (_estimator(optimizer=torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)),
             r"optimizer cannot be given with a LightningModule: its configure_optimizers"),
            (_estimator(loss=torch.nn.MSELoss()), r"loss cannot be given with a LightningModule")):
        with pytest.raises(Exception) as caught:
            estimator.fit(df)
        message = str(caught.value)
        assert re.search(match, message) and "\n" not in message.strip(), message
    assert hvdmagic.last_run() is runs, "a rank started"


# -- the example horovod ships, with only the import changed ---------------------------------------------
# Longer than the suite's 300 s: the script starts its own SparkSession and imports TensorFlow before Lightning
# (its guard against a TensorFlow 2.6 conflict), and each rank imports Lightning, on a busy 2-core machine.
@pytest.mark.timeout(600)
def test_horovods_pytorch_lightning_spark_mnist_example_runs_with_only_its_import_changed(tmp_path):
    """Written for PyTorch Lightning 1.x (validation_epoch_end, on_init_start, on_epoch_end): it trains on
    Lightning 2 through the ranks' bridge, and its callback's count of on_epoch_end calls holds."""
    source = (HERE / "horovod_examples" / "pytorch_lightning_spark_mnist.py").read_text()
    changed = source.replace("horovod.spark", "hvdmagic.spark")
    assert changed.count("hvdmagic.spark") == 4 and "import horovod" not in changed
    script = tmp_path / "pytorch_lightning_spark_mnist.py"
    script.write_text(changed)
    write_libsvm(tmp_path / "mnist.bz2")
    # Its SGD (lr 0.01, momentum 0.5) starts slowly on these digits: 3 epochs of 64-row batches reached 0.42 once
    # (0.83 another time); 5 epochs of 32 rows give it over three times the steps.
    done = subprocess.run([sys.executable, str(script), "--num-proc", "2", "--epochs", "5", "--batch-size", "32",
                           "--work-dir", str(tmp_path / "work"), "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          # As `.venv/bin/python script.py` from a shell: no PYSPARK_PYTHON, the venv not on PATH;
                          # its SparkSession's executors run this Python (import hvdmagic.spark sees to it).
                          env=users_shell())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "Skip test" not in done.stdout, done.stdout[-3000:]
    accuracy = float(re.search(r"Test accuracy: ([\d.]+)", done.stdout).group(1))
    assert accuracy > 0.6, f"test accuracy {accuracy} (0.1 is a model that learned nothing)\n{done.stdout[-3000:]}"
