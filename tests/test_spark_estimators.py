"""hvdmagic.spark's estimators: fit on a DataFrame through the launcher, transform on the executors, Spark ML."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import run
from digits_mnist import write_libsvm
from helpers import WaitTimeout, record_slot_waits, users_shell, wait_until
from s3_server import storage_options

import hvdmagic
from hvdmagic.errors import HvdmagicError
from hvdmagic.spark.common.backend import SparkBackend
from hvdmagic.spark.common.store import Store
from hvdmagic.spark.torch import TorchEstimator, TorchModel

HERE = Path(__file__).parent


# -- params and store, no Spark job -------------------------------------------------------------------
@pytest.mark.unit
def test_an_unknown_argument_names_the_param_it_was_probably_meant_to_be():
    with pytest.raises(TypeError, match=r"unknown argument\(s\) 'batchsize' \(did you mean 'batch_size'\?\)"):
        TorchEstimator(batchsize=32)


@pytest.mark.unit
def test_horovods_getters_and_setters_and_petastorms_knobs_are_accepted():
    estimator = TorchEstimator(feature_cols="x", label_cols=["y"], batch_size=16, inmemory_cache_all=True,
                               partitions_per_process=4)
    assert estimator.getFeatureCols() == ["x"] and estimator.getBatchSize() == 16
    assert estimator.setEpochs(3) is estimator and estimator.getEpochs() == 3
    assert estimator._ignored == ["inmemory_cache_all", "partitions_per_process"]


@pytest.mark.unit
def test_a_copy_has_its_own_model_and_an_optimizer_over_that_copy():
    import torch

    model = torch.nn.Linear(2, 1)
    estimator = TorchEstimator(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    copied = estimator.copy({estimator.epochs: 4})
    assert copied.getEpochs() == 4 and estimator.getEpochs() == 1
    assert copied.getModel() is not model
    params = {id(p) for p in copied.getModel().parameters()}
    assert {id(p) for p in copied.getOptimizer().param_groups[0]["params"]} == params


@pytest.mark.unit
def test_num_proc_and_backend_exclude_each_other():
    estimator = TorchEstimator(num_proc=2, backend=SparkBackend(num_proc=2))
    with pytest.raises(RuntimeError, match="give num_proc or backend, not both"):
        estimator._num_proc(None)


# -- fit and transform on Spark --------------------------------------------------------------------------
def _embedded_spark():
    """hvdmagic's embedded classic session, started if no test has started it yet (as SparkKind.session)."""
    from hvdmagic.launch.spark import session_for
    from hvdmagic.launch.spark_session import on_spark_thread

    return on_spark_thread(session_for, 2)


def _regression(spark, rows: int = 512, seed: int = 0):
    """y = 2·x0 − 3·x1 + 0.5, with the features as two columns and as one vector."""
    from pyspark.ml.feature import VectorAssembler

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 2))
    y = 2 * x[:, 0] - 3 * x[:, 1] + 0.5
    df = spark.createDataFrame([(float(a), float(b), float(t)) for (a, b), t in zip(x, y)], ["x0", "x1", "y"])
    return VectorAssembler(inputCols=["x0", "x1"], outputCol="features").transform(df)


def _linear_estimator(**params):
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    defaults = dict(num_proc=2, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                    loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["y"], batch_size=16, epochs=8,
                    verbose=0)
    return TorchEstimator(**{**defaults, **params})


