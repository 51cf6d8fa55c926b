"""hvdmagic.spark.keras: KerasEstimator fits a Keras model (Keras 3 or tf_keras) through the launcher, and its
KerasModel predicts on the executors; horovod's Keras example runs with only its import changed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from digits_mnist import write_libsvm
from helpers import users_shell
from test_spark_estimators import _embedded_spark, _regression

import hvdmagic
from hvdmagic.spark.common.estimator import FitFailed
from hvdmagic.spark.common.store import Store
from hvdmagic.spark.keras import KerasEstimator, KerasModel

HERE = Path(__file__).parent


def _linear_estimator(keras, **params):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    defaults = dict(num_proc=2, model=model, optimizer=keras.optimizers.SGD(0.05), loss="mse",
                    feature_cols=["features"], label_cols=["y"], batch_size=16, epochs=6, verbose=0, random_seed=0)
    return KerasEstimator(**{**defaults, **params})


@pytest.mark.profile
@pytest.mark.timeout(600)  # three fits, and transforms that import TensorFlow in the executors' Python workers
def test_a_keras_2_model_fits_resumes_transforms_saves_and_loads(tmp_path):
    """tf_keras (Keras 2): fit with validation and a store, a resumed fit, transform, and persistence."""
    import tf_keras
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    df = _regression(_embedded_spark())
    store = Store.create(tmp_path)
    first = _linear_estimator(tf_keras, store=store, validation=0.25, run_id="k2", epochs=4).fit(df)
    history = first.getHistory()
    assert len(history["loss"]) == 4 and len(history["val_loss"]) == 4, history
    assert history["loss"][-1] < history["loss"][0] / 10, history
    assert first.fit_info["collectives"] == "horovod" and first.fit_info["epochs_run"] == 4
    record = hvdmagic.last_run()
    assert record.command == "KerasEstimator.fit" and len(record.ranks) == 2
    assert any("tf_keras" in note for note in record.notes), record.notes
    assert [row["step"] for row in record.metrics.to_dict("records") if row["rank"] == 0][-1] == 3
    assert sorted(p.name for p in (tmp_path / "runs" / "k2" / "checkpoint").iterdir()) == ["epoch-3.pkl"]

    again = _linear_estimator(tf_keras, store=store, validation=0.25, run_id="k2", epochs=6).fit(df)
    assert again.fit_info["epochs_run"] == 2 and again.getHistory()["loss"][:4] == history["loss"]

    predicted = again.transform(df)
    assert predicted.schema["y__output"].dataType == T.DoubleType()  # a scalar label, one value out
    error = predicted.select(F.max(F.abs(F.col("y__output") - F.col("y")))).first()[0]
    assert error < 0.3, error

    path = str(tmp_path / "model")
    again.write().save(path)
    loaded = KerasModel.load(path)
    assert type(loaded.getModel()).__module__.startswith("tf_keras")
    assert loaded.getOptimizer().get_config()["learning_rate"] == pytest.approx(0.05)  # as given: unscaled
    before = again.transform(df).select("y__output").toPandas()["y__output"]
    after = loaded.transform(df).select("y__output").toPandas()["y__output"]
    assert np.allclose(before, after), (before[:5], after[:5])


@pytest.mark.profile
def test_bad_keras_input_fails_in_one_paragraph_before_any_rank_starts():
    import keras
    import tf_keras
    import torch

    df = _regression(_embedded_spark(), rows=64)
    runs = hvdmagic.last_run()
    cases = [
        (dict(model=torch.nn.Linear(2, 1)), "must be a Keras model"),
        (dict(model=keras.Sequential([keras.layers.Dense(1)])), "no input shape yet"),
        (dict(optimizer=keras.optimizers.SGD(0.1)), "Keras 2 \\(tf_keras\\) and Keras 3 \\(keras\\) cannot share"),
        (dict(loss=None), "needs a loss"),
        (dict(input_shapes=[[-1, 3]]), "input_shapes gives feature column 'features' the shape \\[-1, 3\\]"),
    ]
    for params, message in cases:
        with pytest.raises((FitFailed, ValueError), match=message):
            _linear_estimator(tf_keras, **params).fit(df)
        # The DataFrame's checks run under the fit's dashboard (its first stage), and end it before its launch.
        record = hvdmagic.last_run()
        assert record is runs or record.ended_before_launch, f"a bad fit started ranks: {params}"


@pytest.mark.timeout(900)  # TensorFlow starts in the script, two ranks and the executors: minutes on 2 cores
def test_horovods_keras_spark_mnist_example_runs_with_only_its_import_changed(tmp_path):
    """A Keras 3 model (the example's ``from tensorflow import keras`` on TensorFlow 2.21), with its
    TensorBoard callback, through the example's own SparkSession."""
    source = (HERE / "horovod_examples" / "keras_spark_mnist.py").read_text()
    changed = source.replace("horovod.spark", "hvdmagic.spark")
    assert changed.count("hvdmagic.spark") == 3 and "horovod" not in changed.replace("hvdmagic.spark", "").replace(
        "Horovod", "")
    script = tmp_path / "keras_spark_mnist.py"
    script.write_text(changed)
    write_libsvm(tmp_path / "mnist.bz2", copies=2)  # half the torch example's rows: its convolutions cost more
    done = subprocess.run([sys.executable, str(script), "--num-proc", "2", "--epochs", "2", "--batch-size", "64",
                           "--work-dir", str(tmp_path / "work"), "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path,
                          # As `.venv/bin/python script.py` from a shell: no PYSPARK_PYTHON, the venv not on PATH;
                          # its SparkSession's executors run this Python (import hvdmagic.spark sees to it).
                          env=users_shell())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    accuracy = float(re.search(r"Test accuracy: ([\d.]+)", done.stdout).group(1))
    assert accuracy > 0.6, f"test accuracy {accuracy} (0.1 is a model that learned nothing)\n{done.stdout[-3000:]}"
    # The model's Keras trained it, and the Keras 2 note of cells (tf.keras in a cell's ranks) is not shown.
    assert "on cpu (keras 3." in done.stdout and "ranks run Keras 2" not in done.stdout, done.stdout[-3000:]
    logs = list((tmp_path / "work" / "runs").glob("*/logs/train/*"))
    assert logs, "the TensorBoard callback wrote nothing into the store's logs of the run"


@pytest.mark.profile
@pytest.mark.timeout(600)  # the transforms import TensorFlow in the Connect server's Python workers
@pytest.mark.parametrize("spark_kind", ["connect"], indirect=True)
def test_a_keras_3_pipeline_fits_transforms_saves_and_loads_on_spark_connect(spark_kind, tmp_path):
    import keras
    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.feature import VectorAssembler

    df = _regression(spark_kind.session).drop("features")
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=["x0", "x1"], outputCol="features"),
                                _linear_estimator(keras)])
    fitted = pipeline.fit(df)
    assert fitted.stages[-1].fit_info["collectives"] == "horovod"
    evaluator = RegressionEvaluator(labelCol="y", predictionCol="y__output", metricName="rmse")
    rmse = evaluator.evaluate(fitted.transform(df))
    assert rmse < 0.3, rmse
    path = str(tmp_path / "pipeline")
    fitted.write().save(path)
    loaded = PipelineModel.load(path)
    assert isinstance(loaded.stages[-1], KerasModel) and type(loaded.stages[-1].getModel()).__module__.startswith(
        "keras.")
    before = fitted.transform(df).select("y__output").toPandas()["y__output"]
    after = loaded.transform(df).select("y__output").toPandas()["y__output"]
    assert np.allclose(before, after), (before[:5], after[:5])
