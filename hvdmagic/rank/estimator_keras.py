"""``KerasEstimator.fit``'s training, as each rank runs it (``hvdmagic.spark.keras``): Keras' own ``fit``.

It keeps horovod.spark's meanings: the model compiled with the optimizer, loss(es), ``loss_weights``
and metrics; the learning rate scaled by the number of ranks on a fresh run (and unscaled in the
model it returns); the epoch's metrics averaged over the ranks before any callback sees them; rank
0's checkpoint after every epoch, and a resumed run taking up at the epoch after it. TensorBoard
callbacks write on rank 0 only, into the store's logs of the run.

The gradients are averaged with Horovod's TensorFlow collectives inside the optimizer's
``apply_gradients``, which Keras 3 and Keras 2 (``tf_keras``) both call from their training step:
horovod.tensorflow.keras's own DistributedOptimizer does not average under Keras 3, and a notebook's
model is Keras 3 on today's TensorFlow. ``backward_passes_per_step`` becomes Keras 3's
``gradient_accumulation_steps``: each batch's gradients are averaged over the ranks, and their mean over
the passes is applied once every that many batches. The model comes in the Keras it was built in
(``hvdmagic.keras_archive``).
"""

from __future__ import annotations

import pickle
import re

from hvdmagic.file_urls import Folder
from hvdmagic.keras_archive import keras_package
from hvdmagic.rank.estimator_data import FitResult, FitSpec, ShardRows, as_float32
from hvdmagic.rank.estimator_fit import RankFit
from hvdmagic.rank.shards import shard
from hvdmagic.rank.training import checkpoint_steps, write_checkpoint

_CHECKPOINT = re.compile(r"^epoch-(\d+)\.pkl$")


def fit(spec: FitSpec) -> FitResult | None:
    """Train ``spec.model`` on this rank's shard; rank 0 returns the weights, history and output sizes."""
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    hvd.init()
    device = _pin_device(tf, spec, hvd.local_rank())
    keras = keras_package(spec.model)
    model = spec.model
    group = _Horovod(hvd, tf)
    run = RankFit(spec, group, device, tf.random.set_seed, about=f"{keras.__name__} {keras.__version__}")

    # Rank 0's view of the store, so that every rank resumes from the same epoch (a store only its host sees).
    saved = hvd.broadcast_object(_newest_checkpoint(spec) if hvd.rank() == 0 else None, root_rank=0,
                                 name="hvdmagic.checkpoint")
    config = dict(spec.optimizer["config"])
    if spec.backward_passes_per_step > 1:  # Keras 3's accumulation (the estimator refuses a Keras without it)
        config["gradient_accumulation_steps"] = spec.backward_passes_per_step
    if saved is None:
        config["learning_rate"] = _scaled(config.get("learning_rate"), hvd.size())
    optimizer = _averaging(keras.optimizers.deserialize({**spec.optimizer, "config": config}), hvd, tf, spec)
    model.compile(optimizer=optimizer, loss=_losses(spec), loss_weights=spec.loss_weights,
                  metrics=_metrics(spec), jit_compile=False)  # Horovod's ops cannot run inside XLA
    if saved is not None:
        epoch, state = saved
        model.set_weights(state["weights"])
        optimizer.build(model.trainable_variables)
        for variable, value in zip(optimizer.variables, state["optimizer"]):
            variable.assign(value)
        run.resumed(epoch, state["history"])

    rows = ShardRows(shard(), spec)
    steps = run.epoch_steps(rows)
    output_shapes = [list(output.shape) for output in model.outputs]

    def batches(indices, size, count, shuffles):
        """Every epoch's batches, one epoch after another: Keras takes ``count`` of them each epoch."""
        while True:
            for arrays in rows.batches(indices, size, count, shuffles):
                yield _keras_batch(arrays, spec, output_shapes)

    callbacks = [_dashboard(keras, run)]
    callbacks += [c for c in spec.callbacks if hvd.rank() == 0 or not isinstance(c, keras.callbacks.TensorBoard)]
    if hvd.rank() == 0 and spec.checkpoint_dir:
        for callback in callbacks:
            if isinstance(callback, keras.callbacks.TensorBoard):
                callback.log_dir = spec.logs_dir
        callbacks.append(_checkpoint(keras, Folder(spec.checkpoint_dir, spec.store_options), run.history))
    with run.training():
        if run.start < spec.epochs:
            model.fit(batches(rows.train, spec.batch_size, steps.train, run.shuffles), steps_per_epoch=steps.train,
                      epochs=spec.epochs, initial_epoch=run.start, callbacks=callbacks, verbose=0, shuffle=False,
                      validation_data=batches(rows.val, steps.val_batch_size, steps.val, None) if steps.val else None,
                      validation_steps=steps.val or None)
    if hvd.rank() != 0:
        return None
    inputs, _ = _keras_batch(next(rows.batches(rows.train, 1, 1)), spec, output_shapes)[:2]
    outputs = model(inputs, training=False)
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return run.result(model.get_weights(), None, [int(np.prod(output.shape[1:])) for output in outputs])