@pytest.mark.profile
def test_fit_trains_on_every_rank_and_transform_predicts_in_batches(tmp_path):
    """On a classic session; the pipeline test below runs fit and transform on Spark Connect too."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    df = _regression(_embedded_spark())
    store = Store.create(tmp_path)
    fitted = _linear_estimator(store=store, validation=0.25, run_id="linear").fit(df)
    history = fitted.getHistory()
    assert len(history["loss"]) == 8 and len(history["val_loss"]) == 8, history
    assert history["loss"][-1] < history["loss"][0] / 20, history
    assert fitted.fit_info["collectives"] == "horovod" and fitted.fit_info["num_proc"] == 2
    record = hvdmagic.last_run()
    assert record.command == "TorchEstimator.fit" and len(record.ranks) == 2
    assert any("collectives" in note for note in record.notes), record.notes
    assert [row["step"] for row in record.metrics.to_dict("records") if row["rank"] == 0][-1] == 7
    assert sorted(p.name for p in (tmp_path / "runs" / "linear" / "checkpoint").iterdir()) == ["checkpoint-7.pt"]

    predicted = fitted.transform(df)
    assert predicted.schema["y__output"].dataType == T.DoubleType()  # a scalar label, one value out
    error = predicted.select(F.max(F.abs(F.col("y__output") - F.col("y")))).first()[0]
    assert error < 0.2, error
    assert predicted.columns == [*df.columns, "y__output"]


def test_a_fit_with_the_run_id_of_a_finished_one_resumes_from_its_checkpoint(tmp_path):
    df = _regression(_embedded_spark())
    store = Store.create(tmp_path)
    first = _linear_estimator(store=store, run_id="again", epochs=3).fit(df)
    again = _linear_estimator(store=store, run_id="again", epochs=5).fit(df)
    assert first.fit_info["epochs_run"] == 3 and again.fit_info["epochs_run"] == 2
    assert again.getHistory()["loss"][:3] == first.getHistory()["loss"]
    assert len(again.getHistory()["loss"]) == 5


def test_a_fit_that_checkpoints_to_s3_is_stopped_and_resumes_from_there(s3_bucket, s3_endpoint):
    """Issue 60: rank 0 uploads each epoch's checkpoint through s3fs to moto's S3 server on loopback, with the
    Store's storage_options (a Spark executor's environment is the one its JVM started with); Stop mid-fit;
    a new fit with the same run_id resumes from the newest checkpoint there."""
    import s3fs

    from hvdmagic.errors import JobInterrupted

    df = _regression(_embedded_spark())
    store = Store.create(f"{s3_bucket}/runs", storage_options=storage_options(s3_endpoint))
    checkpoints, fs, fitting = store.get_checkpoint_path("stopped"), s3fs.S3FileSystem(), threading.Event()

    def saved() -> list[str]:
        fs.invalidate_cache()
        return sorted(path.rsplit("/", 1)[1] for path in fs.find(checkpoints))

    def stop_at_the_first_checkpoint() -> None:
        with contextlib.suppress(WaitTimeout):  # then the fit runs to its end and the test fails below
            wait_until(saved, 120, "rank 0 wrote no checkpoint to s3://")
        if fitting.is_set():
            os.kill(os.getpid(), signal.SIGINT)  # Stop, as the kernel's interrupt sends it

    threading.Thread(target=stop_at_the_first_checkpoint, daemon=True).start()
    fitting.set()
    with pytest.raises(JobInterrupted, match=r"^interrupted"):
        _linear_estimator(store=store, run_id="stopped", epochs=2000).fit(df)
    fitting.clear()
    # keep=1: the newest only, uploaded whole; and the one it replaces where Stop came between the newest's
    # upload and the older one's delete (a checkpoint is deleted only once a newer one is whole).
    names = saved()
    epochs = sorted(int(re.fullmatch(r"checkpoint-(\d+)\.pt", name).group(1)) for name in names)
    epoch = epochs[-1]
    assert epochs in ([epoch], [epoch - 1, epoch]), names
    assert epoch < 1999, "the fit ran to its end: Stop did not reach it"
    again = _linear_estimator(store=store, run_id="stopped", epochs=epoch + 3).fit(df)
    assert again.fit_info["epochs_run"] == 2 and len(again.getHistory()["loss"]) == epoch + 3
    assert saved() == [f"checkpoint-{epoch + 2}.pt"]


@pytest.mark.profile
def test_without_horovod_a_fit_trains_on_torch_distributed_and_says_so(monkeypatch):
    """A runtime without a horovod build: the kernel finds none, and the ranks train with DDP over gloo."""
    from hvdmagic.spark.common import estimator

    monkeypatch.setattr(estimator, "horovod_available", lambda: False)
    df = _regression(_embedded_spark())
    fitted = _linear_estimator(backward_passes_per_step=2, epochs=10).fit(df)
    assert fitted.fit_info["collectives"] == "torch.distributed", fitted.fit_info
    assert fitted.getHistory()["loss"][-1] < fitted.getHistory()["loss"][0] / 20, fitted.getHistory()
    record = hvdmagic.last_run()
    assert record.mode == "spark" and "torch.distributed's collectives" in " ".join(record.notes), record.notes


# -- the example horovod ships, with only the import changed ---------------------------------------------
@pytest.mark.timeout(600)  # its own SparkSession, two ranks and the executors: over 300 s on a loaded 2-core machine
def test_horovods_pytorch_spark_mnist_example_runs_with_only_its_import_changed(tmp_path):
    source = (HERE / "horovod_examples" / "pytorch_spark_mnist.py").read_text()
    changed = source.replace("horovod.spark", "hvdmagic.spark")
    assert changed.count("hvdmagic.spark") == 3 and "horovod" not in changed.replace("hvdmagic.spark", "").split(
        "import argparse")[1].split("parser =")[0].replace("Horovod", "")
    script = tmp_path / "pytorch_spark_mnist.py"
    script.write_text(changed)
    write_libsvm(tmp_path / "mnist.bz2")
    done = subprocess.run([sys.executable, str(script), "--num-proc", "2", "--epochs", "8", "--batch-size", "64",
                           "--work-dir", str(tmp_path / "work"), "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          # As `.venv/bin/python script.py` from a shell: no PYSPARK_PYTHON, the venv not on PATH;
                          # its SparkSession's executors run this Python (import hvdmagic.spark sees to it).
                          env=users_shell())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    accuracy = float(re.search(r"Test accuracy: ([\d.]+)", done.stdout).group(1))
    assert accuracy > 0.6, f"test accuracy {accuracy} (0.1 is a model that learned nothing)\n{done.stdout[-3000:]}"


# -- a citizen of Spark ML ------------------------------------------------------------------------------------
def _pipeline(**params):
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import StandardScaler, VectorAssembler

    assemble = VectorAssembler(inputCols=["x0", "x1"], outputCol="raw")
    scale = StandardScaler(inputCol="raw", outputCol="features")
    return Pipeline(stages=[assemble, scale, _linear_estimator(**params)])


@pytest.mark.profile
def test_a_pipeline_fits_evaluates_saves_and_loads(spark_kind, tmp_path, s3_bucket):
    """Also its fitted stage alone to s3:// (moto's server on loopback), which fsspec writes on either session:
    a laptop's Spark has no s3:// file system, and a Spark Connect client has no Hadoop file systems at all."""
    from pyspark.ml import PipelineModel
    from pyspark.ml.evaluation import RegressionEvaluator

    df = _regression(spark_kind.session).drop("features")
    fitted = _pipeline().fit(df)
    evaluator = RegressionEvaluator(labelCol="y", predictionCol="y__output", metricName="rmse")
    rmse = evaluator.evaluate(fitted.transform(df))
    assert rmse < 0.2, rmse
    path = str(tmp_path / "pipeline")
    fitted.write().save(path)
    loaded = PipelineModel.load(path)
    assert isinstance(loaded.stages[-1], TorchModel)
    assert loaded.stages[-1].getHistory() == fitted.stages[-1].getHistory()
    before = fitted.transform(df).select("y__output").toPandas()["y__output"]
    after = loaded.transform(df).select("y__output").toPandas()["y__output"]
    assert np.allclose(before, after), (before[:5], after[:5])
    fitted.stages[-1].write().save(f"{s3_bucket}/model")
    from_s3 = PipelineModel(stages=[*fitted.stages[:-1], TorchModel.load(f"{s3_bucket}/model")])
    after = from_s3.transform(df).select("y__output").toPandas()["y__output"]
    assert np.allclose(before, after), (before[:5], after[:5])


