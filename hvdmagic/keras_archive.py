"""A Keras model that travels by pickle as a ``.keras`` archive, and comes back in the Keras it was built in.

Shared by the processes a ``KerasEstimator`` touches: the kernel wraps the model (``Archived``), and
a rank or an executor's Python worker gets the model back when it unpickles it. A notebook's model
may be Keras 3 (``tf.keras`` on TensorFlow 2.16 and later) or Keras 2 (``tf_keras``); the two
cannot read each other's models, so the archive names its package and is loaded by it, whatever
``TF_USE_LEGACY_KERAS`` says ``tf.keras`` is in that process. ``custom_objects`` (layers or losses
defined in the notebook) are unpickled first, by cloudpickle, and are in scope while the archive loads.
"""

from __future__ import annotations

import importlib
import os
import tempfile

KERAS_PACKAGES = ("keras", "tf_keras")  # Keras 3 (and the Keras 2 of TensorFlow <= 2.15); Keras 2 as tf_keras


def keras_package(obj):
    """The Keras package (``keras`` or ``tf_keras``) that made ``obj`` (a model, an optimizer), or None."""
    top = type(obj).__module__.split(".", 1)[0]
    return importlib.import_module(top) if top in KERAS_PACKAGES else None


class Archived:
    """``model`` for pickling: unpickled, it is the model again, loaded from its ``.keras`` archive."""

    def __init__(self, model, custom_objects: dict | None = None):
        self.model = model
        self.custom_objects = dict(custom_objects or {})

    def __reduce__(self):
        package = keras_package(self.model).__name__
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "model.keras")
            self.model.save(path)
            with open(path, "rb") as archive:
                data = archive.read()
        return load, (package, data, self.custom_objects)


def load(package: str, data: bytes, custom_objects: dict | None = None):
    """The model in archive ``data``, loaded by Keras package ``package``, uncompiled."""
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.keras")
        with open(path, "wb") as archive:
            archive.write(data)
        return load_file(package, path, custom_objects)


def load_file(package: str, path: str | os.PathLike, custom_objects: dict | None = None):
    keras = importlib.import_module(package)
    return keras.models.load_model(str(path), custom_objects=custom_objects or None, compile=False)
