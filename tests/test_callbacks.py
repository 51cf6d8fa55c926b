"""Framework callbacks: Lightning on real Horovod ranks, the Keras explanation, MLflow logging."""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest
from conftest import run

import hvdmagic

# Defined in the notebook namespace, so it travels to the ranks by value.
LIGHTNING_FIT = '''
def fit_regression(root, epochs=4):
    import torch
    import horovod.torch as hvd
    import lightning.pytorch as pl
    from hvdmagic.callbacks.lightning import HorovodStrategy, HvdmagicCallback

    hvd.init()
    torch.manual_seed(hvd.rank())  # different initial weights per rank: only the broadcast makes them equal
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = x @ torch.arange(1.0, 9.0) + 0.5
    data = torch.utils.data.TensorDataset(torch.arange(512), x, y)

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)
            self.seen = []

        def training_step(self, batch, batch_idx):
            index, xb, yb = batch
            if self.current_epoch == 0:
                self.seen += index.tolist()
            loss = torch.nn.functional.mse_loss(self.net(xb).squeeze(1), yb)
            self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    model = Regression()
    trainer = pl.Trainer(max_epochs=epochs, strategy=HorovodStrategy(), callbacks=[HvdmagicCallback()],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=root)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=32, shuffle=True))
    return {"params": torch.cat([p.detach().flatten() for p in model.parameters()]).tolist(),
            "seen": sorted(model.seen), "steps": trainer.global_step}
'''


def test_lightning_trains_on_two_spark_ranks_with_the_horovod_strategy(ip, tmp_path):
    ip.run_cell(LIGHTNING_FIT)
    ip.user_ns["root"] = str(tmp_path)
    _, error = run(ip, "%%horovod --np 2\nimport horovod.torch as hvd\nhvd.init()\nfit_regression(root)")
    assert error is None, error
    record = hvdmagic.last_run()
    first, second = record.results

    # Broadcast at the start and averaged gradients keep the two models identical.
    assert first["params"] == pytest.approx(second["params"], abs=1e-6)
    # The DistributedSampler split the 512 rows into two disjoint halves: 8 steps per epoch.
    assert len(first["seen"]) == len(second["seen"]) == 256
    assert set(first["seen"]).isdisjoint(second["seen"])
    assert first["steps"] == second["steps"] == 4 * 8

    # self.log(sync_dist=True) reached the dashboard through the callback's logger, at Lightning's steps.
    metrics = record.metrics
    rank0 = metrics[metrics["rank"] == 0].dropna(subset=["loss"])
    assert rank0["step"].tolist() == [7, 15, 23, 31]
    assert rank0["loss"].iloc[-1] < rank0["loss"].iloc[0] / 4
    rank1 = metrics[metrics["rank"] == 1].dropna(subset=["loss"])
    assert rank1["loss"].tolist() == pytest.approx(rank0["loss"].tolist())  # the mean over ranks, on both

    # Only rank 0 saves Lightning's checkpoint.
    assert [p.name for p in tmp_path.rglob("*.ckpt")] == ["epoch=3-step=32.ckpt"]


def test_callback_reports_progress_over_the_whole_fit(monkeypatch):
    from hvdmagic.callbacks import _lightning
    from hvdmagic.callbacks.lightning import HvdmagicCallback, HvdmagicLogger

    calls = []
    monkeypatch.setattr(_lightning, "progress", lambda step, total, desc: calls.append((step, total, desc)))
    trainer = SimpleNamespace(loggers=[], estimated_stepping_batches=12, global_step=0, default_root_dir="root")
    callback = HvdmagicCallback()
    callback.setup(trainer, None, "fit")
    callback.setup(trainer, None, "fit")  # a second fit keeps one logger
    assert [type(logger) for logger in trainer.loggers] == [HvdmagicLogger]
    assert trainer.loggers[0].save_dir == "root", "Lightning's folders stay under default_root_dir"

    callback.on_train_start(trainer, None)
    trainer.global_step = 5
    callback.on_train_batch_end(trainer, None, None, None, 4)
    assert calls == [(0, 12, "fit"), (5, 12, "fit")]

    trainer.estimated_stepping_batches = float("inf")  # max_epochs=-1: no total, no ETA
    callback.on_train_start(trainer, None)
    assert calls[-1] == (5, None, "fit")


@pytest.mark.unit
def test_strategy_maps_lightning_reductions_to_horovod():
    import horovod.torch as hvd
    import torch.distributed

    from hvdmagic.callbacks._lightning import horovod_operation

    assert horovod_operation(hvd, "mean") == horovod_operation(hvd, None) == hvd.Average
    assert horovod_operation(hvd, torch.distributed.ReduceOp.SUM) == hvd.Sum
    assert horovod_operation(hvd, "MAX") == hvd.Max
    with pytest.raises(ValueError, match="cannot reduce with 'product'"):
        horovod_operation(hvd, "product")


@pytest.mark.unit
def test_lightning_module_explains_a_missing_lightning(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)  # makes `import lightning` fail
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, "hvdmagic.callbacks.lightning", raising=False)
    with pytest.raises(ImportError, match=r"needs PyTorch Lightning 2\.x.*pip install lightning"):
        importlib.import_module("hvdmagic.callbacks.lightning")


def log_decreasing_loss(steps):
    import horovod.torch as hvd

    hvd.init()
    for step in range(steps):
        hvdmagic.log_metrics(step=step * 10, loss=(hvd.rank() + 1) / (step + 1), **{"val/acc": step / steps})
    return {"accuracy": 0.75, "ranks": hvd.size(), "label": "not a number"}


@pytest.fixture
def tracking(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a folder store otherwise
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return MlflowClient(uri)


def test_log_run_writes_rank0_metric_history(tracking):
    from hvdmagic.kernel.mlflow_export import log_run

    hvdmagic.run(log_decreasing_loss, -2, 4)
    run_id = log_run(experiment="hvdmagic-tests", run_name="four steps")

    logged = tracking.get_run(run_id)
    assert logged.info.status == "FINISHED" and logged.info.run_name == "four steps"
    assert tracking.get_experiment(logged.info.experiment_id).name == "hvdmagic-tests"
    history = [(m.step, m.value) for m in tracking.get_metric_history(run_id, "loss")]
    assert history == [(0, 1.0), (10, 0.5), (20, pytest.approx(1 / 3)), (30, 0.25)]  # rank 0's, not rank 1's
    assert [m.value for m in tracking.get_metric_history(run_id, "val/acc")] == [0.0, 0.25, 0.5, 0.75]
    assert logged.data.params == {"np": "2", "mode": "local"}
    assert logged.data.metrics["result.accuracy"] == 0.75 and logged.data.metrics["result.ranks"] == 2
    assert "result.label" not in logged.data.metrics
    assert 0 < logged.data.metrics["duration_s"] < 300
    assert logged.data.tags["hvdmagic.state"] == "finished"


def test_magic_mlflow_flag_logs_after_the_cell(ip, tracking, capsys):
    _, error = run(ip, "%%horovod --np -1 --mlflow magic-exp\nimport hvdmagic\n"
                       "for step in range(3):\n    hvdmagic.log_metrics(step=step, loss=3 - step)")
    assert error is None, error
    experiment = tracking.get_experiment_by_name("magic-exp")
    [logged] = tracking.search_runs([experiment.experiment_id])
    assert [(m.step, m.value) for m in tracking.get_metric_history(logged.info.run_id, "loss")] == [
        (0, 3.0), (1, 2.0), (2, 1.0)]
    assert f"logged rank 0's metrics to MLflow run {logged.info.run_id}" in capsys.readouterr().out
