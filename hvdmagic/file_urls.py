"""Folders named by a local path or by a URL that fsspec opens (``s3://``, ``gs://``, ``abfs://``, ``hdfs://``...).

The one seam between this machine's file system and the others, for rank 0's checkpoints in a Store
and for a saved stage's files where Spark cannot write them. A URL is opened through fsspec's driver for
its scheme (s3fs for ``s3://``, gcsfs for ``gs://``, adlfs for ``abfs://``), with the credentials and
endpoint that driver reads from its host (instance roles, ``AWS_*`` variables...) or from the
``storage_options`` given. A file is written to a local temporary file first and then uploaded in one
piece: an object store makes an upload visible whole or not at all, so a writer killed mid-write leaves
nothing half-written, as a local rename does.
"""

from __future__ import annotations

import os
import posixpath
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

from hvdmagic.errors import HvdmagicError

T = TypeVar("T")

# The packages that bring fsspec's drivers, by scheme: fsspec's own hints name some of them only.
DRIVER_PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "abfs": "adlfs", "abfss": "adlfs",
                   "az": "adlfs", "hdfs": "pyarrow (with the host's libhdfs and Java)", "webhdfs": "requests"}


class MissingDriver(HvdmagicError, ImportError):
    """No fsspec driver for a URL's scheme here: the message names the package to install."""

    def __init__(self, url: str, reason: str, install: str):
        super().__init__(f"{url}: this Python has no file system for {url_scheme(url)}:// ({reason}); {install}, or "
                         "give a local path or a FUSE mount every host sees (/dbfs/..., /Volumes/...).")
        self.reason, self.install = reason, install


def url_scheme(location: str | os.PathLike) -> str | None:
    """The scheme of a URL that is not this machine's own file system (``hdfs``, ``s3a``, ``dbfs``); None for a
    local path or a ``file:`` URL."""
    scheme = urlparse(str(location)).scheme
    return scheme if len(scheme) > 1 and scheme != "file" else None  # one letter: a Windows drive


def local_path(location: str | os.PathLike) -> Path:
    """A local path, or a ``file:`` URL's path."""
    text = str(location)
    return Path(urlparse(text).path) if urlparse(text).scheme == "file" else Path(text)


def join(location: str, *names: str) -> str:
    """``location``/``names``, keeping a URL a URL (``os.path.join`` would do for a local path only on POSIX)."""
    return posixpath.join(location, *names) if url_scheme(location) else os.path.join(location, *names)


def filesystem(url: str, storage_options: dict[str, Any] | None = None):
    """fsspec's file system for ``url``'s scheme, or MissingDriver naming the package to install."""
    scheme = url_scheme(url)
    try:
        import fsspec

        cls = fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as exc:  # ValueError: a scheme fsspec does not know
        package = DRIVER_PACKAGES.get(scheme)
        install = f"install {package} on the driver and on every host" if package else (
            f"install the fsspec driver for {scheme}:// on the driver and on every host")
        raise MissingDriver(url, str(exc), install) from None
    return cls(**(storage_options or {}))


class Folder:
    """A directory that may not exist yet, on this machine or behind a URL: what a checkpoint writer needs."""

    def __init__(self, location: str | os.PathLike, storage_options: dict[str, Any] | None = None):
        self.location = str(location)
        self.remote = filesystem(self.location, storage_options) if url_scheme(self.location) else None
        self.path = None if self.remote else local_path(self.location)

    def names(self) -> list[str]:
        """The names of the files in the folder; none when it does not exist."""
        if self.remote is None:
            return [entry.name for entry in self.path.iterdir()] if self.path.is_dir() else []
        if not self.remote.exists(self.location):
            return []
        return [posixpath.basename(entry.rstrip("/")) for entry in self.remote.ls(self.location, detail=False)]

    def write(self, name: str, write: Callable[[Path], None]) -> str:
        """``write(path)`` the file ``name`` whole: beside its final name and renamed here, uploaded in one
        piece behind a URL. Returns its location."""
        if self.remote is None:
            self.path.mkdir(parents=True, exist_ok=True)
            partial = self.path / f".{name}.partial"
            write(partial)
            os.replace(partial, self.path / name)
            return str(self.path / name)
        target = join(self.location, name)
        with tempfile.TemporaryDirectory(prefix="hvdmagic-upload-") as folder:
            staged = Path(folder) / name
            write(staged)
            self.remote.put_file(str(staged), target)
        return target

    def read(self, name: str, read: Callable[[Path], T]) -> T:
        """``read(path)`` of the file ``name``: in place here, from a downloaded copy behind a URL."""
        if self.remote is None:
            return read(self.path / name)
        with tempfile.TemporaryDirectory(prefix="hvdmagic-download-") as folder:
            staged = Path(folder) / name
            self.remote.get_file(join(self.location, name), str(staged))
            return read(staged)

    def delete(self, name: str) -> None:
        if self.remote is None:
            (self.path / name).unlink(missing_ok=True)
        elif self.remote.exists(target := join(self.location, name)):
            self.remote.rm_file(target)


class Tree:
    """A whole directory behind a URL, copied to and from a local one: a saved stage through fsspec."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url, self.fs = url.rstrip("/"), filesystem(url, storage_options)

    def exists(self) -> bool:
        return bool(self.fs.exists(self.url))

    def delete(self) -> None:
        self.fs.rm(self.url, recursive=True)

    def upload(self, local: Path) -> None:
        for file in sorted(p for p in local.rglob("*") if p.is_file()):
            self.fs.put_file(str(file), join(self.url, *file.relative_to(local).parts))

    def download(self, local: Path) -> None:
        prefix = self.fs._strip_protocol(self.url).rstrip("/") + "/"
        found = self.fs.find(self.url)
        if not found:
            raise FileNotFoundError(f"{self.url}: no such directory")
        for remote in found:
            target = local.joinpath(*remote[len(prefix):].split("/"))
            target.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(remote, str(target))

