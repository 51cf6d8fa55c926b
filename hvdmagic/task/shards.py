"""Data sharding for ``--data df``, the task's side: write and pad the rank's shard.

A shard is an Arrow IPC file next to the rank. In Spark
mode each barrier task receives one partition of ``df.repartition(np)`` through
``mapInArrow`` and writes it locally, so no shared file system is needed; in
local mode the driver splits the table round-robin. Sizes then differ by a few
rows at most; shorter shards are padded to the longest by repeating their own
first rows, like torch's DistributedSampler, so every rank runs the same number
of steps and no collective waits for a rank that ran out of data.

The rank reads it with ``hvdmagic.shard()`` (``hvdmagic.rank.shards``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from hvdmagic.rank.shards import read_shard


def write_shard(batches: Iterable, schema, path: Path) -> int:
    """Write record batches to an Arrow IPC file; return the row count."""
    import pyarrow as pa

    rows = 0
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for batch in batches:
            if batch.num_rows:
                writer.write_batch(batch)
                rows += batch.num_rows
    return rows


def pad_shard(path: Path, target: int) -> None:
    """Grow the shard at ``path`` to ``target`` rows by cycling its own rows."""
    import pyarrow as pa

    table = read_shard(path)
    if table.num_rows >= target:
        return
    if table.num_rows == 0:
        raise ValueError("cannot pad an empty shard: the DataFrame has fewer rows than ranks")
    indices = [i % table.num_rows for i in range(target - table.num_rows)]
    padded = pa.concat_tables([table, table.take(indices)])
    # A new file, then rename: ``table`` is memory-mapped from the old one.
    partial = path.with_name(path.name + ".partial")
    write_shard(padded.to_batches(), padded.schema, partial)
    os.replace(partial, path)
