"""What the drop-ins for Databricks notebooks' APIs run on a rank: ``@distributed``'s call, and
``DeepspeedTorchDistributor``'s start of a script (the kernel's ``kernel.serverless_gpu`` and ``kernel.api``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hvdmagic.rank.scripts import run_script


def distributed_call(fn: Callable, gpu_type: str | None, args: tuple, kwargs: dict) -> Any:
    """``@distributed``'s function on a rank; rank 0 first says in one line if its GPU is not the type asked for."""
    if gpu_type and os.environ.get("RANK") == "0":
        import torch

        if torch.cuda.is_available():
            found = torch.cuda.get_device_name(torch.cuda.current_device())
            if gpu_type.lower() not in found.lower():
                print(f"hvdmagic: gpu_type={gpu_type!r} was asked for; this run's GPUs are {found}.", flush=True)
    return fn(*args, **kwargs)


def run_deepspeed_script(path: str, args: list[str], config: dict | str | None) -> None:
    """Run a DeepSpeed script as pyspark's ``DeepspeedTorchDistributor`` starts it: its arguments, then
    ``--deepspeed`` and ``--deepspeed_config PATH``. A dict config is written to a JSON file on this rank's
    own host (the driver's temporary file would not be there on a cluster); None adds no config."""
    import json
    import tempfile

    written = None
    if isinstance(config, dict):
        descriptor, written = tempfile.mkstemp(prefix="deepspeed-config-", suffix=".json")
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            json.dump(config, file)
        config = written
    try:
        run_script(path, *args, "--deepspeed", *(["--deepspeed_config", config] if config else []))
    finally:
        if written is not None:
            os.unlink(written)
