"""What every framework's estimator and model share: the checks, fit through the launcher, and transform.

``fit``:

1. checks the params and the DataFrame's columns (``common.columns``), and counts the first
   ``num_proc × batch_size`` rows with one small job: fewer fail at once, with the numbers;
2. prepares the DataFrame (only the columns training reads, vectors as arrays, the validation rows
   marked), lazily;
3. runs the framework's training loop (``hvdmagic.rank.estimator_*``) on ``num_proc`` ranks through
   ``execute``, as a ``%%horovod --data`` cell runs: its shards, dashboard, errors naming the rank,
   Stop and stragglers;
4. makes the model from rank 0's weights.

``transform`` adds the prediction columns with one scalar-iterator pandas UDF
(``hvdmagic.task.batch_inference``), lazily, with their types known without a probing job. A
large model reaches each host once through the blob cache (``model_delivery``), and the action
that runs the predictions shows their progress under its cell (``transform_progress``).
"""

from __future__ import annotations

import copy as copying
import dataclasses
import importlib.util
import pickle
import time

from pyspark.ml import Estimator, Model
from pyspark.sql import functions as F

from hvdmagic.errors import HvdmagicError
from hvdmagic.launch.spark import check_slots, kernel_host
from hvdmagic.launch.spark_session import spark_output_quiet
from hvdmagic.protocol import Stage
from hvdmagic.rank.estimator_data import FitResult, FitSpec
from hvdmagic.spark.common import columns, model_delivery, tracking, transform_progress
from hvdmagic.spark.common.params import EstimatorParams
from hvdmagic.spark.common.store import new_run_id
from hvdmagic.task.batch_inference import PredictSpec


def horovod_available() -> bool:
    return importlib.util.find_spec("horovod") is not None and importlib.util.find_spec("horovod.torch") is not None


class FitFailed(HvdmagicError, RuntimeError):
    """A fit that could not start: the message says what to change, in one paragraph as a cell's
    errors do (no frames of pyspark's or hvdmagic's)."""


