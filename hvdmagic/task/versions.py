"""The versions that decide whether a rank can run what the kernel ships: Python's and a few packages'.

Every task sends them in its hello, and the driver compares them with its own
(``launch.versions``) before any rank starts. Computed once per process: a Spark
Python worker runs many tasks.
"""

from __future__ import annotations

import functools
import platform
from importlib import metadata

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
    """``{"python": "3.11.7", "cloudpickle": "3.1.3", ..., "tensorflow": None}`` (None: not installed)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name, distributions in PACKAGES.items():
        found[name] = next((v for v in map(_version, distributions) if v is not None), None)
    return found


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
