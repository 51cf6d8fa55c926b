"""A Spark ML estimator's fit, as the kernel and the ranks exchange it: what the kernel sends every rank
(``FitSpec``), what rank 0 sends back (``FitResult``), and the rank's shard read as batches.

The shard is the Arrow IPC file the rank's task wrote from its partition of the prepared DataFrame
(``hvdmagic.task.shards``), memory-mapped: a batch is taken from it row by row (``Table.take``) and
converted on its own, so a rank holds one batch at a time, not its shard, and a shard larger than
the rank's memory streams from the page cache. The limit is the executor's local disk, where the
shard lies.

Every rank runs the same number of steps an epoch (``hvdmagic.rank.estimator_fit``): the most any
rank's rows need, a rank with fewer rows going round its own rows again, as horovod.spark's endless
Petastorm reader does. No rank then waits in an allreduce for another's extra batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# Columns the kernel adds to the prepared DataFrame (hvdmagic.spark.common.estimator).
VALIDATION_COLUMN = "__hvdmagic_validation"  # true for a validation row


@dataclass(kw_only=True)
class FitSpec:
    """What one fit sends every rank: the estimator's params as plain values, and its objects.

    A field named as a param takes that param's value (``HorovodEstimator._spec``); the defaults are the
    params' own, declared once in ``hvdmagic.spark.common.params``, so none is written here."""

    framework: str  # "torch", "keras" or "lightning"
    collectives: str  # "horovod" or "torch" (torch.distributed)
    run_id: str  # the run's name in the store
    model: Any
    feature_cols: list[str]
    label_cols: list[str]
    input_shapes: list[list[int]] | None
    label_shapes: list[list[int]] | None
    sample_weight_col: str | None
    validation: bool  # VALIDATION_COLUMN marks the validation rows
    optimizer: Any
    loss: Any
    loss_constructors: list | None
    loss_weights: list[float] | None
    metrics: list | None
    custom_objects: dict | None
    gradient_compression: Any
    callbacks: list
    batch_size: int
    val_batch_size: int | None
    epochs: int
    train_steps_per_epoch: int | None
    validation_steps_per_epoch: int | None
    shuffle: bool
    random_seed: int | None
    verbose: int
    backward_passes_per_step: int
    transformation_fn: Callable | None
    train_minibatch_fn: Callable | None
    trainer_args: dict | None
    use_gpu: bool | None
    checkpoint_dir: str | None  # the store's checkpoint directory of this run_id: a path or a URL
    logs_dir: str | None  # the store's logs directory of this run_id (Keras' TensorBoard)
    store_options: dict | None  # for a URL: the store's storage_options, for fsspec's driver on rank 0's host
    notes: list[str]  # for the run's notes, said by rank 0


@dataclass(kw_only=True)
class FitResult:
    """What rank 0 sends back from a fit: the trained weights in its framework's form, and how the fit went."""

    weights: Any  # torch and Lightning: the module's state_dict; Keras: model.get_weights()
    optimizer_state: dict | None  # torch's optimizer state_dict (Keras and Lightning make their optimizer anew)
    history: dict[str, list[float]]  # per epoch, averaged over the ranks; "val_" names the validation ones
    output_sizes: list[int]  # each output's values per row: the prediction columns' sizes
    collectives: str  # "horovod" or "torch.distributed"
    epochs_run: int  # this fit's epochs, not a resumed run's earlier ones
    device: str  # what rank 0 trained on ("cpu", "cuda:0", "gpu")
    training_seconds: float  # the epochs themselves, without the start and the result


class ShardRows:
    """The rank's shard as training and validation rows, and batches of them as numpy arrays."""

    def __init__(self, table, spec: FitSpec):
        import numpy as np

        self.table = table
        self.spec = spec
        if spec.validation:
            flags = table.column(VALIDATION_COLUMN).to_numpy(zero_copy_only=False).astype(bool)
            self.train, self.val = np.flatnonzero(~flags), np.flatnonzero(flags)
        else:
            self.train, self.val = np.arange(table.num_rows), np.arange(0)
        self.columns = [*spec.feature_cols, *spec.label_cols,
                        *([spec.sample_weight_col] if spec.sample_weight_col else [])]

    def batches(self, indices, batch_size: int, steps: int, rng=None) -> Iterator[dict[str, Any]]:
        """``steps`` batches of ``indices`` (reshuffled by ``rng`` when given), going round them as needed."""
        import numpy as np

        if steps and not len(indices):
            raise RuntimeError("this rank's shard holds no rows of this kind (training or validation): with a "
                               "validation column, make sure every partition has rows of both, or repartition")
        order = rng.permutation(indices) if rng is not None else indices
        wanted = steps * batch_size
        if wanted > len(order):  # round the rank's own rows again, reshuffled each round
            rounds = [order] + [rng.permutation(indices) if rng is not None else indices
                                for _ in range(math.ceil(wanted / len(order)) - 1)]
            order = np.concatenate(rounds)
        for step in range(steps):
            yield self._arrays(order[step * batch_size:(step + 1) * batch_size])

    def _arrays(self, rows) -> dict[str, Any]:
        batch = self.table.select(self.columns).take(rows)
        if self.spec.transformation_fn is not None:
            import pyarrow as pa

            frame = self.spec.transformation_fn(batch.to_pandas())
            batch = pa.Table.from_pandas(frame, preserve_index=False)
        return {name: column_array(batch.column(name), name) for name in self.columns}


def column_array(column, name: str):
    """A column of a batch as numpy: scalars as a vector, arrays (vectors, lists) as a matrix."""
    import pyarrow as pa

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type) or pa.types.is_fixed_size_list(array.type):
        lengths = array.value_lengths().to_numpy(zero_copy_only=False)
        if len(lengths) and (lengths != lengths[0]).any():
            raise ValueError(f"column {name!r} holds arrays of different lengths ({lengths.min()} to "
                             f"{lengths.max()}) in one batch: a model's input needs the same shape on every row")
        values = array.flatten().to_numpy(zero_copy_only=False)
        return values.reshape(len(array), -1) if len(array) else values.reshape(0, 0)
    return array.to_numpy(zero_copy_only=False)


def as_float32(values, shape: list[int] | None = None):
    """A batch's column as float32, as horovod.spark gives every column (a copy where the batch is a view of
    the memory-mapped shard, which is read-only), reshaped to ``shape`` (-1 for the batch) where given."""
    import numpy as np

    values = np.require(values, np.float32, ["C", "W"])
    return values.reshape(shape) if shape else values
