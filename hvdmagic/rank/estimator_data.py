"""A Spark ML estimator's fit, the rank's side of its data: what the kernel sends (``FitSpec``) and the
rank's shard read as batches, the same number of them on every rank.

The shard is the Arrow IPC file the rank's task wrote from its partition of the prepared DataFrame
(``hvdmagic.task.shards``), memory-mapped: a batch is taken from it row by row (``Table.take``) and
converted on its own, so a rank holds one batch at a time, not its shard, and a shard larger than
the rank's memory streams from the page cache. The limit is the executor's local disk, where the
shard lies.

Every rank runs the same number of steps an epoch: the most any rank's rows need, a rank with fewer
rows going round its own rows again, as horovod.spark's endless Petastorm reader does. No rank then
waits in an allreduce for another's extra batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

# Columns the kernel adds to the prepared DataFrame (hvdmagic.spark.common.estimator).
VALIDATION_COLUMN = "__hvdmagic_validation"  # true for a validation row


@dataclass
class FitSpec:
    """What one fit sends every rank: the estimator's params as plain values, and its objects."""

    framework: str  # "torch", "keras" or "lightning"
    collectives: str  # "horovod" or "torch" (torch.distributed)
    run_id: str  # the run's name in the store
    model: Any
    feature_cols: list[str]
    label_cols: list[str]
    input_shapes: list[list[int]] | None = None
    label_shapes: list[list[int]] | None = None
    sample_weight_col: str | None = None
    validation: bool = False  # VALIDATION_COLUMN marks the validation rows
    optimizer: Any = None
    loss: Any = None
    loss_constructors: list | None = None
    loss_weights: list[float] | None = None
    metrics: list | None = None
    custom_objects: dict | None = None
    gradient_compression: Any = None
    callbacks: list = field(default_factory=list)
    batch_size: int = 32
    val_batch_size: int | None = None
    epochs: int = 1
    train_steps_per_epoch: int | None = None
    validation_steps_per_epoch: int | None = None
    shuffle: bool = True
    random_seed: int | None = None
    verbose: int = 1
    backward_passes_per_step: int = 1
    transformation_fn: Callable | None = None
    train_minibatch_fn: Callable | None = None
    trainer_args: dict | None = None
    use_gpu: bool | None = None
    checkpoint_dir: str | None = None  # the store's checkpoint directory of this run_id
    notes: list[str] = field(default_factory=list)  # for the run's notes, said by rank 0


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

    def steps(self, most_rows: int, batch_size: int, asked: int | None) -> int:
        """Batches an epoch: ``asked`` (train_steps_per_epoch) or what the rank with ``most_rows`` needs."""
        return asked if asked else math.ceil(most_rows / batch_size)

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


def shaped(values, shape: list[int] | None):
    """``values`` reshaped to a column's ``input_shapes`` entry (-1 for the batch), or as it is."""
    return values.reshape(shape) if shape else values
