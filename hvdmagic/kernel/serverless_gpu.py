"""Databricks serverless GPU's ``@distributed``, as a drop-in: change only the import line.

Databricks' notebooks write::

    from serverless_gpu import distributed          # GPU environments up to 5
    from databricks.air import distributed          # 6 and later

    @distributed(gpus=8, gpu_type="A10", remote=True)      # or num_accelerators=8, accelerator_type=...
    def train(lr):
        dist.init_process_group("nccl")
        ...

    results = train.distributed(0.01)               # every GPU's value, in rank order

Here ``from hvdmagic import distributed`` runs the same function on hvdmagic's launcher, as a
``%%torchrun`` cell runs: torchrun's environment in every process, the live dashboard, errors that
name the rank, Stop. ``remote=True`` (or ``num_accelerators`` without ``remote``) runs one process
per GPU on the notebook's Spark (the session's, or the embedded one), one per task slot where Spark
schedules no GPUs; ``remote=False`` runs them as processes beside the kernel.
``hvdmagic.install_serverless_gpu()`` lets the unchanged imports work where Databricks' package
is not installed, and never where it is.

Runs in the notebook kernel.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import types
from collections.abc import Callable
from typing import Any

from hvdmagic.errors import LaunchError
from hvdmagic.kernel.api import pack_call
from hvdmagic.kernel.runner import execute
from hvdmagic.launch import Placement, ResultPolicy, Where
from hvdmagic.protocol import Framework
from hvdmagic.rank.databricks_apis import distributed_call


def distributed(gpus: int | None = None, gpu_type: str | None = None, remote: bool | None = None, *,
                num_accelerators: int | None = None, accelerator_type: str | None = None
                ) -> Callable[[Callable], DistributedFunction]:
    """The decorator: ``@distributed(gpus=2)``, ``@distributed(gpus=8, gpu_type="A10", remote=True)`` or
    ``@distributed(num_accelerators=8, accelerator_type="H100")``; then ``fn.distributed(*args, **kwargs)``
    returns every process's value, in rank order, and ``fn(*args)`` still calls the function here.

    Args:
        gpus, num_accelerators: how many processes (one GPU each where there are GPUs); one of the two.
        gpu_type, accelerator_type: the GPU type asked for ("A10", "H100"). hvdmagic runs on the GPUs it
            finds; a rank whose GPU is another type says so in one line, and so does a machine without GPUs.
        remote: True runs on the notebook's Spark; False (the default with ``gpus``) on this machine.
            With ``num_accelerators`` and no ``remote``, on Spark, as Databricks' newer signature does.
    """
    if (gpus is None) == (num_accelerators is None):
        raise TypeError("@distributed takes gpus= (with gpu_type= and remote=) or num_accelerators= (with "
                        "accelerator_type=), one of the two: how many processes to run")
    count = gpus if gpus is not None else num_accelerators
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"@distributed needs a positive number of GPUs, not {count!r}")
    if gpu_type is not None and accelerator_type is not None:
        raise TypeError("@distributed takes gpu_type= or accelerator_type=, not both")
    on_spark = bool(remote) if remote is not None else num_accelerators is not None

    def decorate(fn: Callable) -> DistributedFunction:
        return DistributedFunction(fn, count, on_spark, gpu_type or accelerator_type)

    return decorate


class DistributedFunction:
    """A function ``@distributed`` decorated: called as ever, or ``.distributed(...)`` on every process."""

    def __init__(self, fn: Callable, processes: int, on_spark: bool, gpu_type: str | None):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.processes = processes
        self.on_spark = on_spark
        self.gpu_type = gpu_type

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def distributed(self, *args: Any, **kwargs: Any) -> list:
        """Run the function on every process with torchrun's environment; every process's value, in rank order."""
        gpus = _spark_gives_gpus() if self.on_spark else _driver_has_gpus(self.processes)
        name = getattr(self.fn, "__name__", "the function")
        if not gpus and _asks_for_nccl(self.fn):
            raise LaunchError(
                f"{name} asks for NCCL (init_process_group(\"nccl\")), which needs a GPU in every process, and "
                f"{'the Spark tasks get' if self.on_spark else 'this machine has'} none: write \"gloo\", or "
                "\"nccl\" if torch.cuda.is_available() else \"gloo\", to run it on the CPU as well.")
        if not gpus:
            where = "Spark's tasks get no GPUs (spark.task.resource.gpu.amount)" if self.on_spark else \
                f"this machine has fewer than {self.processes} GPUs"
            print(f"hvdmagic: {where}: the {self.processes} processes run on the CPU.", flush=True)
        placement = Placement(self.processes, Where.SPARK if self.on_spark else Where.LOCAL, Framework.TORCH,
                              gpus=gpus)
        payload = pack_call((distributed_call, (self.fn, self.gpu_type, args, kwargs), {}), self.fn)
        record = execute(payload, placement, results=ResultPolicy.ALL, command=f"@distributed {name}")
        _log_to_mlflow(record, name)
        return list(record.results)


def _driver_has_gpus(processes: int) -> bool:
    from hvdmagic.launch.local import driver_devices

    return len(driver_devices()) >= processes


def _spark_gives_gpus() -> bool:
    """Whether the notebook's session gives its tasks GPUs; the embedded one hvdmagic starts gives none."""
    from hvdmagic.launch.spark_session import users_session

    session = users_session()
    if session is None:
        return False
    try:
        return bool(session.conf.get("spark.task.resource.gpu.amount", None))
    except Exception:  # a session on its way down: the launch says what is wrong with it
        return False