@pytest.mark.unit
def test_a_saved_model_loads_without_a_store_or_spark_and_keeps_its_optimizer(tmp_path):
    import torch

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.003)
    fitted = TorchModel(history={"loss": [1.0, 0.5]}, output_sizes=[2], fit_info={"collectives": "horovod"})
    fitted._set(model=model, optimizer=optimizer, feature_cols=["f"], label_cols=["y"], input_shapes=[[-1, 3]])
    fitted.write().save(str(tmp_path / "m"))
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "architecture.pkl", "metadata", "model.pt", "objects.pkl", "optimizer.pt"]
    assert (tmp_path / "m" / "architecture.pkl").stat().st_size < 2000  # the weights are model.pt's alone
    loaded = TorchModel.load(str(tmp_path / "m"))
    assert loaded.uid == fitted.uid and loaded.getHistory() == {"loss": [1.0, 0.5]}
    assert loaded.getInputShapes() == [[-1, 3]] and loaded.getFeatureCols() == ["f"]
    assert torch.equal(loaded.getModel().weight, model.weight)
    assert loaded.getOptimizer().param_groups[0]["lr"] == 0.003
    with pytest.raises(FileExistsError, match="overwrite"):
        fitted.write().save(str(tmp_path / "m"))
    fitted.write().overwrite().save(str(tmp_path / "m"))


