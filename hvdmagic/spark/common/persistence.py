"""``write().save(path)`` and ``load(path)`` for the estimators and models, also inside a saved PipelineModel.

A saved stage is a directory:

    metadata/part-00000   Spark ML's metadata line (class, uid, params as JSON): a PipelineModel's
                          reader finds the class there and calls its ``load``
    objects.pkl           the params that are Python objects (loss, metrics, callbacks...), cloudpickled
    <the framework's>     the weights in the framework's own format (``model.pt``, a state_dict;
                          ``model.keras``), written by the class's ``_save_weights``

A local path, a ``file://`` URL or a FUSE mount (``/dbfs/...``, ``/Volumes/...``) is written with plain
file I/O, the same on a classic and a Spark Connect session and with no session at all. Any other URL
(``hdfs://``, ``s3a://``, ``abfss://``, ``gs://``, ``dbfs:/``) goes where the session's Spark writes it:
the stage is written to a local temporary directory, then copied there through the classic session's
Hadoop file systems, as Spark ML's own stages are (``load`` copies it back first). Where Spark has no file
system for the scheme (a Spark Connect client lends none; a laptop's Spark has no ``s3://``), fsspec's
driver for it copies the stage instead (``file_urls.Tree``: s3fs, gcsfs, adlfs). The weights go through a
file on the driver's disk, never through its memory twice. A URL never becomes a local directory named after
its scheme; one that neither can write fails with the file system's own reason, in one paragraph. The
metadata keeps Spark ML's conventions: the params the user set in ``paramMap``, the defaults apart in
``defaultParamMap``, and the class, which ``load`` checks. The store and the backend are not saved
(horovod.spark's rule): a loaded model needs neither, nor a GPU.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pyspark.ml.util import MLReadable, MLReader, MLWritable, MLWriter

from hvdmagic import file_urls
from hvdmagic.errors import HvdmagicError

_NOT_SAVED = ("store", "backend")
_CLASS_KEY = "class"


class PathExists(HvdmagicError, FileExistsError):
    """A save over what is there, without overwrite(): Spark ML's own rule, in one paragraph."""


class StageIOError(HvdmagicError, OSError):
    """A stage that could not be saved or loaded where its path says: the file system's reason, or what to
    use instead, in one paragraph."""


class _HadoopFiles:
    """The classic session's Hadoop file system of one URL, through py4j: what Spark ML's writers use."""

    def __init__(self, url: str):
        from hvdmagic.launch import spark_connect
        from hvdmagic.launch.spark_session import users_session

        session = users_session()
        if session is None or spark_connect.is_connect(session):
            raise _NoHadoopFileSystem("a Spark Connect client has no Hadoop file systems" if session
                                      else "no SparkSession is active")
        jvm = session.sparkContext._jvm
        self.jvm, self.url = jvm, url
        self.path = jvm.org.apache.hadoop.fs.Path(url)
        self.fs = self._call(lambda: self.path.getFileSystem(session.sparkContext._jsc.hadoopConfiguration()))

    def _call(self, action):
        from py4j.protocol import Py4JJavaError

        try:
            return action()
        except Py4JJavaError as exc:
            reason = str(exc.java_exception.toString()) if exc.java_exception is not None else str(exc)
            if "UnsupportedFileSystemException" in reason:
                raise _NoHadoopFileSystem(f"Spark has none: {reason}") from None
            raise StageIOError(f"{self.url}: Spark's file system says {reason}") from None

    def exists(self) -> bool:
        return bool(self._call(lambda: self.fs.exists(self.path)))

    def delete(self) -> None:
        self._call(lambda: self.fs.delete(self.path, True))

    def upload(self, local: Path) -> None:
        self._call(lambda: self.fs.copyFromLocalFile(False, True, self.jvm.org.apache.hadoop.fs.Path(local.as_uri()),
                                                     self.path))

    def download(self, local: Path) -> None:
        self._call(lambda: self.fs.copyToLocalFile(False, self.path, self.jvm.org.apache.hadoop.fs.Path(
            local.as_uri()), True))


class _NoHadoopFileSystem(Exception):
    """No Hadoop file system for a URL here: fsspec's driver may copy the stage instead."""


class _FsspecFiles:
    """fsspec's driver for a URL's scheme, where Spark has no file system for it; its errors in one paragraph."""

    def __init__(self, url: str):
        self.tree = file_urls.Tree(url)

    def _call(self, action, *args):
        try:
            return action(*args)
        except OSError as exc:
            raise StageIOError(f"{self.tree.url}: {type(self.tree.fs).__name__} says {type(exc).__name__}: "
                               f"{exc}") from None

    def exists(self) -> bool:
        return self._call(self.tree.exists)

    def delete(self) -> None:
        self._call(self.tree.delete)

    def upload(self, local: Path) -> None:
        self._call(self.tree.upload, local)

    def download(self, local: Path) -> None:
        self._call(self.tree.download, local)