class _Horovod:
    """Horovod's TensorFlow collectives, for the skeleton's reductions (``RankGroup``)."""

    name = "horovod"

    def __init__(self, hvd, tf):
        self.hvd, self.tf = hvd, tf
        self.rank, self.size = hvd.rank(), hvd.size()

    def largest(self, values: list[int]) -> list[int]:
        tensor = self.tf.constant(values, dtype=self.tf.int64)
        return self.hvd.allreduce(tensor, op=self.hvd.Max, name="hvdmagic.rows").numpy().tolist()

    def mean(self, metrics: dict[str, float]) -> dict[str, float]:
        tensor = self.tf.constant(list(metrics.values()), dtype=self.tf.float64)
        averaged = self.hvd.allreduce(tensor, op=self.hvd.Average, name="hvdmagic.metrics")
        return dict(zip(metrics, averaged.numpy().tolist()))


def _pin_device(tf, spec: FitSpec, local_rank: int) -> str:
    """The GPU this rank's task was given (CUDA_VISIBLE_DEVICES shows it alone), or the CPU.

    Unpickling the model may have started TensorFlow's devices already; then the visible devices can
    no longer change, and the task's CUDA_VISIBLE_DEVICES has chosen them (not yet run on a GPU)."""
    gpus = tf.config.list_physical_devices("GPU")
    if spec.use_gpu and not gpus:
        raise RuntimeError("use_gpu=True, but TensorFlow sees no GPU in this rank: give the tasks GPUs "
                           "(spark.task.resource.gpu.amount) or pass use_gpu=False")
    try:
        if spec.use_gpu is False or not gpus:
            tf.config.set_visible_devices([], "GPU")
        else:
            gpu = gpus[local_rank % len(gpus)]
            tf.config.experimental.set_memory_growth(gpu, True)
            tf.config.set_visible_devices(gpu, "GPU")
    except RuntimeError:
        pass
    return "gpu" if gpus and spec.use_gpu is not False else "cpu"


def _scaled(learning_rate, factor: float):
    """A plain learning rate times ``factor``; a schedule (a dict) as it is."""
    return learning_rate * factor if isinstance(learning_rate, (int, float)) else learning_rate


def _averaging(optimizer, hvd, tf, spec: FitSpec):
    """``optimizer``, its gradients averaged over the ranks before each update (a subclass made here)."""
    compression = spec.gradient_compression if spec.gradient_compression is not None else hvd.Compression.none

    class Averaging(type(optimizer)):
        def apply_gradients(self, grads_and_vars, *args, **kwargs):
            pairs = list(grads_and_vars)
            dense = [(tf.convert_to_tensor(g), v) for g, v in pairs if g is not None]
            averaged = hvd.grouped_allreduce([g for g, _ in dense], op=hvd.Average, compression=compression) \
                if dense else []
            return super().apply_gradients([(g, v) for g, (_, v) in zip(averaged, dense)], *args, **kwargs)

    Averaging.__name__ = Averaging.__qualname__ = type(optimizer).__name__
    optimizer.__class__ = Averaging
    return optimizer


