"""``hvdmagic.callbacks.lightning`` for code that imports ``pytorch_lightning`` (the older package name).

A Trainer accepts only callbacks and strategies built on its own package's base
classes, so the classes here derive from ``pytorch_lightning``'s.
"""

from __future__ import annotations

try:
    import pytorch_lightning as _pl
except ImportError as exc:
    raise ImportError(
        "hvdmagic.callbacks.pytorch_lightning needs PyTorch Lightning 2.x, imported as pytorch_lightning, in the "
        "notebook's and every rank's environment: pip install pytorch-lightning (or use "
        "hvdmagic.callbacks.lightning with 'pip install lightning')."
    ) from exc

from hvdmagic.callbacks._lightning import define

globals().update(define(_pl))
__all__ = ["HorovodStrategy", "HvdmagicCallback", "HvdmagicLogger"]