def _remote_files(url: str, scheme: str):
    """The session's Hadoop file system for ``url``, as Spark ML's own stages use; else fsspec's driver for its
    scheme; else one paragraph saying why neither."""
    try:
        return _HadoopFiles(url)
    except _NoHadoopFileSystem as no_hadoop:
        try:
            return _FsspecFiles(url)
        except file_urls.MissingDriver as no_driver:
            raise StageIOError(f"{url}: no file system here writes {scheme}:// (Spark: {no_hadoop}; fsspec: "
                               f"{no_driver.reason}); {no_driver.install} or add Spark's file system for it, or save "
                               "to a local path or a FUSE mount every host sees (/dbfs/..., /Volumes/...).") from None


@contextlib.contextmanager
def _staged(prefix: str) -> Iterator[Path]:
    """A local temporary directory for a stage on its way to or from a URL."""
    with tempfile.TemporaryDirectory(prefix=prefix) as folder:
        yield Path(folder) / "stage"


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


class StageWriter(MLWriter):
    def __init__(self, instance):
        super().__init__()
        self.instance = instance

    def save(self, path: str) -> None:
        """MLWriter's, without its overwrite through the JVM (no SparkContext on Connect, or at all): a local
        path is replaced here, a URL through its Hadoop file system."""
        scheme = file_urls.url_scheme(path)
        if scheme is None:
            self.saveImpl(str(file_urls.local_path(path)))
            return
        files = _remote_files(path, scheme)
        if files.exists():
            if not self.shouldOverwrite:
                raise PathExists(f"{path} exists already: write().overwrite().save(path) replaces it.")
            files.delete()
        with _staged("hvdmagic-save-") as local:
            self.saveImpl(str(local))
            files.upload(local)

    def saveImpl(self, path: str) -> None:
        import cloudpickle
        import pyspark

        root = Path(path)
        if root.exists():
            if not self.shouldOverwrite:
                raise PathExists(f"{path} exists already: write().overwrite().save(path) replaces it.")
            shutil.rmtree(root)
        root.mkdir(parents=True)
        stage = self.instance
        plain: dict[str, dict] = {"paramMap": {}, "defaultParamMap": {}}
        objects: dict[str, dict] = {"paramMap": {}, "defaultParamMap": {}}
        for kind, values in (("paramMap", stage._paramMap), ("defaultParamMap", stage._defaultParamMap)):
            for param, value in values.items():
                if param.name in _NOT_SAVED or param.name in stage.saved_by_framework:
                    continue
                (plain if _jsonable(value) else objects)[kind][param.name] = value
        metadata = {_CLASS_KEY: _class_name(type(stage)), "timestamp": int(time.time() * 1000),
                    "sparkVersion": pyspark.__version__, "uid": stage.uid, **plain,
                    "language": "Python", "hvdmagic": stage._extra_metadata()}
        (root / "metadata").mkdir()
        (root / "metadata" / "part-00000").write_text(json.dumps(metadata) + "\n")
        (root / "metadata" / "_SUCCESS").touch()
        (root / "objects.pkl").write_bytes(cloudpickle.dumps(objects))
        stage._save_weights(root)


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class StageReader(MLReader):
    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path: str):
        scheme = file_urls.url_scheme(path)
        if scheme is None:
            return self._load(str(file_urls.local_path(path)), path)
        files = _remote_files(path, scheme)
        with _staged("hvdmagic-load-") as local:
            files.download(local)
            return self._load(str(local), path)

    def _load(self, folder: str, path: str):
        import cloudpickle

        root = Path(folder)
        metadata = json.loads((root / "metadata" / "part-00000").read_text())
        saved, expected = metadata.get(_CLASS_KEY), _class_name(self.cls)
        if saved != expected:
            raise StageIOError(f"{path} holds a {saved}, not a {expected}: load it with that class's load(), or "
                               "with PipelineModel.load for a whole pipeline.")
        stage = self.cls._from_saved(root, metadata.get("hvdmagic", {}))
        stage._resetUid(metadata["uid"])
        objects = cloudpickle.loads((root / "objects.pkl").read_bytes())
        for kind, put in (("defaultParamMap", stage._setDefault), ("paramMap", stage._set)):
            values = {**metadata.get(kind, {}), **objects.get(kind, {})}
            put(**{name: value for name, value in values.items() if stage.hasParam(name)})
        return stage


class Persistent(MLWritable, MLReadable):
    """Mixed into the estimators and models: the writer and reader above, and the hooks they call."""

    saved_by_framework: tuple[str, ...] = ()  # params _save_weights writes in the framework's format

    def write(self) -> StageWriter:
        return StageWriter(self)

    @classmethod
    def read(cls) -> StageReader:
        return StageReader(cls)

    def _extra_metadata(self) -> dict:
        return {}

    def _save_weights(self, root: Path) -> None:
        pass

    @classmethod
    def _from_saved(cls, root: Path, extra: dict):
        return cls()

