"""A fit's params, per-epoch metrics and model, logged to the active MLflow run.

As ``hvdmagic.kernel.mlflow_export`` does for cells, from the driver: the ranks need no MLflow. Only
where ``mlflow`` is installed and a run is active (``mlflow.start_run()``, or the one
``mlflow.pyspark.ml.autolog()`` opens around each ``fit``); otherwise nothing happens. Params the run
has already (autolog logs the estimator's params itself) are left as they are: MLflow refuses to
change a logged param. The model is the saved stage (``write().save``), logged as the artifacts
under ``hvdmagic_model``: ``TorchModel.load`` reads them back.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
import time

ARTIFACT_PATH = "hvdmagic_model"
_NOT_LOGGED = ("model", "optimizer", "store", "backend")


def log_fit(estimator, fitted) -> str | None:
    """Log ``fitted`` (made by ``estimator``) to the active MLflow run; its run id, or None without one."""
    if importlib.util.find_spec("mlflow") is None:
        return None
    import mlflow
    from mlflow.entities import Metric, Param

    run = mlflow.active_run()
    if run is None:
        return None
    client = mlflow.MlflowClient()
    run_id = run.info.run_id
    present = client.get_run(run_id).data.params
    params = [Param(name, text[:6000]) for name, text in _params(estimator).items() if name not in present]
    now = int(time.time() * 1000)
    metrics = [Metric(name, float(value), now, step) for name, values in fitted.getHistory().items()
               for step, value in enumerate(values)]
    for start in range(0, max(len(params), len(metrics)), 100):  # MLflow's limit on params in one call
        client.log_batch(run_id, params=params[start:start + 100], metrics=metrics[start:start + 100])
    client.set_tag(run_id, "hvdmagic.fit", json.dumps(fitted.fit_info))
    with tempfile.TemporaryDirectory() as directory:
        fitted.write().save(f"{directory}/model")
        client.log_artifacts(run_id, f"{directory}/model", ARTIFACT_PATH)
    return run_id


def _params(estimator) -> dict[str, str]:
    out = {}
    for param, value in estimator.extractParamMap().items():
        if param.name in _NOT_LOGGED or value is None:
            continue
        out[param.name] = value if isinstance(value, str) else json.dumps(value, default=repr)
    return out
