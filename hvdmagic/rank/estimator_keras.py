"""``KerasEstimator.fit``'s training, as each rank runs it (``hvdmagic.spark.keras``): Keras' own ``fit``.

It keeps horovod.spark's meanings: the model compiled with the optimizer, loss(es), ``loss_weights``
and metrics; the learning rate scaled by the number of ranks on a fresh run (and unscaled in the
model it returns); the epoch's metrics averaged over the ranks before any callback sees them; rank
0's checkpoint after every epoch, and a resumed run taking up at the epoch after it. TensorBoard
callbacks write on rank 0 only, into the store's logs of the run.

The gradients are averaged with Horovod's TensorFlow collectives inside the optimizer's
``apply_gradients``, which Keras 3 and Keras 2 (``tf_keras``) both call from their training step:
horovod.tensorflow.keras's own DistributedOptimizer does not average under Keras 3, and a notebook's
model is Keras 3 on today's TensorFlow. The model comes in the Keras it was built in
(``hvdmagic.keras_archive``).
"""

from __future__ import annotations

import pickle
import re
import time
from pathlib import Path

from hvdmagic import protocol
from hvdmagic.file_urls import Folder
from hvdmagic.keras_archive import keras_package
from hvdmagic.rank import telemetry
from hvdmagic.rank.estimator_data import FitSpec, ShardRows, shaped
from hvdmagic.rank.shards import shard
from hvdmagic.rank.training import checkpoint_steps, write_checkpoint

_CHECKPOINT = re.compile(r"^epoch-(\d+)\.pkl$")


def fit(spec: FitSpec) -> dict | None:
    """Train ``spec.model`` on this rank's shard; rank 0 returns the weights, history and output sizes."""
    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    hvd.init()
    device = _pin_device(tf, spec, hvd.local_rank())
    keras = keras_package(spec.model)
    model = spec.model
    if hvd.rank() == 0:
        for text in [*spec.notes, f"hvdmagic: training on {hvd.size()} rank(s) with horovod's collectives, on "
                     f"{device} ({keras.__name__} {keras.__version__})"]:
            telemetry.emit(protocol.note(text))
    if spec.random_seed is not None:
        tf.random.set_seed(spec.random_seed)

    history: dict[str, list[float]] = {}
    # Rank 0's view of the store, so that every rank resumes from the same epoch (a store only its host sees).
    saved = hvd.broadcast_object(_newest_checkpoint(spec.checkpoint_dir) if hvd.rank() == 0 else None, root_rank=0,
                                 name="hvdmagic.checkpoint")
    start = 0
    config = dict(spec.optimizer["config"])
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
        history, start = state["history"], epoch + 1
        if hvd.rank() == 0:
            print(f"resuming from the checkpoint of epoch {epoch + 1} in {spec.checkpoint_dir}", flush=True)

    rows = ShardRows(shard(), spec)
    largest = _largest(hvd, tf)
    train_steps = rows.steps(largest(len(rows.train)), spec.batch_size, spec.train_steps_per_epoch)
    val_batch = spec.val_batch_size or spec.batch_size
    val_steps = rows.steps(largest(len(rows.val)), val_batch, spec.validation_steps_per_epoch) \
        if spec.validation else 0
    output_shapes = [list(output.shape) for output in model.outputs]
    rng = np.random.default_rng(None if spec.random_seed is None else spec.random_seed + hvd.rank())

    def batches(indices, size, steps, shuffled):
        """Every epoch's batches, one epoch after another: Keras takes ``steps`` of them each epoch."""
        while True:
            for arrays in rows.batches(indices, size, steps, rng if shuffled else None):
                yield _keras_batch(arrays, spec, output_shapes)

    callbacks = [_dashboard(keras, hvd, spec, train_steps, history)]
    callbacks += [c for c in spec.callbacks if hvd.rank() == 0 or not isinstance(c, keras.callbacks.TensorBoard)]
    if hvd.rank() == 0 and spec.checkpoint_dir:
        for callback in callbacks:
            if isinstance(callback, keras.callbacks.TensorBoard):
                callback.log_dir = str(Path(spec.checkpoint_dir).parent / "logs")
        callbacks.append(_checkpoint(keras, spec.checkpoint_dir, history))
    started = time.monotonic()
    if start < spec.epochs:
        model.fit(batches(rows.train, spec.batch_size, train_steps, spec.shuffle), steps_per_epoch=train_steps,
                  epochs=spec.epochs, initial_epoch=start, callbacks=callbacks, verbose=0, shuffle=False,
                  validation_data=batches(rows.val, val_batch, val_steps, False) if val_steps else None,
                  validation_steps=val_steps or None)
    training_seconds = time.monotonic() - started
    if hvd.rank() != 0:
        return None
    inputs, _ = _keras_batch(next(rows.batches(rows.train, 1, 1)), spec, output_shapes)[:2]
    outputs = model(inputs, training=False)
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    return {"weights": model.get_weights(), "history": history,
            "output_sizes": [int(np.prod(output.shape[1:])) for output in outputs],
            "collectives": "horovod", "epochs_run": spec.epochs - start, "device": device,
            "training_seconds": training_seconds}


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


