"""``hvdmagic.callbacks.lightning`` for code that imports ``pytorch_lightning`` (the older package name).

A Trainer accepts only callbacks and strategies built on its own package's base
classes, so the classes here derive from ``pytorch_lightning``'s.
"""

from __future__ import annotations

from hvdmagic.callbacks._lightning import load

HorovodStrategy, HvdmagicCallback, HvdmagicLogger = load(
    "pytorch_lightning",
    "pip install pytorch-lightning (or use hvdmagic.callbacks.lightning with 'pip install lightning').",
)
__all__ = ["HorovodStrategy", "HvdmagicCallback", "HvdmagicLogger"]
