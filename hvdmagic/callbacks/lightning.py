"""PyTorch Lightning (``import lightning.pytorch``) in a ``%%horovod`` cell.

- ``HvdmagicCallback``: a progress bar per rank and every ``self.log`` metric in the dashboard.
- ``HorovodStrategy``: Lightning 2.x training on Horovod ranks (Lightning dropped its own).
- ``HvdmagicLogger``: the metrics half of the callback, usable on its own.

    trainer = Trainer(strategy=HorovodStrategy(), callbacks=[HvdmagicCallback()],
                      logger=False, enable_progress_bar=False, max_epochs=5)

For ``import pytorch_lightning`` use ``hvdmagic.callbacks.pytorch_lightning``.
"""

from __future__ import annotations

from hvdmagic.callbacks._lightning import load

HorovodStrategy, HvdmagicCallback, HvdmagicLogger = load(
    "lightning.pytorch",
    "pip install lightning (it keeps an installed torch that satisfies it; pin yours with -c, e.g. "
    "'torch==2.13.0'). With the older package name (import pytorch_lightning) use "
    "hvdmagic.callbacks.pytorch_lightning instead.",
)
__all__ = ["HorovodStrategy", "HvdmagicCallback", "HvdmagicLogger"]
