"""``KerasEstimator``: trains a Keras model on a DataFrame; ``KerasModel`` predicts with it.

The training each rank runs is ``hvdmagic.rank.estimator_keras`` (Keras' own ``fit``, gradients
averaged by Horovod's TensorFlow collectives); everything else is the shared estimator's
(``hvdmagic.spark.common.estimator``). The model may be Keras 3 (``tf.keras`` on TensorFlow 2.16 and
later, ``import keras``) or Keras 2 (``tf_keras``): it travels as a ``.keras`` archive and is trained,
saved and loaded by the Keras that built it (``hvdmagic.keras_archive``).
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import pickle
from pathlib import Path

from hvdmagic.keras_archive import Archived, keras_package, load_file
from hvdmagic.rank.estimator_data import FitResult
from hvdmagic.spark.common.estimator import FitFailed, HorovodEstimator, HorovodModel
from hvdmagic.spark.common.params import add_accessors, keyword_signature
from hvdmagic.spark.common.persistence import Persistent


def horovod_tensorflow_built() -> bool:
    """Whether horovod is installed with its TensorFlow extension (without importing TensorFlow)."""
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(glob.glob(os.path.join(location, "tensorflow", "mpi_lib*.so"))
               for location in spec.submodule_search_locations)


def _serialized_optimizer(keras, optimizer) -> dict:
    """The optimizer as Keras' config (a Keras 2 optimizer does not pickle); a name like "adam" works too."""
    return keras.optimizers.serialize(keras.optimizers.get(optimizer))


class _KerasPersistent(Persistent):
    """Saved with the model as a ``.keras`` file and the optimizer as Keras' config (a Keras 2 optimizer does
    not pickle), loaded by the Keras that made them."""

    saved_by_framework = ("model", "optimizer")

    def _extra_metadata(self) -> dict:
        model, optimizer = self.getOrDefault("model"), self.getOrDefault("optimizer")
        keras = keras_package(model)
        return {"keras": keras.__name__ if keras else None,
                "optimizer": _serialized_optimizer(keras, optimizer) if keras and optimizer is not None else None}

    def _save_weights(self, root: Path) -> None:
        if self.getOrDefault("model") is not None:
            self.getOrDefault("model").save(str(root / "model.keras"))

    @staticmethod
    def _saved_objects(root: Path, extra: dict) -> dict:
        """The model and optimizer of a saved stage, for ``_set``."""
        import importlib

        import cloudpickle

        if not (root / "model.keras").exists():
            return {}
        custom_objects = cloudpickle.loads((root / "objects.pkl").read_bytes()).get("custom_objects")
        objects = {"model": load_file(extra["keras"], root / "model.keras", custom_objects)}
        if extra.get("optimizer") is not None:
            objects["optimizer"] = importlib.import_module(extra["keras"]).optimizers.deserialize(extra["optimizer"])
        return objects


