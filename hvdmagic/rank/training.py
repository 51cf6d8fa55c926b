"""Training helpers for code inside a rank: rank-0 checkpoints and learning-rate scaling.

They work the same on a single node (no Horovod initialised: rank 0 of 1), so a
notebook can test its training function before it goes distributed.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hvdmagic import protocol
from hvdmagic.rank.telemetry import emit

if TYPE_CHECKING:
    from hvdmagic.file_urls import Folder

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)\.pt$")


def _horovod():
    """horovod.torch when the cell has imported and initialised it, else None."""
    hvd = sys.modules.get("horovod.torch")
    return hvd if hvd is not None and hvd.is_initialized() else None


def _torch_distributed():
    """torch.distributed when the cell has initialised a default process group (%%torchrun), else None."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _rank_and_size() -> tuple[int, int]:
    if hvd := _horovod():
        return hvd.rank(), hvd.size()
    if dist := _torch_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _broadcast_from_rank0(obj):
    """``obj`` as rank 0 has it, on every rank: over Horovod, else over torch.distributed."""
    if (hvd := _horovod()) and hvd.size() > 1:
        return hvd.broadcast_object(obj, root_rank=0, name="hvdmagic.load_checkpoint")
    if (dist := _torch_distributed()) and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def save_checkpoint(state: Any, directory: str | os.PathLike, step: int, keep: int = 3,
                    storage_options: dict | None = None) -> str | None:
    """Save ``state`` (e.g. model and optimizer state dicts) as step ``step``, on rank 0 only.

    The file is written beside its final name, then renamed, so a run killed
    mid-write never leaves a half checkpoint for the next run to load. Not a
    collective: the other ranks return at once, without waiting for rank 0. On one
    node (Horovod not initialised) this process is rank 0.

    Args:
        state: what to save; anything ``torch.save`` can pickle.
        directory: where ``checkpoint-STEP.pt`` goes; created if missing. On a cluster it
            need only be visible to rank 0's host (``load_checkpoint`` reads it there). A URL
            (``s3://bucket/ckpt``, ``gs://``, ``abfs://``...) goes through fsspec's driver for its
            scheme, which rank 0's host must have (s3fs, gcsfs, adlfs).
        storage_options: for a URL, the fsspec driver's options (``endpoint_url``, ``key``...);
            None reads the host's own credentials, as the driver does.
        step: the step (or epoch) this state is from; the highest is the newest.
        keep: how many of the newest checkpoints to keep (default 3); older ones are
            deleted. 0 keeps them all.

    Returns:
        The checkpoint's path (or URL) on rank 0; None on the other ranks.

    Example::

        %%horovod --np 2
        for epoch in range(start, epochs):
            train_one_epoch()
            hvdmagic.save_checkpoint({"model": model.state_dict(), "opt": opt.state_dict()},
                                     "/dbfs/ckpt/run1", step=epoch)
    """
    import torch

    from hvdmagic.file_urls import Folder  # on use: a rank imports only protocol and metric_rows at its start

    if _rank_and_size()[0] != 0:
        return None
    return write_checkpoint(Folder(directory, storage_options), f"checkpoint-{step}.pt", _CHECKPOINT, keep,
                            lambda path: torch.save({"step": step, "state": state}, path))


def write_checkpoint(folder: Folder, name: str, pattern: re.Pattern, keep: int, write: Callable[[Path], None]) -> str:
    """``write(path)`` the checkpoint ``name`` whole into ``folder`` (``Folder.write``: a run killed
    mid-write never leaves a half checkpoint for the next run to load); then keep the ``keep``
    newest checkpoints (``pattern``'s group 1 is a file's step; 0 keeps them all)."""
    final = folder.write(name, write)
    steps = checkpoint_steps(folder, pattern)
    for old in sorted(steps)[:-keep] if keep else []:
        folder.delete(steps[old])
    return final


def checkpoint_steps(folder: Folder, pattern: re.Pattern = _CHECKPOINT) -> dict[int, str]:
    """The checkpoints' names in ``folder`` by step (none if it does not exist)."""
    return {int(m.group(1)): name for name in folder.names() if (m := pattern.match(name))}


def load_checkpoint(directory: str | os.PathLike, storage_options: dict | None = None) -> tuple[Any, int | None]:
    """The newest checkpoint's ``(state, step)``, loaded by rank 0 and broadcast to every rank.

    Only rank 0 needs to see the directory, as with ``save_checkpoint``. With more than
    one rank this is a collective (Horovod's ``broadcast_object``, or torch.distributed's
    ``broadcast_object_list`` under ``%%torchrun``): every rank must call it.
    The file is unpickled in full (``weights_only=False``): load only your own checkpoints.

    Args:
        directory: the directory (or URL) ``save_checkpoint`` wrote to; it may not exist yet.
        storage_options: for a URL, as ``save_checkpoint``'s.

    Returns:
        ``(state, step)`` of the checkpoint with the highest step, on every rank;
        ``(None, None)`` when there is none yet.

    Example::

        %%horovod --np 2
        state, step = hvdmagic.load_checkpoint("/dbfs/ckpt/run1")
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        start = 0 if step is None else step + 1
    """
    import torch

    from hvdmagic.file_urls import Folder

    found = None
    if _rank_and_size()[0] == 0:
        folder = Folder(directory, storage_options)
        if steps := checkpoint_steps(folder):
            found = folder.read(steps[max(steps)], lambda path: torch.load(path, weights_only=False))
    found = _broadcast_from_rank0(found)
    return (found["state"], found["step"]) if found else (None, None)


def scale_lr(base_lr: float, batch_size: int | None = None) -> float:
    """The linear scaling rule: ``base_lr`` times the number of ranks.

    The number of ranks is ``horovod.torch``'s ``hvd.size()`` once ``hvd.init()`` has run
    in this process, or torch.distributed's world size once ``init_process_group`` has
    (``%%torchrun``), else 1 (so on one node it returns ``base_lr``). With more than one
    rank, rank 0 also notes the change in the dashboard, e.g. "learning rate scaled
    0.05 -> 0.1 for 2 ranks; effective batch size 64 (32 per rank)".

    Args:
        base_lr: the learning rate tuned for a single process.
        batch_size: the batch size per rank, only for the note; None (the default) leaves
            the effective batch size out.

    Returns:
        ``base_lr * hvd.size()``.

    Example::

        %%horovod --np 2
        import horovod.torch as hvd
        hvd.init()
        opt = torch.optim.SGD(model.parameters(), lr=hvdmagic.scale_lr(0.05, batch_size=32))
    """
    rank, size = _rank_and_size()
    scaled = base_lr * size
    if rank == 0 and size > 1:
        effective = f"; effective batch size {batch_size * size} ({batch_size} per rank)" if batch_size else ""
        text = f"learning rate scaled {base_lr:g} -> {scaled:g} for {size} ranks{effective}"
        emit(protocol.note(text))
    return scaled
