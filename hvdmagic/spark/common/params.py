"""The params of every estimator and model, declared once with horovod.spark's names and meanings.

Each param is a Spark ML ``Param``, so ``ParamGridBuilder().addGrid(est.epochs, [...])``,
``copy(extra)``, ``explainParams()`` and persistence see them, and each has horovod.spark's getter
and setter (``getBatchSize``/``setBatchSize``). A few hold Python objects (the model, the loss);
they travel to the ranks with cloudpickle and are saved the same way.
"""

from __future__ import annotations

import difflib

from pyspark.ml.param import Param, Params, TypeConverters

from hvdmagic.errors import BadArgumentType


def _param(name: str, doc: str, converter=None) -> Param:
    return Param(Params._dummy(), name, doc, typeConverter=converter)


def _columns(value) -> list[str]:
    """A column name or a list of them, as a list (horovod.spark takes both)."""
    return [value] if isinstance(value, str) else TypeConverters.toListString(value)


# Petastorm's knobs in horovod.spark: accepted, and said once in the run's notes to change nothing. Among them
# the schema of Petastorm's TransformSpec (here transformation_fn's pandas batch needs none) and the sparse
# vectors' compression in its Parquet files.
PETASTORM_ONLY = ("partitions_per_process", "reader_pool_type", "train_reader_num_workers",
                  "val_reader_num_workers", "inmemory_cache_all", "shuffle_buffer_size", "loader_num_epochs",
                  "train_async_data_loader_queue_size", "val_async_data_loader_queue_size", "mp_start_method",
                  "debug_data_loader", "reader_shuffle", "data_module", "transformation_edit_fields",
                  "transformation_removed_fields", "compress_sparse_cols")


class EstimatorParams(Params):
    # -- where and how many ---------------------------------------------------
    num_proc = _param("num_proc", "number of training processes (Spark barrier tasks); excludes backend",
                      TypeConverters.toInt)
    backend = _param("backend", "a SparkBackend (num_proc, env); excludes num_proc")
    store = _param("store", "a Store (Store.create(path)): checkpoints and logs")
    use_gpu = _param("use_gpu", "train on the GPU each task's Spark resources give it (default: when there is one)",
                     TypeConverters.toBoolean)
    # -- the model ------------------------------------------------------------
    model = _param("model", "the model to train (torch.nn.Module, keras.Model, LightningModule)")
    optimizer = _param("optimizer", "the optimizer (its class, hyperparameters and state travel with the model)")
    loss = _param("loss", "the loss function, or one per label column")
    loss_constructors = _param("loss_constructors", "functions that build the loss(es) inside each rank")
    loss_weights = _param("loss_weights", "weights of the losses, one per label column")
    metrics = _param("metrics", "metrics to compute each epoch on training and validation data")
    custom_objects = _param("custom_objects", "Keras: custom objects for loading the model")
    gradient_compression = _param("gradient_compression", "Horovod's gradient compression (hvd.Compression.fp16)")
    # -- the data -------------------------------------------------------------
    feature_cols = _param("feature_cols", "the feature columns: one input of the model each", _columns)
    label_cols = _param("label_cols", "the label columns: one output of the model each", _columns)
    input_shapes = _param("input_shapes", "each feature column's shape in the model, -1 for the batch")
    sample_weight_col = _param("sample_weight_col", "a column of per-row weights for the loss",
                               TypeConverters.toString)
    validation = _param("validation", "a fraction of the rows (0 to 1), or a boolean column: the validation rows")
    # -- the training ---------------------------------------------------------
    batch_size = _param("batch_size", "rows per batch and rank", TypeConverters.toInt)
    val_batch_size = _param("val_batch_size", "rows per validation batch and rank (default: batch_size)",
                            TypeConverters.toInt)
    epochs = _param("epochs", "passes over the training rows", TypeConverters.toInt)
    train_steps_per_epoch = _param("train_steps_per_epoch", "batches per epoch (default: every row once)",
                                   TypeConverters.toInt)
    validation_steps_per_epoch = _param("validation_steps_per_epoch",
                                        "validation batches per epoch (default: every row once)", TypeConverters.toInt)
    callbacks = _param("callbacks", "the framework's callbacks")
    verbose = _param("verbose", "0: quiet, 1: a line per epoch on rank 0", TypeConverters.toInt)
    random_seed = _param("random_seed", "seed of the weights' initialisation, the split and the shuffles",
                         TypeConverters.toInt)
    shuffle = _param("shuffle", "reshuffle each rank's training rows every epoch", TypeConverters.toBoolean)
    run_id = _param("run_id", "the run's name in the store: a fit with the run_id of an earlier one resumes "
                    "from its last checkpoint", TypeConverters.toString)
    backward_passes_per_step = _param("backward_passes_per_step", "batches whose gradients are summed before "
                                      "each allreduce and step", TypeConverters.toInt)
    transformation_fn = _param("transformation_fn", "a function applied to each rank's pandas batch of rows "
                               "before training (Petastorm's TransformSpec function)")
    train_minibatch_fn = _param("train_minibatch_fn", "a function that runs one training step itself")
    trainer_args = _param("trainer_args", "Lightning: keyword arguments for its Trainer")
    label_shapes = _param("label_shapes", "each label column's shape, -1 for the batch")
    # -- the model's transform ------------------------------------------------
    output_cols = _param("output_cols", "the prediction columns (default: <label>__output)", _columns)
    transform_batch_size = _param("transform_batch_size", "rows per forward pass in transform (default: "
                                  "batch_size)", TypeConverters.toInt)

    def __init__(self):
        super().__init__()
        self._setDefault(use_gpu=None, loss_constructors=None, loss_weights=None, metrics=None, custom_objects=None,
                         gradient_compression=None, input_shapes=None, sample_weight_col=None, validation=None,
                         batch_size=32, val_batch_size=None, epochs=1, train_steps_per_epoch=None,
                         validation_steps_per_epoch=None, callbacks=None, verbose=1, random_seed=None, shuffle=True,
                         run_id=None, backward_passes_per_step=1, transformation_fn=None, train_minibatch_fn=None,
                         trainer_args=None, label_shapes=None, output_cols=None, transform_batch_size=None,
                         num_proc=None, backend=None, store=None, optimizer=None, loss=None)
        self._ignored: list[str] = []  # the Petastorm-only arguments this estimator was given

    def setParams(self, **kwargs):
        """Set params by name, as the constructor takes them (``est.setParams(epochs=5, batch_size=64)``);
        returns the estimator, for chaining."""
        ignored = list(self._ignored)
        self._set_arguments(kwargs)
        self._ignored = sorted({*ignored, *self._ignored})
        return self

    def _set_arguments(self, kwargs: dict) -> None:
        """The constructor's keyword arguments: params, Petastorm's ignored knobs, or a clear error."""
        unknown = [name for name in kwargs if not self.hasParam(name) and name not in PETASTORM_ONLY]
        if unknown:
            known = [p.name for p in self.params] + list(PETASTORM_ONLY)
            hints = [f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, known, 1))
                     else repr(name) for name in unknown]
            raise BadArgumentType(f"{type(self).__name__} got unknown argument(s) {', '.join(hints)}; its params "
                                  f"are {', '.join(sorted(p.name for p in self.params))}.")
        self._ignored = sorted(name for name in kwargs if name in PETASTORM_ONLY)
        self._set(**{name: value for name, value in kwargs.items() if self.hasParam(name) and value is not None})


