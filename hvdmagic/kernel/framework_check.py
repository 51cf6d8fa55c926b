"""Before a cell starts: does this kernel's horovod have the framework the cell imports?

horovod records the frameworks it was built for, and their versions, in its
``metadata.json``; reading it, and the installed versions, costs no import of
TensorFlow or torch. A cell that needs what the build lacks fails here in one
paragraph that names the rebuild command, not in every rank with a linker error.
The executors' own horovod is checked by the ranks (``rank.outcome``).
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

from hvdmagic.errors import LaunchError
from hvdmagic.launch.versions import kernel_versions

REBUILD = ("rebuild it for the frameworks you use: python -m hvdmagic.build_horovod --frameworks "
           "pytorch,tensorflow (the README's set-up command does this; docs/frameworks.md)")
# horovod's module -> (its metadata.json key, the framework's name in task.versions)
_FRAMEWORKS = {
    "horovod.torch": ("pytorch", "torch"),
    "horovod.tensorflow": ("tensorflow", "tensorflow"),
    "horovod.keras": ("tensorflow", "tensorflow"),
}
MXNET = ("Apache retired MXNet in 2023 (it moved to the Apache Attic), and hvdmagic does not support it: "
         "port the model to PyTorch (%%horovod or %%torchrun) or TensorFlow/Keras (docs/frameworks.md).")


def modules_imported(tree: ast.Module) -> list[str]:
    """The modules the cell imports, in source order: what a host's rank template can import ahead
    (``launch.shipment`` keeps the frameworks among them). ``from horovod import torch`` names a module."""
    names: dict[str, None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(dict.fromkeys(alias.name for alias in node.names))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names[node.module] = None
            if node.module == "horovod":
                names.update(dict.fromkeys(f"horovod.{alias.name}" for alias in node.names))
    return list(names)


def check_cell(tree: ast.Module) -> None:
    """Raise a LaunchError when the cell (``capture.parse_cell``'s tree) imports a framework this
    kernel's horovod cannot run."""
    modules = modules_imported(tree)
    if any(m == "mxnet" or m.split(".")[:2] == ["horovod", "mxnet"] for m in modules):
        raise LaunchError(MXNET)
    needed = {key: package for prefix, (key, package) in _FRAMEWORKS.items()
              if any(m == prefix or m.startswith(prefix + ".") for m in modules)}
    if not needed:
        return
    built = _built_for()
    if built is None:
        return  # no horovod here: launch() says so
    for key, package in needed.items():
        name = "PyTorch" if key == "pytorch" else "TensorFlow"
        if key not in built:
            raise LaunchError(f"the cell imports horovod's {name} support, and this kernel's horovod was built "
                              f"without {name} (it has {', '.join(sorted(built)) or 'none'}): {REBUILD}.")
        installed = kernel_versions()[package]
        if installed and _release(installed) != _release(built[key]):
            raise LaunchError(f"this kernel's horovod was built against {name} {built[key]}, and {name} "
                              f"{installed} is installed: {REBUILD}.")


def _built_for() -> dict[str, str] | None:
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.origin:
        return None
    try:
        recorded = json.loads((Path(spec.origin).parent / "metadata.json").read_text())
    except (OSError, ValueError):
        return None
    return {key: value for key, value in recorded.items() if key != "dummy"}


def _release(version: str) -> str:
    """"2.13.0+cpu" -> "2.13.0": a local build tag does not change the ABI horovod linked against."""
    return version.split("+", 1)[0]
