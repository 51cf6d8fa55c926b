"""The driver's side of a job: the one launcher core behind the magic, the Python API and local mode.

Runs in the notebook kernel (or any driver process). ``job`` runs one job,
``spark`` and ``local`` are its backends, ``layout`` places the ranks,
``rendezvous`` is horovod's Gloo rendezvous, and ``mpi``/``mpi_rsh`` drive
``--controller mpi``. Modules here may import pyspark and horovod's runner
(lazily: importing this package must work without horovod) and ``hvdmagic.task``,
whose code they ship to the tasks; never IPython or widgets.
"""

from __future__ import annotations

from collections.abc import Callable

from hvdmagic.errors import JobInterrupted, LaunchError
from hvdmagic.launch.interrupts import interrupted_before_job, interruptible
from hvdmagic.launch.job import Job, JobResult, UnsentResult
from hvdmagic.protocol import Event, Framework, ResultPolicy, Stage

CONTROLLERS = ("gloo", "mpi")


def launch(payload: bytes, np: int, *, timeout: float | None = None, stall_timeout: float | None = None,
           env: dict[str, str] | None = None, on_event: Callable[[dict], None] | None = None,
           session=None, data=None, controller: str = "gloo",
           results: ResultPolicy = ResultPolicy.ALL, framework: Framework = Framework.HOROVOD,
           gpus: bool = False) -> JobResult:
    """Run a cloudpickled ``(fn, args, kwargs)`` on |np| ranks.

    np > 0: one Spark barrier stage (the active SparkSession, or an embedded local
    one). np < 0: local mode, |np| processes on the driver without Spark.
    ``data``: a Spark DataFrame; each rank gets an equal-size shard (hvdmagic.shard()).
    ``controller``: "gloo" (the default) or "mpi" (Open MPI's mpirun, see launch.mpi).
    ``results``: which ranks send their value back (``ResultPolicy``).
    ``framework``: Horovod's rendezvous and environment, or torch.distributed's (``Framework``).
    ``gpus``: every rank must get a GPU (Spark's task resources, or the driver's in local
    mode); without GPUs the launch fails. Spark gives its tasks GPUs whenever it is
    configured to, with or without this.
    """
    notify = on_event or (lambda event: None)
    if np == 0:
        raise LaunchError("np must be a positive number of Spark ranks, or negative for local mode.")
    if framework == Framework.TORCH:
        if controller != "gloo":
            raise LaunchError(f"controller {controller!r} is for Horovod; torch.distributed ranks choose their "
                              "backend in init_process_group (gloo, nccl).")
        _require("torch.distributed", "torch", "pip install the project plus torch (e.g. 'pip install "
                 "torch==2.13.0'): %%torchrun needs no horovod")
    else:
        # The driver hosts horovod's rendezvous.
        _require("horovod.runner.http.http_server", "horovod",
                 "hvdmagic needs horovod built with PyTorch and Gloo: run the set-up command from the README "
                 "(make demo), or build it with 'python -m hvdmagic.build_horovod' (docs/frameworks.md); "
                 "%%torchrun needs no horovod")
    if controller not in CONTROLLERS:
        raise LaunchError(f"controller must be one of {', '.join(CONTROLLERS)}, not {controller!r}.")
    if controller == "mpi":
        from hvdmagic.launch.mpi import check_available

        check_available()
    reached: list[Stage] = []

    def on_stage(stage: Stage) -> None:
        reached.append(stage)
        notify({"type": Event.STAGE, "stage": stage})

    with interruptible():
        try:
            if np < 0:
                from hvdmagic.launch.local import LocalBackend

                backend = LocalBackend(-np, data, gpus=gpus)
            else:
                from hvdmagic.launch.spark import SparkBackend

                backend = SparkBackend(np, session, data, on_stage=on_stage, gpus=gpus)
                for note in backend.notes:
                    notify({"type": Event.NOTE, "text": note})
        except KeyboardInterrupt:
            raise JobInterrupted(interrupted_before_job(reached[-1] if reached else None)) from None
    return Job(backend, payload, timeout=timeout, stall_timeout=stall_timeout, env=env, controller=controller,
               results=results, framework=framework, on_event=on_event).run()


def _require(module: str, name: str, how: str) -> None:
    """A one-paragraph LaunchError when the kernel cannot import ``module``."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise LaunchError(f"{name} is not importable in this kernel's environment ({exc}). {how}.") from None


__all__ = ["Framework", "JobResult", "ResultPolicy", "UnsentResult", "launch"]