def keyword_signature(cls: type) -> type:
    """A class decorator: ``inspect.signature``, ``help()`` and IDEs that read it show ``cls``'s params as
    keyword arguments with their defaults, as Spark ML's ``@keyword_only`` constructors declare theirs, from
    the params declared once here (and a framework's own), not written out again in every constructor."""
    import inspect

    instance = cls()
    defaults = {param.name: value for param, value in instance._defaultParamMap.items()}
    parameters = [inspect.Parameter(param.name, inspect.Parameter.KEYWORD_ONLY, default=defaults.get(param.name))
                  for param in sorted(instance.params, key=lambda param: param.name)]
    cls.__signature__ = inspect.Signature(parameters)
    described = "\n".join(f"    {param.name}: {param.doc}" + ("" if "default" in param.doc else
                                                                 f" (default: {defaults.get(param.name)!r})")
                          for param in sorted(instance.params, key=lambda param: param.name))
    cls.__doc__ = f"{(cls.__doc__ or '').rstrip()}\n\nArgs:\n{described}\n"
    return cls


def _camel(name: str) -> str:
    return "".join(part.title() for part in name.split("_"))


def add_accessors(cls: type) -> type:
    """horovod.spark's ``getX``/``setX`` for each of ``cls``'s params (``setBatchSize``, ``getFeatureCols``)."""

    def accessors(name):
        def get(self):
            return self.getOrDefault(name)

        def set_(self, value):
            return self._set(**{name: value})

        get.__doc__ = f"The value of ``{name}``."
        set_.__doc__ = f"Set ``{name}``; returns the estimator, for chaining."
        return get, set_

    for param in dir(cls):
        if isinstance(getattr(cls, param, None), Param):
            get, set_ = accessors(param)
            for prefix, method in (("get", get), ("set", set_)):
                if not hasattr(cls, prefix + _camel(param)):
                    setattr(cls, prefix + _camel(param), method)
    return cls


add_accessors(EstimatorParams)
