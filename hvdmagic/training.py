"""Training helpers for code inside a rank: rank-0 checkpoints and learning-rate scaling.

They work the same on a single node (no Horovod initialised: rank 0 of 1), so a
notebook can test its training function before it goes distributed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from hvdmagic.report import emit

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)\.pt$")


def _horovod():
    """horovod.torch when it has been initialised in this process, else None."""
    try:
        import horovod.torch as hvd

        hvd.size()
        return hvd
    except (ImportError, ValueError):
        return None


def _rank_and_size() -> tuple[int, int]:
    hvd = _horovod()
    return (hvd.rank(), hvd.size()) if hvd else (0, 1)


def save_checkpoint(state: Any, directory: str | os.PathLike, step: int, keep: int = 3) -> Path | None:
    """Save ``state`` (e.g. model and optimizer state dicts) as step ``step``, on rank 0 only.

    The file is written beside its final name, then renamed, so a run killed
    mid-write never leaves a half checkpoint for the next run to load. Only the
    ``keep`` newest are kept. Returns the path on rank 0, None elsewhere.
    """
    import torch

    if _rank_and_size()[0] != 0:
        return None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"checkpoint-{step}.pt"
    partial = directory / f".checkpoint-{step}.pt.partial"
    torch.save({"step": step, "state": state}, partial)
    os.replace(partial, final)
    for old in sorted(_checkpoints(directory))[:-keep] if keep else []:
        (directory / f"checkpoint-{old}.pt").unlink(missing_ok=True)
    return final


def _checkpoints(directory: Path) -> list[int]:
    if not directory.is_dir():
        return []
    return [int(m.group(1)) for p in directory.iterdir() if (m := _CHECKPOINT.match(p.name))]


def load_checkpoint(directory: str | os.PathLike) -> tuple[Any, int | None]:
    """The newest checkpoint's ``(state, step)``, loaded by rank 0 and broadcast to every rank.

    ``(None, None)`` when there is none yet. Only rank 0 needs to see the
    directory, as with ``save_checkpoint``.
    """
    import torch

    hvd = _horovod()
    found = None
    if _rank_and_size()[0] == 0:
        steps = _checkpoints(Path(directory))
        if steps:
            found = torch.load(Path(directory) / f"checkpoint-{max(steps)}.pt", weights_only=False)
    if hvd is not None and hvd.size() > 1:
        found = hvd.broadcast_object(found, root_rank=0, name="hvdmagic.load_checkpoint")
    return (found["state"], found["step"]) if found else (None, None)


def scale_lr(base_lr: float, batch_size: int | None = None) -> float:
    """The linear scaling rule: ``base_lr`` times the number of ranks.

    With ``batch_size`` (per rank), the dashboard also notes the effective batch size.
    """
    rank, size = _rank_and_size()
    scaled = base_lr * size
    if rank == 0 and size > 1:
        effective = f"; effective batch size {batch_size * size} ({batch_size} per rank)" if batch_size else ""
        emit({"type": "note", "text": f"learning rate scaled {base_lr:g} -> {scaled:g} for {size} ranks{effective}"})
    return scaled
