"""Which framework a rank is importing, said while it lasts: its row reads "importing tensorflow".

TensorFlow's import takes seconds (about 7 on a small VM), torch's one or two, and a rank says
nothing meanwhile but TensorFlow's start-up notices. So the rank says when the import of one of
``FRAMEWORKS`` begins and when it ends (a stage message with ``importing``: the framework, then
""), and the kernel shows it on the rank's row and in the header while the rank has not trained
yet; the time counts in the rank's ``importing`` stage. ``rank.framework_bars``' import hook
runs ``importing`` around the framework's own import, so a cell that imports none pays nothing.

Only the outermost import is said: ``import keras`` imports TensorFlow (its backend) within, and
the user imported keras.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from hvdmagic import protocol
from hvdmagic.protocol import Stage
from hvdmagic.rank import telemetry

# The top-level modules whose import is worth a word: each takes seconds. tf_keras is Keras 2, which
# TensorFlow imports when the cell first touches tf.keras on the ranks (TF_USE_LEGACY_KERAS=1).
FRAMEWORKS = frozenset({"tensorflow", "keras", "tf_keras", "torch"})

_lock = threading.Lock()
_under_way: str | None = None  # the outermost framework import, while it runs


@contextmanager
def importing(name: str) -> Iterator[None]:
    """Say that this rank imports ``name`` while the block runs, unless another framework's import
    (the one that imports this one) already says so."""
    global _under_way
    with _lock:
        outermost = _under_way is None
        if outermost:
            _under_way = name
    if not outermost:
        yield
        return
    telemetry.emit(protocol.stage_reached(Stage.IMPORTING, importing=name))
    try:
        yield
    finally:
        with _lock:
            _under_way = None
        telemetry.emit(protocol.stage_reached(Stage.IMPORTING, importing=""))
