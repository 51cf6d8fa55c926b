"""The driver's side of a job: the one launcher core behind the magics, the Python API and local mode.

Runs in the notebook kernel (or any driver process). ``job`` runs one job,
``session`` keeps one job's ranks up across cells, ``spark`` and ``local`` are
their backends, ``layout`` places the ranks, ``rendezvous`` is horovod's Gloo
rendezvous and ``torch_store`` torch.distributed's, and ``mpi``/``mpi_rsh`` drive
``--controller mpi``. Modules here may import pyspark, torch and horovod's runner
(lazily: importing this package must work without them) and ``hvdmagic.task``,
whose code they ship to the tasks; never IPython or widgets.
"""

from __future__ import annotations

from collections.abc import Callable

from hvdmagic.errors import JobInterrupted, LaunchError
from hvdmagic.launch.elastic import Elastic, ElasticJob
from hvdmagic.launch.interrupts import interrupted_before_job, interruptible
from hvdmagic.launch.job import Job, JobResult, UnsentResult
from hvdmagic.protocol import Event, Framework, ResultPolicy, Stage

CONTROLLERS = ("gloo", "mpi")


def launch(payload: bytes, np: int, *, timeout: float | None = None, stall_timeout: float | None = None,
           env: dict[str, str] | None = None, on_event: Callable[[dict], None] | None = None,
           spark=None, data=None, controller: str = "gloo",
           results: ResultPolicy = ResultPolicy.ALL, framework: Framework = Framework.HOROVOD,
           gpus: bool = False, elastic: Elastic | None = None) -> JobResult:
    """Run a cloudpickled ``(fn, args, kwargs)`` on |np| ranks.

    np > 0: one Spark barrier stage (``spark``, the active SparkSession, or an embedded
    local one). np < 0: local mode, |np| processes on the driver without Spark.
    ``data``: a Spark DataFrame; each rank gets an equal-size shard (hvdmagic.shard()).
    ``controller``: "gloo" (the default) or "mpi" (Open MPI's mpirun, see launch.mpi).
    ``results``: which ranks send their value back (``ResultPolicy``).
    ``framework``: Horovod's rendezvous and environment, or torch.distributed's (``Framework``).
    ``gpus``: every rank must get a GPU (Spark's task resources, or the driver's in local
    mode); without GPUs the launch fails. Spark gives its tasks GPUs whenever it is
    configured to, with or without this.
    ``elastic``: Horovod elastic training between ``min_np`` and ``max_np`` ranks (``Elastic``).
    """
    preflight(np, framework, controller)
    options = dict(timeout=timeout, stall_timeout=stall_timeout, env=env, controller=controller, results=results,
                   framework=framework, on_event=on_event)
    if elastic is None:
        return Job(make_backend(np, on_event, spark=spark, data=data, gpus=gpus), payload, **options).run()
    elastic.check(np, framework, controller, data, stall_timeout)
    tasks = elastic.max_np if np > 0 else -elastic.max_np
    backend = make_backend(tasks, on_event, spark=spark, gpus=gpus, elastic_start=abs(np))
    return ElasticJob(backend, payload, elastic, np=abs(np), **options).run()


def preflight(np: int, framework: Framework, controller: str) -> None:
    """The checks that fail in one paragraph before anything starts."""
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


def make_backend(np: int, on_event: Callable[[dict], None] | None, *, spark=None, data=None, gpus: bool = False,
                 elastic_start: int | None = None):
    """The Spark backend (np > 0) or the local one (np < 0), ready to start tasks.

    Finding or starting the Spark session and checking its slots happen here, and an
    interrupt here ends in one line that says what it left behind.
    """
    notify = on_event or (lambda event: None)
    reached: list[Stage] = []

    def on_stage(stage: Stage) -> None:
        reached.append(stage)
        notify({"type": Event.STAGE, "stage": stage})

    with interruptible():
        try:
            if np < 0:
                from hvdmagic.launch.local import LocalBackend

                return LocalBackend(-np, data, gpus=gpus)
            from hvdmagic.launch.spark import SparkBackend

            backend = SparkBackend(np, spark, data, on_stage=on_stage, gpus=gpus, elastic_start=elastic_start)
            for note in backend.notes:
                notify({"type": Event.NOTE, "text": note})
            return backend
        except KeyboardInterrupt:
            raise JobInterrupted(interrupted_before_job(reached[-1] if reached else None)) from None


def _require(module: str, name: str, how: str) -> None:
    """A one-paragraph LaunchError when the kernel cannot import ``module``."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise LaunchError(f"{name} is not importable in this kernel's environment ({exc}). {how}.") from None


__all__ = ["Elastic", "Framework", "JobResult", "ResultPolicy", "UnsentResult", "launch"]