def _asks_for_nccl(fn: Callable) -> bool:
    """Whether ``fn``'s code names "nccl" and not "gloo": ``init_process_group("nccl")`` as written, which
    fails in every rank without GPUs. Code that names both chooses by itself, and is left to do so."""
    names: set[str] = set()
    pending = [getattr(fn, "__code__", None)]
    while pending:
        code = pending.pop()
        if code is None:
            continue
        for constant in code.co_consts:
            if isinstance(constant, str):
                names.add(constant.lower())
            elif isinstance(constant, types.CodeType):
                pending.append(constant)
    return "nccl" in names and "gloo" not in names


def _log_to_mlflow(record, name: str) -> None:
    """An MLflow run of the run's rank-0 metrics, as Databricks' creates one: where MLflow is installed and
    a tracking server is named (MLFLOW_TRACKING_URI, or a run already active), so that a laptop without
    one gets no ./mlruns folder it never asked for."""
    if importlib.util.find_spec("mlflow") is None:
        return
    import mlflow

    if not os.environ.get("MLFLOW_TRACKING_URI") and mlflow.active_run() is None:
        return
    from hvdmagic.kernel.mlflow_export import log_run

    log_run(record, run_name=name)


# -- the unchanged imports --------------------------------------------------------------------------------

SHIMMED = ("serverless_gpu", "databricks.air")


def install_serverless_gpu() -> list[str]:
    """Let ``from serverless_gpu import distributed`` and ``from databricks.air import distributed`` import
    hvdmagic's, where Databricks' own package is not installed; where it is, it is left alone. Returns the
    module names it provided. Opt-in, for a notebook written for Databricks that runs elsewhere unchanged."""
    provided = []
    for name in SHIMMED:
        if name in sys.modules or _installed(name):
            continue
        module = types.ModuleType(name, f"hvdmagic's stand-in for Databricks' {name} (hvdmagic.install_serverless_gpu)")
        module.distributed = distributed
        parent, _, child = name.rpartition(".")
        if parent:
            if parent not in sys.modules and not _installed(parent):
                sys.modules[parent] = types.ModuleType(parent)
            __import__(parent)
            setattr(sys.modules[parent], child, module)
        sys.modules[name] = module
        provided.append(name)
    return provided


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent package is not there either
        return False