class HorovodEstimator(Estimator, EstimatorParams):
    """The shared estimator: a framework's subclass names its training loop, checks its model and
    makes its fitted model (``_fit_function``, ``_check_model``, ``_model_from``)."""

    framework = "torch"

    def __init__(self, **kwargs):
        super().__init__()
        self._set_arguments(kwargs)

    # -- what a framework says --------------------------------------------------
    def _fit_function(self):
        """The function each rank calls with the FitSpec."""
        raise NotImplementedError

    def _collectives(self) -> str:
        return "horovod" if horovod_available() else "torch"

    def _check_model(self) -> None:
        """The framework's checks of model, optimizer and loss, before anything runs."""

    def _copied(self, objects: dict) -> dict:
        """Copies of the model and optimizer (``objects``) for ``copy``."""
        return copying.deepcopy(objects)

    def _rank_environment(self) -> dict[str, str]:
        """Variables the framework's training needs in every rank (a SparkBackend's ``env`` comes on top)."""
        return {}

    def _input_shapes(self) -> list | None:
        """Each feature's shape in the model: the ``input_shapes`` param (a framework may know a default)."""
        return self.getOrDefault("input_shapes")

    # -- Spark ML -------------------------------------------------------------
    def copy(self, extra=None):
        """A copy whose model and optimizer are copies too (as one, so the optimizer keeps the copy's
        parameters): fitting the copy never changes this estimator's objects."""
        that = super().copy(extra)
        objects = {name: that.getOrDefault(name) for name in ("model", "optimizer")
                   if that.isDefined(name) and that.getOrDefault(name) is not None}
        if objects:
            that._set(**self._copied(objects))
        that._ignored = list(self._ignored)
        return that

    def _fit(self, df):
        started = time.monotonic()
        session = df.sparkSession
        num_proc = self._num_proc(session)
        self._check_model()
        batch_size = self.getOrDefault("batch_size")
        if batch_size < 1:
            raise FitFailed(f"batch_size must be 1 or more, not {batch_size}.")
        feature_cols, label_cols = self._columns("feature_cols"), self._columns("label_cols")
        spec = self._spec()

        def prepare(on_stage):
            """The checks and counts that take Spark jobs, under the run's dashboard: the slots first
            (too few is what to report first), then the DataFrame's columns, rows and shapes."""
            check_slots(session, num_proc, "num_proc", on_stage)
            on_stage(Stage.PREPARING_DATA)
            prepared = columns.training_frame(df, feature_cols, label_cols, self.getOrDefault("sample_weight_col"),
                                              self.getOrDefault("validation"), self.getOrDefault("random_seed"))
            needed = num_proc * batch_size
            rows, sizes = columns.first_rows_summary(prepared, needed)
            if rows == 0:
                raise FitFailed("the DataFrame is empty: there is nothing to train on.")
            if rows < needed:
                raise FitFailed(f"the DataFrame has {rows} row(s), fewer than num_proc × batch_size = {num_proc} × "
                                f"{batch_size} = {needed}: every rank needs at least one full batch. Lower "
                                "batch_size or num_proc.")
            columns.check_shapes(sizes, prepared.kinds, feature_cols, self._input_shapes())
            return prepared.frame

        with spark_output_quiet(session):  # Spark's console bar: the dashboard shows the stages
            result = self._run(spec, num_proc, prepare)
        fitted = self._model_from(result, df, spec, num_proc, time.monotonic() - started)
        tracking.log_fit(self, fitted)
        return fitted

    def _num_proc(self, session) -> int:
        num_proc, backend = self.getOrDefault("num_proc"), self.getOrDefault("backend")
        if num_proc is not None and backend is not None:
            raise FitFailed("give num_proc or backend, not both (horovod.spark's rule): backend=SparkBackend("
                            "num_proc=N) carries the number itself.")
        if backend is not None:
            return backend.num_processes(session)
        if num_proc is None:
            from hvdmagic.spark.common.backend import SparkBackend

            return SparkBackend().num_processes(session)
        if num_proc < 1:
            raise FitFailed(f"num_proc must be 1 or more, not {num_proc}.")
        return num_proc

    def _columns(self, name: str) -> list[str]:
        return list(self.getOrDefault(name)) if self.isDefined(name) else []

    def _spec(self) -> FitSpec:
        """What the ranks train with: each of FitSpec's fields that a param names takes the param's value, the
        others are made here."""
        get = self.getOrDefault
        store, run_id = get("store"), get("run_id") or new_run_id()
        params = {field.name: get(field.name) for field in dataclasses.fields(FitSpec) if self.hasParam(field.name)}
        return FitSpec(**{
            **params,
            "framework": self.framework, "collectives": self._collectives(), "run_id": run_id,
            "feature_cols": list(get("feature_cols")), "label_cols": list(get("label_cols")),
            "input_shapes": self._input_shapes(), "validation": bool(get("validation")),
            "callbacks": list(get("callbacks") or []),
            "checkpoint_dir": store.get_checkpoint_path(run_id) if store is not None else None,
            "logs_dir": store.get_logs_path(run_id) if store is not None else None,
            "store_options": store.storage_options if store is not None else None,
            "notes": [f"hvdmagic: {', '.join(self._ignored)} tune Petastorm's reader in horovod.spark; here the "
                      "DataFrame reaches the ranks as Arrow shards, so they change nothing"] if self._ignored else [],
        })

    def _run(self, spec: FitSpec, num_proc: int, prepare) -> FitResult:
        """The training on ``num_proc`` ranks, through the launcher cells use, on the DataFrame that
        ``prepare`` returns (``kernel.runner.execute``'s); rank 0's result."""
        from hvdmagic.kernel.api import pack_call
        from hvdmagic.kernel.runner import execute
        from hvdmagic.launch import Placement, ResultPolicy
        from hvdmagic.protocol import Framework

        framework = Framework.HOROVOD if spec.collectives == "horovod" else Framework.TORCH
        placement = Placement.of(num_proc, framework=framework, name="num_proc")
        try:
            payload = pack_call((self._fit_function(), (spec,), {}), type(self.getOrDefault("model")))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise FitFailed(f"the model, optimizer, loss, metrics or callbacks cannot be sent to the ranks "
                            f"(cloudpickle: {type(exc).__name__}: {exc}); a lambda or a class defined in the "
                            "notebook travels, an open file, lock or connection does not.") from None
        backend = self.getOrDefault("backend")
        env = {**self._rank_environment(), **(backend.env if backend is not None else {})}
        return execute(payload, placement, prepare=prepare, results=ResultPolicy.RANK0, env=env or None,
                       command=f"{type(self).__name__}.fit", charts_expected=True,
                       bars_expected=True).result

    def _model_from(self, result: FitResult, df, spec: FitSpec, num_proc: int, seconds: float):
        raise NotImplementedError

    def _fitted(self, model_class, result: FitResult, df, spec: FitSpec, num_proc: int, seconds: float,
                **objects):
        """The fitted ``model_class`` from rank 0's ``result``: its history, output sizes, label types and
        fit_info, this estimator's params, and ``objects`` (the trained model, its optimizer...)."""
        fitted = model_class(history=result.history, output_sizes=result.output_sizes,
                             label_types=self._label_types(df),
                             fit_info={"collectives": result.collectives, "num_proc": num_proc,
                                       "epochs_run": result.epochs_run, "seconds": round(seconds, 2),
                                       "training_seconds": round(result.training_seconds, 2),
                                       "device": result.device, "run_id": spec.run_id})
        fitted._resetUid(self.uid)  # Spark ML's rule: a model has its estimator's uid
        self._copyValues(fitted)
        fitted._set(**objects, run_id=spec.run_id)
        return fitted

    def _label_types(self, df) -> list:
        return [df.schema[name].dataType for name in self.getOrDefault("label_cols")]


