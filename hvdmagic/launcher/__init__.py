"""The one launcher core behind the magic, the Python API and local mode."""

from __future__ import annotations

from typing import Callable

from hvdmagic.errors import LaunchError
from hvdmagic.launcher.job import Job, JobResult

CONTROLLERS = ("gloo", "mpi")


def launch(payload: bytes, np: int, *, timeout: float | None = None, stall_timeout: float | None = None,
           env: dict[str, str] | None = None, on_event: Callable[[dict], None] | None = None,
           session=None, data=None, controller: str = "gloo") -> JobResult:
    """Run a cloudpickled ``(fn, args, kwargs)`` on |np| Horovod ranks.

    np > 0: one Spark barrier stage (the active SparkSession, or an embedded local
    one). np < 0: local mode, |np| processes on the driver without Spark.
    ``data``: a Spark DataFrame; each rank gets an equal-size shard (hvdmagic.shard()).
    ``controller``: "gloo" (the default) or "mpi" (Open MPI's mpirun, see launcher.mpi).
    """
    if np == 0:
        raise LaunchError("np must be a positive number of Spark ranks, or negative for local mode.")
    try:
        import horovod.runner.http.http_server  # noqa: F401  (the driver hosts horovod's rendezvous)
    except ImportError as exc:
        raise LaunchError(
            f"horovod is not importable in this kernel's environment ({exc}). hvdmagic needs horovod "
            "built with PyTorch and Gloo: run the set-up command from the README (make demo), or see "
            "scripts/build_horovod.py."
        ) from None
    if controller not in CONTROLLERS:
        raise LaunchError(f"controller must be one of {', '.join(CONTROLLERS)}, not {controller!r}.")
    if controller == "mpi":
        from hvdmagic.launcher.mpi import check_available

        check_available()
    if np < 0:
        from hvdmagic.launcher.local import LocalBackend

        backend = LocalBackend(-np, data)
    else:
        from hvdmagic.launcher.spark import SparkBackend

        backend = SparkBackend(np, session, data)
    return Job(backend, payload, timeout=timeout, stall_timeout=stall_timeout, env=env, controller=controller,
               on_event=on_event).run()


__all__ = ["JobResult", "launch"]
