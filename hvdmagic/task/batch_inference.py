"""A Spark ML model's ``transform``, inside an executor's Python worker: batches of rows through the model.

The kernel wraps ``predict`` in a scalar-iterator pandas UDF over a struct of the feature columns
(``hvdmagic.spark.common.estimator``). Each Arrow batch Spark hands the worker is cut into
``batch_size`` rows, and each of those is one forward pass, not one per row as horovod.spark does.

The model's bytes come as its ``ModelSource`` says (``spark.common.model_delivery``): inside
the UDF when small; else the host's first task fetches them from the kernel's blob server into
the host's blob cache (``task.blob_cache``), once per host, and passes them on to the hosts
that ask after it (``task.blob_relay``, which this worker keeps serving while it lives). The
model is unpickled once per Python worker and kept while the worker lives (Spark reuses its
workers, ``spark.python.worker.reuse``), under the digest of its bytes: the tasks of a transform
and of the next one with the same model find it loaded. Each task runs on the GPU its Spark
resources give it (``TaskContext.resources()["gpu"]``), on the CPU otherwise. Each task reports
its rows to the kernel as it goes (``task.transform_reports``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hvdmagic.protocol import Blob
from hvdmagic.task.transform_reports import ReportTo, TaskReport

_loaded: dict[tuple[str, str], Any] = {}  # by model digest and device: (model, device), for this worker's life
_KEEP = 3  # models a worker keeps (a CrossValidator's folds each bring one)
_relays: dict[tuple, Any] = {}  # by (kernel's blob server, secret): this worker's BlobRelay toward the other hosts
_relays_lock = threading.Lock()


@dataclass(frozen=True)
class ModelSource:
    """Where a worker finds the model's pickled bytes: ``inline`` (a small model, in the UDF itself), or
    the kernel's blob server at ``address`` (``secret``: its own), as the blob ``blob``."""

    digest: str  # BLAKE3 of the bytes: the worker's cache key, and the blob's name
    inline: bytes | None = None
    blob: Blob | None = None
    address: tuple[str, int] | None = None
    secret: bytes = b""


@dataclass(frozen=True)
class PredictSpec:
    framework: str  # "torch", "keras" or "lightning"
    model: ModelSource
    feature_cols: tuple[str, ...]
    input_shapes: tuple | None
    output_sizes: tuple[int, ...]  # values per row of each output; 1 and a scalar label: a scalar column
    batch_size: int
    use_gpu: bool | None
    reports: ReportTo  # the kernel's progress server


def predict(spec: PredictSpec, batches: Iterator) -> Iterator:
    """The UDF's body: for each pandas batch of features (a DataFrame), the outputs (a Series, or a
    DataFrame with one column per output when the model has several)."""
    report = TaskReport(spec.reports)
    try:
        yield from _predicted(spec, batches, report)
    except GeneratorExit:
        report.end(failed=False)  # Spark read what it needed (a limit) and closed the rest
        raise
    except BaseException:
        report.end(failed=True)
        raise
    report.end(failed=False)


def _predicted(spec: PredictSpec, batches: Iterator, report: TaskReport) -> Iterator:
    import numpy as np
    import pandas as pd

    model, device = _model(spec)
    shapes = spec.input_shapes or [None] * len(spec.feature_cols)
    for frame in batches:
        # Each feature as one array for the whole Arrow batch; the forward passes take slices of it.
        features = [_feature(frame[name]) for name in spec.feature_cols]
        rows = len(frame)
        outputs = [np.empty((rows, size), dtype=np.float64) for size in spec.output_sizes]
        for start in range(0, rows, spec.batch_size):
            end = min(start + spec.batch_size, rows)
            inputs = [_shaped(values[start:end], shape) for values, shape in zip(features, shapes)]
            for out, values in zip(outputs, _forward(spec.framework, model, device, inputs)):
                out[start:end] = values.reshape(end - start, -1)
        columns = [pd.Series(out[:, 0]) if out.shape[1] == 1 else pd.Series(list(out)) for out in outputs]
        report.add(rows)
        yield columns[0] if len(columns) == 1 else pd.DataFrame({f"_{i}": c for i, c in enumerate(columns)})


def _feature(series):
    """A feature column of the batch as float32: a vector per row (arrays, vectors) or one number."""
    import numpy as np

    first = series.iloc[0] if len(series) else None
    values = np.stack(series.to_numpy()) if isinstance(first, np.ndarray | list) else series.to_numpy()
    return values.astype(np.float32, copy=False)


def _shaped(values, shape):
    return values.reshape(shape) if shape else values


def _model(spec: PredictSpec):
    # By device too: this task's (its GPU, or use_gpu=False's CPU) may not be the one a task before it in
    # this worker loaded the same model on.
    device = _device(spec)
    key = (spec.model.digest, device)
    if key not in _loaded:
        import cloudpickle

        while len(_loaded) >= _KEEP:
            _loaded.pop(next(iter(_loaded)))
        model = cloudpickle.loads(_model_bytes(spec.model))
        if spec.framework in ("torch", "lightning"):
            model = model.to(device).eval()
        _loaded[key] = (model, device)
    return _loaded[key]


def _model_bytes(source: ModelSource) -> bytes:
    """The pickled model: inline, or from this host's blob cache, fetched there first if no task has."""
    if source.inline is not None:
        return source.inline
    from hvdmagic.blob_transfer import BlobError
    from hvdmagic.task.blob_cache import BlobCache

    cache = BlobCache()
    try:
        cache.ensure([source.blob], source.address, source.secret, relay=_relay(source, cache))
    except BlobError as exc:
        raise RuntimeError(
            f"this transform's model ({source.blob.label}) could not be fetched from the notebook's kernel at "
            f"{source.address[0]}:{source.address[1]}: {exc}. The kernel keeps the bytes of the models its "
            "latest transforms named; call transform on the model again, and run the action on that "
            "DataFrame.") from None
    return cache.path(source.blob).read_bytes()


def _relay(source: ModelSource, cache):
    """This worker's relay toward the other hosts, on the interface it reaches the kernel through."""
    import socket

    from hvdmagic.task.blob_relay import BlobRelay

    key = (source.address, source.secret)
    with _relays_lock:
        if key not in _relays:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # connect() sends nothing
                probe.connect(source.address)
                host = probe.getsockname()[0]
            _relays[key] = BlobRelay(host, source.secret, cache.directory)
        return _relays[key]


def _device(spec: PredictSpec) -> str:
    """The task's GPU from its Spark resources, or the CPU."""
    if spec.use_gpu is False:
        return "cpu"
    from pyspark import TaskContext

    context = TaskContext.get()
    gpus = context.resources().get("gpu") if context is not None else None
    if gpus is None or not gpus.addresses:
        if spec.use_gpu:
            raise RuntimeError("use_gpu=True, but this Spark task was given no GPU (spark.task.resource.gpu.amount)")
        return "cpu"
    return f"cuda:{gpus.addresses[0]}"


def _forward(framework: str, model, device: str, inputs: list) -> list:
    """One forward pass: each output as a numpy array, one row per input row."""
    if framework == "keras":
        outputs = model(inputs if len(inputs) > 1 else inputs[0], training=False)
        outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
        return [output.numpy() for output in outputs]
    import torch

    with torch.no_grad():
        outputs = model(*[torch.from_numpy(x).to(device) for x in inputs])
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return [output.detach().to("cpu").numpy() for output in outputs]
