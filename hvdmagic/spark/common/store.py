"""``Store``: where a fit keeps its checkpoints, logs and the model it saves, as horovod.spark's Store does.

horovod.spark writes the training data into its store as Parquet before training; here the data
reaches the ranks as Arrow shards through the launcher, so a store holds only what a run leaves:

    <prefix>/runs/<run_id>/checkpoint/   rank 0's checkpoint after each epoch (``hvdmagic.save_checkpoint``)

A checkpoint is written beside its final name and then renamed, so a fit that failed or was
stopped mid-write leaves nothing half-written for the next fit to trip on; a new fit with the
same ``run_id`` resumes from the newest one. A path is local, or a FUSE
mount every host sees (``/dbfs/...`` on Databricks): rank 0 writes there, wherever Spark put it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from hvdmagic.errors import BadArgument

_REMOTE_SCHEMES = ("hdfs://", "s3://", "s3a://", "abfss://", "gs://", "dbfs:/", "wasbs://")


class Store:
    """A directory for runs: ``Store.create(path)``.

    Args (of ``create``):
        prefix_path: a local directory, or a FUSE mount every host sees (``/dbfs/...``); a
            ``file://`` URL is taken as its path. Remote file systems (``hdfs://``, ``s3://``,
            ``dbfs:/``...) are refused with the FUSE path to use instead.
    """

    def __init__(self, prefix_path: str | os.PathLike):
        self.prefix_path = str(prefix_path)

    @staticmethod
    def create(prefix_path: str | os.PathLike, *args, **kwargs) -> Store:
        text = str(prefix_path)
        if text.startswith("file://"):
            text = text[len("file://"):]
        if text.startswith(_REMOTE_SCHEMES):
            fuse = "/dbfs/" + text.split(":/", 1)[1].lstrip("/") if text.startswith("dbfs:/") else None
            instead = f" (here: {fuse})" if fuse else " (e.g. /dbfs/... on Databricks)"
            raise BadArgument(f"Store.create({str(prefix_path)!r}): hvdmagic's store is a local path or a FUSE mount "
                              f"that every host sees{instead}; it does not speak {text.split(':', 1)[0]}:// itself. "
                              "The training data never goes through the store: only checkpoints and logs do.")
        return Store(Path(text).expanduser().absolute())

    # -- horovod.spark's names --------------------------------------------------
    def get_run_path(self, run_id: str) -> str:
        return os.path.join(self.prefix_path, "runs", run_id)

    def get_checkpoint_path(self, run_id: str) -> str:
        return os.path.join(self.get_run_path(run_id), "checkpoint")

    def get_logs_path(self, run_id: str) -> str:
        return os.path.join(self.get_run_path(run_id), "logs")

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def __repr__(self) -> str:
        return f"Store({self.prefix_path!r})"


def new_run_id() -> str:
    return f"run_{uuid.uuid4().hex[:12]}"
