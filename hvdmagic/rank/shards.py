"""``hvdmagic.shard()``: this rank's shard of the cell's ``--data`` DataFrame.

The task that started the rank wrote the shard as an Arrow IPC file beside it
(``hvdmagic.task.shards``); every rank's shard has the same number of rows.
"""

from __future__ import annotations

import os

from hvdmagic.protocol import SHARD_ENV


def read_shard(path: str | os.PathLike):
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all()


def shard():
    """This rank's shard of the cell's ``--data`` DataFrame, as a pyarrow Table.

    Every rank's shard has the same number of rows: shorter shards repeat their own
    first rows, as torch's DistributedSampler pads, so no collective waits for a rank
    that ran out of data. Rows do not move between ranks: reshuffle per epoch yourself.

    Returns:
        A ``pyarrow.Table``; convert it with ``.to_pandas()`` or
        ``torch.from_numpy(table["x"].to_numpy())``.

    Raises:
        RuntimeError: the cell ran without ``--data`` (or ``hvdmagic.run(..., data=df)``).

    Example::

        %%horovod --np 2 --data train_df
        table = hvdmagic.shard()
        X = torch.tensor(table.select(["f0", "f1"]).to_pandas().to_numpy())
    """
    path = os.environ.get(SHARD_ENV)
    if path is None:
        raise RuntimeError("hvdmagic.shard() needs a DataFrame: run the cell with --data NAME "
                           "(or hvdmagic.run(..., data=df)).")
    return read_shard(path)
