"""The versions that decide whether a rank can run what the kernel ships: Python's and a few packages'.

Every task sends them in its hello, and the driver compares them with its own
(``launch.versions``) before any rank starts. Computed once per process: a Spark
Python worker runs many tasks.
"""

from __future__ import annotations

import functools
import os
import platform
import sys

# The distributions to compare, each under the names it is published as.
PACKAGES = {
    "cloudpickle": ("cloudpickle",),
    "torch": ("torch",),
    "tensorflow": ("tensorflow-cpu", "tensorflow"),
    "horovod": ("horovod",),
    "pyarrow": ("pyarrow",),
    "hvdmagic": ("hvdmagic",),
}


@functools.cache
def versions() -> dict[str, str | None]:
    """``{"python": "3.11.7", "cloudpickle": "3.1.3", ..., "tensorflow": None}`` (None: not installed).

    Read from the names of the ``*.dist-info`` folders on ``sys.path``, first entry first,
    as an import would find them: one directory listing per entry (about a millisecond),
    where ``importlib.metadata`` reads every distribution's metadata for each name (30 ms
    here, on the path of a cell's launch).
    """
    installed: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.endswith(".dist-info") and "-" in name:
                distribution, _, version = name[: -len(".dist-info")].partition("-")
                installed.setdefault(distribution.lower().replace("_", "-"), version)
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name, distributions in PACKAGES.items():
        found[name] = next((installed[d] for d in distributions if d in installed), None)
    return found
