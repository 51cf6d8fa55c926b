"""The Python API: ``hvdmagic.run`` and a drop-in ``HorovodRunner``.

Both go through the same runner as the magic: one launcher core, the same
streaming, dashboard and error reporting.
"""

from __future__ import annotations

import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle

from hvdmagic.kernel.runner import execute
from hvdmagic.launch import ResultPolicy

_VERBOSITIES = ("all", "log_callback_only")


def run(fn: Callable, np: int, *args, timeout: float | None = None, stall_timeout: float | None = None,
        data=None, controller: str = "gloo", **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on |np| ranks and return every rank's result in rank order.

    The Python twin of a ``%%horovod`` cell: the same launcher, live dashboard and error
    reporting, and ``hvdmagic.last_run()`` holds the run's record afterwards.

    Args:
        fn: the function each rank calls. A function defined in the notebook, or in the
            user's own module beside it, is shipped by value with cloudpickle.
        np: the number of ranks. ``np > 0`` runs them as one Spark barrier stage (the active
            SparkSession, or an embedded local one); ``np < 0`` runs |np| processes on the
            driver without Spark (local mode). 0 is an error.
        *args: positional arguments for ``fn``; they must be picklable.
        timeout: seconds after which every rank is stopped and the run fails; None (the
            default) waits for as long as the ranks run.
        stall_timeout: fail as soon as a rank that has started reporting (output, progress,
            metrics) goes silent this many seconds, e.g. in a deadlocked collective; start-up
            is bounded by ``timeout`` only. None (the default) never checks.
        data: a Spark DataFrame; each rank gets an equal-size shard of it, read in the rank
            with ``hvdmagic.shard()``. None (the default) sends no data.
        controller: "gloo" (the default), or "mpi" to run the ranks under Open MPI's mpirun.
        **kwargs: keyword arguments for ``fn``; they must be picklable, and cannot be named
            ``timeout``, ``stall_timeout``, ``data`` or ``controller``.

    Returns:
        A list of |np| values: what ``fn`` returned on each rank, rank 0's first. Every
        rank's value must be picklable, or that rank fails with a TypeError.

    Raises:
        hvdmagic.errors.JobFailed: a rank raised or died; the error names it and shows its traceback.
        hvdmagic.errors.JobTimeout: (a JobFailed) ``timeout`` or ``stall_timeout`` ran out.
        hvdmagic.errors.JobInterrupted: the kernel was interrupted; every rank was stopped.
        hvdmagic.errors.LaunchError: the job could not start (np is 0, an unknown ``controller``,
            no Spark slots, no horovod, no Java).

    Example::

        import hvdmagic

        def train(lr, epochs=3):
            import horovod.torch as hvd
            hvd.init()
            ...
            return accuracy

        accuracies = hvdmagic.run(train, 2, 0.1, epochs=5, timeout=600)  # [rank 0's, rank 1's]
    """
    payload = _dumps((fn, args, kwargs), fn)
    return execute(payload, np, timeout=timeout, stall_timeout=stall_timeout, data=data,
                   controller=controller).results


def _is_users_own(module) -> bool:
    """A module from the user's files, not an installed package or the standard library."""
    path = getattr(module, "__file__", None)
    if not path or module.__name__ == "__main__":
        return False
    installed = {sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib", "platstdlib")}
    return not any(Path(path).resolve().is_relative_to(Path(root).resolve()) for root in installed)


def _dumps(obj, fn: Callable) -> bytes:
    """Pickle, shipping ``fn``'s module by value when it is the user's own file.

    cloudpickle pickles a function from an importable module by reference, and a
    rank (a fresh interpreter, maybe on another machine) cannot import the user's
    ``train.py`` from the notebook's folder.
    """
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    if module is None or not _is_users_own(module):
        return cloudpickle.dumps(obj)
    cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(obj)
    finally:
        cloudpickle.unregister_pickle_by_value(module)


class HorovodRunner:
    """Databricks' ``sparkdl.HorovodRunner``, as a drop-in: change only the import line.

    ``HorovodRunner(np=2).run(main, **kwargs)`` returns rank 0's value.

    Args:
        np: the number of ranks. ``np > 0`` runs them as one Spark barrier stage;
            ``np < 0`` runs |np| processes on the driver without Spark (local mode).
        driver_log_verbosity: accepted for compatibility. "all" (the default here) streams
            every rank's output, as hvdmagic always does; "log_callback_only" behaves the
            same, because hvdmagic's output is already labelled and capped per rank.

    Raises:
        ValueError: ``np`` is not a non-zero int, or ``driver_log_verbosity`` is neither value.

    Example::

        from hvdmagic import HorovodRunner  # instead of: from sparkdl import HorovodRunner

        hr = HorovodRunner(np=-2)  # two local processes on the driver, to try it out
        accuracy = hr.run(train, lr=0.1)
    """

    def __init__(self, np: int, driver_log_verbosity: str = "all"):
        if not isinstance(np, int) or isinstance(np, bool) or np == 0:
            raise ValueError(f"HorovodRunner needs a non-zero integer np, not {np!r}")
        if driver_log_verbosity not in _VERBOSITIES:
            raise ValueError(f"driver_log_verbosity must be one of {_VERBOSITIES}, not {driver_log_verbosity!r}")
        self.num_processor = np
        self.driver_log_verbosity = driver_log_verbosity

    def run(self, main: Callable, **kwargs: Any) -> Any:
        """Run ``main(**kwargs)`` on ``np`` ranks and return rank 0's value (the others' are not sent back).

        Args:
            main: the training function. A function defined in the notebook, or in the
                user's own module beside it, is shipped by value with cloudpickle.
            **kwargs: keyword arguments for ``main``; they must be picklable.

        Returns:
            What ``main`` returned on rank 0.

        Raises:
            hvdmagic.errors.JobFailed: a rank raised or died; the error names it and shows its traceback.
            hvdmagic.errors.LaunchError: the job could not start (no Spark slots, no horovod, no Java).

        Example::

            from hvdmagic import HorovodRunner

            def train(lr):
                import horovod.torch as hvd
                hvd.init()
                ...
                return accuracy

            accuracy = HorovodRunner(np=2).run(train, lr=0.1)
        """
        payload = _dumps((main, (), kwargs), main)
        return execute(payload, self.num_processor, results=ResultPolicy.RANK0).result
