"""``Store``: where a fit keeps its checkpoints, logs and the model it saves, as horovod.spark's Store does.

horovod.spark writes the training data into its store as Parquet before training; here the data
reaches the ranks as Arrow shards through the launcher, so a store holds only what a run leaves:

    <prefix>/runs/<run_id>/checkpoint/   rank 0's checkpoint after each epoch (``hvdmagic.save_checkpoint``)
    <prefix>/runs/<run_id>/logs/         a Lightning fit's logs

A checkpoint is written whole or not at all (``file_urls.Folder``), so a fit that failed or was stopped
mid-write leaves nothing half-written for the next fit to trip on; a new fit with the same ``run_id``
resumes from the newest one. The prefix is a local path, a FUSE mount every host sees (``/dbfs/...``,
``/Volumes/...``), or a URL that fsspec opens (``s3://``, ``gs://``, ``abfs://``, ``hdfs://``...) with
its driver installed on the hosts: rank 0 writes there, wherever Spark put it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from hvdmagic import file_urls
from hvdmagic.errors import BadArgument


class Store:
    """A directory for runs: ``Store.create(prefix_path)``.

    Args (of ``create``):
        prefix_path: a local directory, a FUSE mount every host sees (``/dbfs/...``), or a URL that fsspec
            opens (``s3://bucket/runs``, ``gs://``, ``abfs://``, ``hdfs://``), whose driver (s3fs, gcsfs,
            adlfs, pyarrow) the driver and every host have. ``file://`` is taken as its path, and
            ``dbfs:/x`` as ``/dbfs/x`` where that mount exists.
        storage_options: for a URL, the fsspec driver's options (``endpoint_url``, ``key``, ``secret``...),
            as horovod.spark's ``FilesystemStore`` takes them; None reads each host's own credentials.
    """

    def __init__(self, prefix_path: str | os.PathLike, storage_options: dict | None = None):
        self.prefix_path = str(prefix_path)
        self.storage_options = storage_options

    @staticmethod
    def create(prefix_path: str | os.PathLike, *args, storage_options: dict | None = None, **kwargs) -> Store:
        text = str(prefix_path)
        if text.startswith("dbfs:/"):
            text = _dbfs_mount(text)
        if file_urls.url_scheme(text) is None:
            return Store(file_urls.local_path(text).expanduser().absolute())
        try:
            file_urls.filesystem(text, storage_options)  # here, before any rank starts: the driver is installed
        except file_urls.MissingDriver as exc:
            raise BadArgument(f"Store.create: {exc}") from None
        return Store(text.rstrip("/"), storage_options)

    # -- horovod.spark's names --------------------------------------------------
    def get_run_path(self, run_id: str) -> str:
        return file_urls.join(self.prefix_path, "runs", run_id)

    def get_checkpoint_path(self, run_id: str) -> str:
        return file_urls.join(self.get_run_path(run_id), "checkpoint")

    def get_logs_path(self, run_id: str) -> str:
        return file_urls.join(self.get_run_path(run_id), "logs")

    def exists(self, path: str) -> bool:
        if file_urls.url_scheme(path) is None:
            return os.path.exists(path)
        return bool(file_urls.filesystem(path, self.storage_options).exists(path))

    def __repr__(self) -> str:
        return f"Store({self.prefix_path!r})"


def _dbfs_mount(url: str) -> str:
    """``dbfs:/x`` as ``/dbfs/x``, Databricks' FUSE mount of DBFS on every host; refused where it is absent."""
    fuse = "/dbfs/" + url.split(":/", 1)[1].lstrip("/")
    if not Path("/dbfs").is_dir():
        raise BadArgument(f"Store.create({url!r}): a dbfs:/ store is written through Databricks' /dbfs mount "
                          f"({fuse}), which this machine lacks; give a local path or a URL fsspec opens "
                          "(s3://..., abfs://...) instead.")
    return fuse


def new_run_id() -> str:
    return f"run_{uuid.uuid4().hex[:12]}"
