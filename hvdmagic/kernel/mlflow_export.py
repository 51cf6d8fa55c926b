"""Log a finished run's rank-0 metrics to MLflow, from the driver.

The ranks need no MLflow and no access to the tracking server: after the run,
``log_run()`` reads the run record (``hvdmagic.last_run()``) and writes one MLflow
run with rank 0's metric history (each value at its step and time), the run's
parameters and duration, and rank 0's numeric results. ``%%horovod --mlflow``
does the same after a successful cell.

The tracking server is MLflow's usual one: ``tracking_uri``, else
``MLFLOW_TRACKING_URI``. (MLflow 3 refuses a ``./mlruns`` folder unless
``MLFLOW_ALLOW_FILE_STORE=true``; ``mlflow-skinny`` has no sqlite store.)
"""

from __future__ import annotations

import math
import os
import re
from numbers import Real

from hvdmagic.kernel.record import last_run

try:
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param
except ImportError as exc:
    raise ImportError(
        "hvdmagic.kernel.mlflow_export needs MLflow on the driver (the ranks do not): pip install mlflow-skinny "
        "(the client only, enough for a tracking server or a local folder) or mlflow."
    ) from exc

_STATUS = {"finished": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}
_NOT_METRICS = {"rank", "step", "time"}
_BATCH = 1000  # MLflow's limit on metrics in one log_batch call
_INVALID = re.compile(r"[^\w./\- ]")  # MLflow accepts letters, digits and _ - . / space in names


def log_run(record=None, experiment: str | None = None, run_name: str | None = None,
            tracking_uri: str | None = None) -> str:
    """Write ``record`` (default: ``hvdmagic.last_run()``) as a new MLflow run; return its run id.

    ``experiment`` is an experiment name, created if missing; without it,
    ``MLFLOW_EXPERIMENT_NAME`` or ``MLFLOW_EXPERIMENT_ID`` decides, else MLflow's
    Default experiment. Logged: every metric rank 0 reported with
    ``hvdmagic.log_metrics`` at its step; ``duration_s``; ``result.NAME`` for each
    number in a dict returned by rank 0; params ``np`` and ``mode``; tags with the
    run's state, notes (e.g. the scaled learning rate) and timeline path.
    """
    if record is None:
        record = last_run()
        if record is None:
            raise ValueError("log_run() has no run to log: run a %%horovod cell or hvdmagic.run(...) first, "
                             "or pass the record of one.")
    if record.state not in _STATUS:
        raise ValueError(f"log_run() logs ended runs; this one is still {record.state}.")
    client = MlflowClient(tracking_uri)
    started, ended = record.timings["started"], record.timings["ended"]
    run = client.create_run(_experiment_id(client, experiment), start_time=_ms(started),
                            run_name=run_name or f"hvdmagic {record.mode} np={record.np}", tags=_tags(record))
    run_id = run.info.run_id
    metrics = _rank0_metrics(record) + _result_metrics(record.result, ended)
    metrics.append(Metric("duration_s", float(record.elapsed), _ms(ended), 0))
    client.log_batch(run_id, params=[Param("np", str(record.np)), Param("mode", record.mode)])
    for start in range(0, len(metrics), _BATCH):
        client.log_batch(run_id, metrics=metrics[start:start + _BATCH])
    client.set_terminated(run_id, status=_STATUS[record.state], end_time=_ms(ended))
    return run_id


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _experiment_id(client, name: str | None) -> str:
    name = name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if not name:
        return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")  # "0" is MLflow's Default experiment
    found = client.get_experiment_by_name(name)
    return found.experiment_id if found is not None else client.create_experiment(name)


def _tags(record) -> dict[str, str]:
    tags = {"hvdmagic.state": record.state, "hvdmagic.mode": record.mode}
    if record.notes:
        tags["hvdmagic.notes"] = "\n".join(record.notes)
    if record.timeline:
        tags["hvdmagic.timeline"] = record.timeline
    if record.error is not None:
        tags["hvdmagic.error"] = str(record.error).splitlines()[0] if str(record.error) else type(record.error).__name__
    return tags


def _rank0_metrics(record) -> list:
    frame = record.metrics
    if frame.empty:
        return []
    frame = frame[frame["rank"] == 0]
    names = [name for name in frame.columns if name not in _NOT_METRICS]
    metrics = []
    # to_dict, not itertuples: metric names such as "train/loss" are not identifiers.
    for row in frame.to_dict("records"):
        for name in names:
            value = row[name]
            if value is None or (isinstance(value, float) and math.isnan(value)):
                continue  # this metric was not logged in this call
            stamp = _ms(row["time"].timestamp())
            metrics.append(Metric(_INVALID.sub("_", str(name)), float(value), stamp, int(row["step"])))
    return metrics


def _result_metrics(result, ended: float) -> list:
    if not isinstance(result, dict):
        return []
    return [Metric(_INVALID.sub("_", f"result.{name}"), float(value), _ms(ended), 0)
            for name, value in result.items()
            if isinstance(value, Real) and not isinstance(value, bool)]