class HorovodModel(Model, EstimatorParams):
    """The shared model: predictions in batches on the executors, persistence in the framework's format."""

    framework = "torch"

    def __init__(self, **kwargs):
        super().__init__()
        self.history: dict[str, list[float]] = kwargs.pop("history", None) or {}
        self.output_sizes: list[int] = list(kwargs.pop("output_sizes", None) or [])
        self.label_types: list = list(kwargs.pop("label_types", None) or [])
        self.fit_info: dict = kwargs.pop("fit_info", None) or {}
        self._set_arguments(kwargs)

    def getHistory(self) -> dict[str, list[float]]:
        """Per epoch: the training loss and metrics, and ``val_``-prefixed the validation ones."""
        return self.history

    def copy(self, extra=None):
        that = super().copy(extra)
        that.history, that.output_sizes = dict(self.history), list(self.output_sizes)
        that.label_types, that.fit_info = list(self.label_types), dict(self.fit_info)
        return that

    # -- what a framework says ----------------------------------------------------
    def _model_bytes(self) -> bytes:
        """The model for the executors: cloudpickled, on the CPU, its class's file included when that is the
        user's own (an executor's Python worker cannot import a ``.py`` file from beside the notebook)."""
        import cloudpickle

        from hvdmagic.kernel.capture import users_module_by_value

        with users_module_by_value(type(self.getOrDefault("model"))):
            return cloudpickle.dumps(self.getOrDefault("model"))

    # -- transform --------------------------------------------------------------
    def output_columns(self) -> list[str]:
        labels = self.getOrDefault("label_cols")
        return list(self.getOrDefault("output_cols") or [f"{label}__output" for label in labels])

    def _transform(self, df):
        from collections.abc import Iterator

        import pandas as pd
        from pyspark.ml.functions import array_to_vector
        from pyspark.sql import types as T
        from pyspark.sql.functions import pandas_udf

        from hvdmagic.task.batch_inference import predict

        feature_cols = self.getOrDefault("feature_cols")
        outputs = self.output_columns()
        if len(outputs) != len(self.output_sizes):
            raise columns.ColumnError(f"output_cols names {len(outputs)} column(s) {outputs} for a model with "
                                      f"{len(self.output_sizes)} output(s).")
        kinds = {name: columns.kind(df, name, "feature") for name in feature_cols}
        host = kernel_host(df.sparkSession)
        spec = PredictSpec(
            framework=self.framework,
            model=model_delivery.source_for(self._model_bytes(), host, f"{type(self).__name__}'s model"),
            feature_cols=tuple(feature_cols),
            input_shapes=tuple(tuple(s) for s in self.getOrDefault("input_shapes") or []) or None,
            output_sizes=tuple(self.output_sizes),
            batch_size=self.getOrDefault("transform_batch_size") or self.getOrDefault("batch_size"),
            use_gpu=self.getOrDefault("use_gpu"), reports=transform_progress.report_to(host),
        )
        one = [T.DoubleType() if size == 1 else T.ArrayType(T.DoubleType()) for size in self.output_sizes]
        returns = one[0] if len(one) == 1 else T.StructType([T.StructField(f"_{i}", t) for i, t in enumerate(one)])

        def batches(iterator):
            return predict(spec, iterator)

        # A scalar-iterator UDF, told by its hints (set here: this module's annotations are strings).
        batches.__annotations__ = {"iterator": Iterator[pd.DataFrame],
                                   "return": Iterator[pd.Series if len(one) == 1 else pd.DataFrame]}
        udf = pandas_udf(batches, returns)
        features = F.struct(*[columns.as_arrow_friendly(df, name, kinds[name], "feature") for name in feature_cols])
        predicted = "__hvdmagic_predicted"
        out = df.withColumn(predicted, udf(features))
        for i, (name, size) in enumerate(zip(outputs, self.output_sizes)):
            value = F.col(predicted) if len(outputs) == 1 else F.col(predicted)[f"_{i}"]
            target = columns.output_type(self.label_types[i] if i < len(self.label_types) else None, size)
            if columns.is_vector(target):
                value = array_to_vector(value if size > 1 else F.array(value))
            else:
                value = value.cast(target)
            out = out.withColumn(name, value)
        return out.drop(predicted)


