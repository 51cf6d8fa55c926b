"""``write().save(path)`` and ``load(path)`` for the estimators and models, also inside a saved PipelineModel.

A saved stage is a directory:

    metadata/part-00000   Spark ML's metadata line (class, uid, params as JSON): a PipelineModel's
                          reader finds the class there and calls its ``load``
    objects.pkl           the params that are Python objects (loss, metrics, callbacks...), cloudpickled
    <the framework's>     the weights in the framework's own format (``model.pt``, a state_dict;
                          ``model.keras``), written by the class's ``_save_weights``

It is written with plain file I/O, so a path is local or a FUSE mount (``/dbfs/...``), as the
store's is, and the same on a classic and a Spark Connect session. The store and the backend are
not saved (horovod.spark's rule): a loaded model needs neither, nor a GPU.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from pyspark.ml.util import MLReadable, MLReader, MLWritable, MLWriter

from hvdmagic.errors import HvdmagicError

_NOT_SAVED = ("store", "backend")
_CLASS_KEY = "class"


class PathExists(HvdmagicError, FileExistsError):
    """A save over what is there, without overwrite(): Spark ML's own rule, in one paragraph."""


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
        """MLWriter's, without its overwrite through the JVM (no SparkContext on Connect, or at all):
        ``saveImpl`` replaces an existing directory itself."""
        self.saveImpl(path)

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
        plain, objects = {}, {}
        for param, value in stage.extractParamMap().items():
            if param.name in _NOT_SAVED or param.name in stage.saved_by_framework:
                continue
            (plain if _jsonable(value) else objects)[param.name] = value
        metadata = {_CLASS_KEY: f"{type(stage).__module__}.{type(stage).__qualname__}",
                    "timestamp": int(time.time() * 1000),
                    "sparkVersion": pyspark.__version__, "uid": stage.uid, "paramMap": plain, "defaultParamMap": {},
                    "language": "Python", "hvdmagic": stage._extra_metadata()}
        (root / "metadata").mkdir()
        (root / "metadata" / "part-00000").write_text(json.dumps(metadata) + "\n")
        (root / "metadata" / "_SUCCESS").touch()
        (root / "objects.pkl").write_bytes(cloudpickle.dumps(objects))
        stage._save_weights(root)


class StageReader(MLReader):
    def __init__(self, cls):
        super().__init__()
        self.cls = cls

    def load(self, path: str):
        import cloudpickle

        root = Path(path)
        text = (root / "metadata" / "part-00000").read_text()
        metadata = json.loads(text)
        stage = self.cls._from_saved(root, metadata.get("hvdmagic", {}))
        stage._resetUid(metadata["uid"])
        values = dict(metadata["paramMap"])
        values.update(cloudpickle.loads((root / "objects.pkl").read_bytes()))
        stage._set(**{name: value for name, value in values.items() if stage.hasParam(name)})
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