def _losses(spec: FitSpec):
    if spec.loss_constructors:
        return [make() for make in spec.loss_constructors]
    losses = list(spec.loss) if isinstance(spec.loss, (list, tuple)) else spec.loss
    if isinstance(losses, list) and len(losses) != len(spec.label_cols):
        raise ValueError(f"{len(losses)} losses for {len(spec.label_cols)} label columns {spec.label_cols}: give "
                         "one loss, or one per label column")
    return losses


def _metrics(spec: FitSpec):
    if not spec.metrics or len(spec.label_cols) == 1:
        return spec.metrics
    return [list(spec.metrics) for _ in spec.label_cols]  # each output gets them all, as horovod.spark does


def _keras_batch(arrays, spec: FitSpec, output_shapes):
    """(inputs, labels[, sample weights]) as Keras' fit takes them, float32, each reshaped to its input's shape, and
    each label to its ``label_shapes`` entry where given (horovod.spark's), else to its output's shape."""
    import numpy as np

    shapes = spec.input_shapes or [None] * len(spec.feature_cols)
    inputs = [as_float32(arrays[c], shape) for c, shape in zip(spec.feature_cols, shapes)]
    labels = []
    given = list(spec.label_shapes or [])
    given += [None] * (len(spec.label_cols) - len(given))
    for name, shape, label_shape in zip(spec.label_cols, output_shapes, given):
        if label_shape is not None:
            labels.append(as_float32(arrays[name], label_shape))
            continue
        values = as_float32(arrays[name])
        per_row = int(np.prod([d for d in shape[1:] if d])) if len(shape) > 1 else 1
        labels.append(values.reshape([len(values), *shape[1:]]) if values.size == len(values) * per_row
                      and None not in shape[1:] else values)
    # Several as tuples: Keras 3's generator adapter takes no lists in a batch's structure.
    batch = (inputs[0] if len(inputs) == 1 else tuple(inputs), labels[0] if len(labels) == 1 else tuple(labels))
    return (*batch, as_float32(arrays[spec.sample_weight_col])) if spec.sample_weight_col else batch


def _dashboard(keras, run: RankFit):
    """First of the callbacks: the epoch's numbers averaged over the ranks into Keras' own ``logs`` (so the
    callbacks after it see the averages), and the skeleton's bars, history, chart and line."""
    import numpy as np

    class Dashboard(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            run.epoch_started(epoch)

        def on_train_batch_end(self, batch, logs=None):
            run.batch_done(batch)

        def on_epoch_end(self, epoch, logs=None):
            logs = logs if logs is not None else {}
            names = sorted(name for name, value in logs.items() if np.ndim(value) == 0)
            logs.update(run.epoch_done(epoch, {name: float(logs[name]) for name in names}))

    return Dashboard()


def _checkpoint(keras, folder: Folder, history: dict):
    """Last of rank 0's callbacks: the weights, optimizer state and history after each epoch, written
    beside their final name and renamed (a fit stopped mid-write leaves nothing half-written)."""

    class Checkpoint(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            state = {"weights": self.model.get_weights(), "history": history,
                     "optimizer": [variable.numpy() for variable in self.model.optimizer.variables]}
            write_checkpoint(folder, f"epoch-{epoch}.pkl", _CHECKPOINT, 1,
                             lambda path: path.write_bytes(pickle.dumps(state)))

    return Checkpoint()


def _newest_checkpoint(spec: FitSpec):
    """(epoch, state) of the newest checkpoint in the store's checkpoint directory, or None."""
    folder = Folder(spec.checkpoint_dir, spec.store_options) if spec.checkpoint_dir else None
    epochs = checkpoint_steps(folder, _CHECKPOINT) if folder else {}
    if not epochs:
        return None
    newest = max(epochs)
    return newest, folder.read(epochs[newest], lambda path: pickle.loads(path.read_bytes()))

