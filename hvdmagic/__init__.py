"""hvdmagic: distributed Horovod training from a notebook cell, launched through Spark.

``%load_ext hvdmagic`` registers the ``%%horovod`` cell magic.
"""

from __future__ import annotations

__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    from hvdmagic.magic import HorovodMagics

    ipython.register_magics(HorovodMagics)


def run(fn, np: int, *args, timeout: float | None = None, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on |np| ranks and return every rank's result in rank order."""
    import cloudpickle

    from hvdmagic.launcher import launch
    from hvdmagic.ui.text import TextOutput

    payload = cloudpickle.dumps((fn, args, kwargs))
    return launch(payload, np, timeout=timeout, on_event=TextOutput()).results