@pytest.mark.unit
def test_spark_mls_conventions_signature_set_params_and_what_a_save_keeps_as_set(tmp_path):
    """Issue 60: the constructor's params show in inspect.signature (help(), IDEs), setParams sets them by
    name, a save keeps the params the user set apart from the defaults (isSet survives the round trip), and
    load checks the saved class."""
    import inspect

    from hvdmagic.spark.common.persistence import StageIOError
    from hvdmagic.spark.lightning import TorchEstimator as LightningEstimator

    signature = inspect.signature(TorchEstimator)
    assert signature.parameters["batch_size"].default == 32 and signature.parameters["epochs"].default == 1
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in signature.parameters.values())
    assert "profiler" in inspect.signature(LightningEstimator).parameters  # a framework's own params too
    assert "\n    batch_size: rows per batch and rank (default: 32)\n" in TorchEstimator.__doc__  # help()'s Args
    estimator = TorchEstimator(feature_cols=["f"], label_cols=["y"])
    assert estimator.setParams(batch_size=64, shuffle=False) is estimator and estimator.getBatchSize() == 64
    with pytest.raises(HvdmagicError, match=r"'epoch' \(did you mean 'epochs'\?\)"):
        estimator.setParams(epoch=3)
    estimator.write().save(str(tmp_path / "estimator"))
    loaded = TorchEstimator.load(str(tmp_path / "estimator"))
    assert loaded.uid == estimator.uid
    assert loaded.isSet(loaded.batch_size) and loaded.getBatchSize() == 64 and not loaded.getShuffle()
    assert not loaded.isSet(loaded.epochs) and loaded.getEpochs() == 1, "a default came back as set"
    with pytest.raises(StageIOError, match=r"holds a hvdmagic\.spark\.torch\.estimator\.TorchEstimator, not a "
                                           r"hvdmagic\.spark\.torch\.estimator\.TorchModel"):
        TorchModel.load(str(tmp_path / "estimator"))


