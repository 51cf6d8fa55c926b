"""The Python API: ``hvdmagic.run`` and a drop-in ``HorovodRunner``.

Both go through the same runner as the magic: one launcher core, the same
streaming, dashboard and error reporting.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path
from typing import Any, Callable

import cloudpickle

from hvdmagic.runner import execute

_VERBOSITIES = ("all", "log_callback_only")


def run(fn: Callable, np: int, *args, timeout: float | None = None, stall_timeout: float | None = None,
        data=None, controller: str = "gloo", **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on |np| ranks and return every rank's result in rank order.

    np > 0 runs a Spark barrier stage (the active SparkSession or an embedded local
    one); np < 0 runs |np| processes on the driver. ``data`` (a Spark DataFrame)
    gives each rank an equal-size shard, read in the rank with ``hvdmagic.shard()``.
    ``controller="mpi"`` runs the ranks under Open MPI's mpirun instead of Gloo.
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

    ``HorovodRunner(np=2).run(main, **kwargs)`` returns rank 0's value. ``np < 0``
    runs on the driver (local mode). ``driver_log_verbosity`` is accepted for
    compatibility: "all" (the default here) streams every rank's output, as
    hvdmagic always does; "log_callback_only" is accepted and behaves the same,
    because hvdmagic's output is already labelled and capped per rank.
    """

    def __init__(self, np: int, driver_log_verbosity: str = "all"):
        if not isinstance(np, int) or isinstance(np, bool) or np == 0:
            raise ValueError(f"HorovodRunner needs a non-zero integer np, not {np!r}")
        if driver_log_verbosity not in _VERBOSITIES:
            raise ValueError(f"driver_log_verbosity must be one of {_VERBOSITIES}, not {driver_log_verbosity!r}")
        self.num_processor = np
        self.driver_log_verbosity = driver_log_verbosity

    def run(self, main: Callable, **kwargs: Any) -> Any:
        return run(main, self.num_processor, **kwargs)[0]