@keyword_signature
@add_accessors
class KerasEstimator(HorovodEstimator, _KerasPersistent):
    """Spark ML estimator for a Keras model, with horovod.spark.keras.KerasEstimator's params.

    Example::

        from hvdmagic.spark.common.store import Store
        from hvdmagic.spark.keras import KerasEstimator

        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(1)])
        estimator = KerasEstimator(num_proc=2, store=Store.create("/tmp/runs"), model=model,
                                   optimizer=keras.optimizers.Adam(0.01), loss="mse",
                                   feature_cols=["features"], label_cols=["y"], batch_size=32, epochs=5)
        fitted = estimator.fit(train_df)            # the dashboard shows the ranks while it trains
        predictions = fitted.transform(test_df)     # column y__output

    ``input_shapes`` defaults to the model's own input shapes, as in horovod.spark.
    """

    framework = "keras"

    @classmethod
    def _from_saved(cls, root: Path, extra: dict) -> KerasEstimator:
        estimator = cls()
        estimator._set(**cls._saved_objects(root, extra))
        return estimator

    def _fit_function(self):
        from hvdmagic.rank.estimator_keras import fit

        return fit

    def _collectives(self) -> str:
        return "horovod"

    def _check_model(self) -> None:
        if not horovod_tensorflow_built():
            raise FitFailed("KerasEstimator trains with Horovod's TensorFlow collectives, and this Python's horovod is "
                            "missing or was built without TensorFlow (HOROVOD_WITH_TENSORFLOW=1; `make setup` builds "
                            "it, docs/frameworks.md). hvdmagic.spark.torch.TorchEstimator needs no horovod.")
        model = self.getOrDefault("model") if self.isDefined("model") else None
        keras = keras_package(model)
        if keras is None or not isinstance(model, keras.Model):
            raise FitFailed(f"KerasEstimator's model must be a Keras model (keras.Model, tf.keras.Model), not "
                            f"{type(model).__name__}.")
        try:
            built = bool(model.inputs)
        except (AttributeError, ValueError):
            built = False
        if not built:
            raise FitFailed("the Keras model has no input shape yet: start it with keras.Input(shape=...) (or give its "
                            "first layer input_shape=...), so that the rows can be shaped for it.")
        optimizer = self.getOrDefault("optimizer")
        if optimizer is None:
            raise FitFailed("KerasEstimator needs an optimizer (optimizer=keras.optimizers.Adam(0.001), or 'adam').")
        theirs = keras_package(optimizer) if not isinstance(optimizer, str) else keras
        if theirs is not keras:
            raise FitFailed(f"the model is {keras.__name__}'s and the optimizer "
                            f"{getattr(theirs, '__name__', type(optimizer).__module__)}'s: Keras 2 (tf_keras) and "
                            "Keras 3 (keras) cannot share one; build both with the same Keras.")
        try:
            _serialized_optimizer(keras, optimizer)
        except (ValueError, TypeError) as exc:
            raise FitFailed(f"the optimizer {optimizer!r} is not one Keras knows: {exc}") from None
        if self.getOrDefault("loss") is None and not self.getOrDefault("loss_constructors"):
            raise FitFailed("KerasEstimator needs a loss (loss='mse', keras.losses.CategoricalCrossentropy(), or one "
                            "per label column).")
        passes = self.getOrDefault("backward_passes_per_step")
        if passes != 1 and "gradient_accumulation_steps" not in _serialized_optimizer(keras, optimizer)["config"]:
            raise FitFailed(f"backward_passes_per_step={passes} becomes the optimizer's gradient_accumulation_steps, "
                            f"which Keras 3's optimizers have and {keras.__name__}'s do not: build the model and "
                            "optimizer with Keras 3 (import keras), or leave backward_passes_per_step out.")

    def _rank_environment(self) -> dict[str, str]:
        # tf.keras in the ranks is the model's Keras: hvdmagic's Keras 2 default for cells is not this fit's.
        legacy = keras_package(self.getOrDefault("model")).__name__ == "tf_keras"
        return {"TF_USE_LEGACY_KERAS": "1" if legacy else "0"}

    def _input_shapes(self) -> list | None:
        given = self.getOrDefault("input_shapes")
        if given is not None:
            return given
        inputs = self.getOrDefault("model").inputs
        return [[-1 if dim is None else int(dim) for dim in tensor.shape] for tensor in inputs]

    def _copied(self, objects: dict) -> dict:
        keras = keras_package(objects["model"])
        copied = {"model": _copy_model(objects["model"], self.getOrDefault("custom_objects"))}
        if "optimizer" in objects:
            copied["optimizer"] = keras.optimizers.deserialize(_serialized_optimizer(keras, objects["optimizer"]))
        return copied

    def _spec(self):
        model = self.getOrDefault("model")
        return dataclasses.replace(
            super()._spec(), model=Archived(model, self.getOrDefault("custom_objects")),
            optimizer=_serialized_optimizer(keras_package(model), self.getOrDefault("optimizer")))

    def _model_from(self, result: FitResult, df, spec, num_proc: int, seconds: float) -> KerasModel:
        model = _copy_model(self.getOrDefault("model"), self.getOrDefault("custom_objects"))
        model.set_weights(result.weights)
        keras = keras_package(model)
        return self._fitted(KerasModel, result, df, spec, num_proc, seconds, model=model,
                            optimizer=keras.optimizers.deserialize(spec.optimizer), input_shapes=spec.input_shapes)


def _copy_model(model, custom_objects=None):
    """A new model with ``model``'s architecture and weights, in the same Keras (through its archive)."""
    import cloudpickle

    return pickle.loads(cloudpickle.dumps(Archived(model, custom_objects)))


@add_accessors
class KerasModel(HorovodModel, _KerasPersistent):
    """A fitted KerasEstimator: ``transform`` adds ``<label>__output`` columns (``setOutputCols`` renames
    them); ``getModel()`` is the trained Keras model, ``getHistory()`` its per-epoch metrics."""

    framework = "keras"

    def _model_bytes(self) -> bytes:
        import cloudpickle

        return cloudpickle.dumps(Archived(self.getOrDefault("model"), self.getOrDefault("custom_objects")))

    def _extra_metadata(self) -> dict:
        return {**super()._extra_metadata(), "history": self.history, "output_sizes": self.output_sizes,
                "fit_info": self.fit_info, "label_types": [t.json() for t in self.label_types]}

    @classmethod
    def _from_saved(cls, root: Path, extra: dict) -> KerasModel:
        from pyspark.sql.types import _parse_datatype_json_string

        fitted = cls(history=extra.get("history"), output_sizes=extra.get("output_sizes"),
                     fit_info=extra.get("fit_info"),
                     label_types=[_parse_datatype_json_string(t) for t in extra.get("label_types", [])])
        fitted._set(**cls._saved_objects(root, extra))
        return fitted