def test_a_model_and_a_pipeline_model_save_to_any_url_sparks_file_systems_take(tmp_path, monkeypatch):
    """Issue 60: a URL is written where Spark writes it (here a Hadoop ViewFs mount, a real non-local scheme
    whose files land in tmp_path), never as a local directory named after its scheme; a URL Spark cannot write
    fails with the file system's own reason, in one paragraph."""
    import torch
    from pyspark.ml import PipelineModel
    from pyspark.ml.feature import VectorAssembler

    from hvdmagic.spark.common.persistence import StageIOError

    spark = _embedded_spark()
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    spark.sparkContext._jsc.hadoopConfiguration().set("fs.viewfs.mounttable.hvdmagictest.link./models",
                                                      mounted.as_uri())
    torch.manual_seed(0)
    model = TorchModel(history={"loss": [1.0, 0.5]}, output_sizes=[1])
    model._set(model=torch.nn.Linear(2, 1), feature_cols=["features"], label_cols=["y"])
    pipeline = PipelineModel(stages=[VectorAssembler(inputCols=["x0", "x1"], outputCol="features"), model])
    monkeypatch.chdir(tmp_path)  # where a URL taken for a local path would have become a directory
    pipeline.write().save("viewfs://hvdmagictest/models/pipeline")
    model.write().save("viewfs://hvdmagictest/models/model")
    assert sorted(p.name for p in mounted.iterdir()) == ["model", "pipeline"]
    assert (mounted / "model" / "model.pt").exists() and not (tmp_path / "viewfs:").exists()
    with pytest.raises(FileExistsError, match="overwrite"):
        model.write().save("viewfs://hvdmagictest/models/model")
    model.write().overwrite().save("viewfs://hvdmagictest/models/model")

    df = _regression(spark, rows=8).drop("features")
    loaded = PipelineModel.load("viewfs://hvdmagictest/models/pipeline")
    before, after = ([np.asarray(v) for v in stages.transform(df).select("y__output").toPandas()["y__output"]]
                     for stages in (pipeline, loaded))
    assert np.allclose(before, after) and TorchModel.load("viewfs://hvdmagictest/models/model").uid == model.uid

    with pytest.raises(StageIOError) as raised:
        model.write().save("nofs://bucket/model")
    message = str(raised.value)
    assert message.startswith("nofs://bucket/model: no file system here writes nofs:// (Spark: Spark has none: "), \
        message
    assert 'scheme "nofs"' in message and "fsspec: Protocol not known: nofs" in message, message
    assert "\n" not in message and not (tmp_path / "nofs:").exists()


def test_a_train_validation_split_over_epochs_picks_the_longer_training():
    """CrossValidator runs in notebooks/13_spark_ml_pipeline.ipynb; the same grid through TrainValidationSplit."""
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import ParamGridBuilder, TrainValidationSplit

    df = _regression(_embedded_spark(), rows=384)
    estimator = _linear_estimator(epochs=1)
    grid = ParamGridBuilder().addGrid(estimator.epochs, [1, 6]).build()
    search = TrainValidationSplit(estimator=estimator, estimatorParamMaps=grid, trainRatio=0.75, seed=1,
                                  evaluator=RegressionEvaluator(labelCol="y", predictionCol="y__output"))
    model = search.fit(df)
    assert model.validationMetrics[1] < model.validationMetrics[0] / 2, model.validationMetrics
    assert model.bestModel.getEpochs() == 6 and len(model.bestModel.getHistory()["loss"]) == 6
    assert model.bestModel.uid == estimator.uid, "Spark ML's rule: a model has its estimator's uid"


# -- bad input: one paragraph, before any rank starts -----------------------------------------------------
def _fails_before_any_rank(estimator, df, match: str) -> None:
    runs = hvdmagic.last_run()
    with pytest.raises(Exception) as caught:
        estimator.fit(df)
    message = str(caught.value)
    assert re.search(match, message), message
    # In a notebook, the paragraph alone, as a cell's errors show (no frames of pyspark or hvdmagic).
    assert isinstance(caught.value, HvdmagicError), type(caught.value)
    assert "\n" not in message.strip() and "at org.apache" not in message, message
    record = hvdmagic.last_run()
    assert record is runs or not record.ranks or all(not rank.logs for rank in record.ranks), "a rank started"