def _largest(hvd, tf):
    def largest(value: int) -> int:
        return int(hvd.allreduce(tf.constant([value], dtype=tf.int64), op=hvd.Max, name="hvdmagic.rows").numpy()[0])

    return largest


def _keras_batch(arrays, spec: FitSpec, output_shapes):
    """(inputs, labels[, sample weights]) as Keras' fit takes them, float32, each reshaped to its input's or
    output's shape."""
    import numpy as np

    def floats(values):
        return np.require(values, np.float32, ["C", "W"])

    shapes = spec.input_shapes or [None] * len(spec.feature_cols)
    inputs = [shaped(floats(arrays[c]), shape) for c, shape in zip(spec.feature_cols, shapes)]
    labels = []
    for name, shape in zip(spec.label_cols, output_shapes):
        values = floats(arrays[name])
        per_row = int(np.prod([d for d in shape[1:] if d])) if len(shape) > 1 else 1
        labels.append(values.reshape([len(values), *shape[1:]]) if values.size == len(values) * per_row
                      and None not in shape[1:] else values)
    batch = (inputs[0] if len(inputs) == 1 else inputs, labels[0] if len(labels) == 1 else labels)
    return (*batch, floats(arrays[spec.sample_weight_col])) if spec.sample_weight_col else batch


def _dashboard(keras, hvd, spec: FitSpec, train_steps: int, history: dict):
    """First of the callbacks: averages the epoch's numbers over the ranks (in Keras' own ``logs``, so the
    callbacks after it see the averages), keeps the history, and drives the dashboard's bars and chart."""
    import numpy as np

    class Dashboard(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.started = time.monotonic()
            telemetry.progress(epoch, spec.epochs, "epoch")

        def on_train_batch_end(self, batch, logs=None):
            telemetry.progress(batch + 1, train_steps, "batch")

        def on_epoch_end(self, epoch, logs=None):
            names = sorted(name for name, value in (logs or {}).items() if np.ndim(value) == 0)
            values = np.array([float(logs[name]) for name in names], dtype=np.float64)
            averaged = hvd.allreduce(values, op=hvd.Average, name="hvdmagic.metrics").numpy().tolist()
            for name, value in zip(names, averaged):
                logs[name] = value
                history.setdefault(name, []).append(value)
            telemetry.progress(epoch + 1, spec.epochs, "epoch")
            if hvd.rank() == 0:
                telemetry.log_metrics(step=epoch, **dict(zip(names, averaged)))
                if spec.verbose:
                    shown = ", ".join(f"{name} {value:.4g}" for name, value in zip(names, averaged))
                    print(f"epoch {epoch + 1}/{spec.epochs}: {shown} ({time.monotonic() - self.started:.1f} s)",
                          flush=True)

    return Dashboard()


def _checkpoint(keras, directory: str, history: dict):
    """Last of rank 0's callbacks: the weights, optimizer state and history after each epoch, written
    beside their final name and renamed (a fit stopped mid-write leaves nothing half-written)."""

    class Checkpoint(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            state = {"weights": self.model.get_weights(), "history": history,
                     "optimizer": [variable.numpy() for variable in self.model.optimizer.variables]}
            write_checkpoint(Folder(directory), f"epoch-{epoch}.pkl", _CHECKPOINT, 1,
                             lambda path: path.write_bytes(pickle.dumps(state)))

    return Checkpoint()


def _newest_checkpoint(directory: str | None):
    """(epoch, state) of the newest checkpoint in ``directory``, or None."""
    folder = Folder(directory) if directory else None
    epochs = checkpoint_steps(folder, _CHECKPOINT) if folder else {}
    if not epochs:
        return None
    newest = max(epochs)
    return newest, folder.read(epochs[newest], lambda path: pickle.loads(path.read_bytes()))

