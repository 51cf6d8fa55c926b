"""A Python script as a rank runs it: what ``TorchDistributor.run("train.py", ...)`` ships."""

from __future__ import annotations

import runpy
import sys


def run_script(path: str, *args: str) -> None:
    """Run the script at ``path`` as ``__main__`` with ``args`` as its argv, as torchrun would start it."""
    saved = sys.argv
    sys.argv = [path, *args]
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        sys.argv = saved