@pytest.mark.profile
def test_bad_input_fails_in_one_paragraph_naming_the_column_or_param(monkeypatch):
    import torch
    from pyspark.sql import functions as F

    spark = _embedded_spark()
    df = _regression(spark, rows=64)
    _fails_before_any_rank(_linear_estimator(feature_cols=["nope"]), df, r"no feature column 'nope'; its columns are")
    words = df.withColumn("word", F.lit("a"))
    _fails_before_any_rank(_linear_estimator(feature_cols=["word"]), words, r"feature column 'word' is string")
    _fails_before_any_rank(_linear_estimator(input_shapes=[[-1, 3]]), df,
                           r"input_shapes gives feature column 'features' the shape \[-1, 3\]")
    _fails_before_any_rank(_linear_estimator(), df.limit(0), r"the DataFrame is empty")
    _fails_before_any_rank(_linear_estimator(batch_size=40), df, r"64 row\(s\), fewer than num_proc × batch_size")
    lock = __import__("threading").Lock()
    _fails_before_any_rank(_linear_estimator(loss=lambda out, y: lock and torch.nn.functional.mse_loss(out, y)), df,
                           r"cannot be sent to the ranks \(cloudpickle: TypeError: cannot pickle '_thread.lock'")
    # Too few slots is said first (the rows would not do either), at once: nothing was on its way.
    waits = record_slot_waits(monkeypatch)
    _fails_before_any_rank(_linear_estimator(num_proc=64), df,
                           r"^num_proc=64 needs 64 barrier task slots at once, but this Spark cluster offers 2 .*"
                           r"no more were on their way after .*use a smaller num_proc, add executors or cores\.$")
    assert [(w.coming, w.waited_for, w.ran_out) for w in waits] == [(None, None, False)], waits
    nulls = df.withColumn("features", F.when(F.col("x0") > 1, None).otherwise(F.col("features")))
    _fails_before_any_rank(_linear_estimator(), nulls, r"feature column features has a null value")


def test_an_estimator_mistake_in_a_notebook_cell_shows_one_paragraph(ip, capfd):
    ip.user_ns.update(df=_regression(_embedded_spark(), rows=64), estimator=_linear_estimator(feature_cols=["nope"]))
    capfd.readouterr()
    _, error = run(ip, "estimator.fit(df)")
    shown = "".join(capfd.readouterr())
    assert error is not None
    assert shown.strip() == f"ColumnError: {error}", shown
    assert "no feature column 'nope'" in shown and "pyspark/ml/base.py" not in shown, shown


# -- MLflow ---------------------------------------------------------------------------------------------------
def test_a_fit_logs_its_params_history_and_model_to_the_active_mlflow_run(tmp_path, monkeypatch):
    import mlflow
    import mlflow.pyspark.ml

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a folder store otherwise
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # read on each call, restored after
    df = _regression(_embedded_spark(), rows=128)
    with mlflow.start_run() as run:
        fitted = _linear_estimator(epochs=3).fit(df)
    logged = mlflow.MlflowClient().get_run(run.info.run_id)
    assert logged.data.params["epochs"] == "3" and logged.data.params["feature_cols"] == '["features"]'
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "loss")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == fitted.getHistory()["loss"]
    artifacts = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="hvdmagic_model",
                                                    dst_path=str(tmp_path / "down"))
    assert TorchModel.load(artifacts).getHistory() == fitted.getHistory()

    mlflow.pyspark.ml.autolog(log_models=False)  # wraps every pyspark.ml fit in a run of its own
    try:
        again = _linear_estimator(epochs=2).fit(df)
        autologged = mlflow.last_active_run()
        assert autologged.info.run_id != run.info.run_id
        steps = mlflow.MlflowClient().get_metric_history(autologged.info.run_id, "loss")
        assert len(steps) == 2 and len(again.getHistory()["loss"]) == 2
    finally:
        mlflow.pyspark.ml.autolog(disable=True)
