"""Turn a cell into a picklable callable plus the notebook globals it reads.

The callable is a ``hvdmagic.rank.cell.CellFunction``, which says how a rank runs
the cell. Line numbers are kept, so a rank's traceback points at the cell's own lines.
"""

from __future__ import annotations

import ast
import io
import re
import socket
import traceback
from dataclasses import dataclass

import cloudpickle

from hvdmagic.errors import CaptureError, CellSyntaxError
from hvdmagic.rank.cell import CELL_FILENAME, CellFunction

# IPython's own bookkeeping names (In, _i3, _42, ...), never worth shipping.
_IPYTHON_NAMES = re.compile(r"^(_+|_i+|_\d+|_i\d+|_ih|_oh|_dh|In|Out|get_ipython|exit|quit)$")


def parse_cell(source: str, filename: str = CELL_FILENAME) -> ast.Module:
    try:
        return ast.parse(source, filename)
    except SyntaxError as exc:
        raise CellSyntaxError("".join(traceback.format_exception_only(type(exc), exc))) from None


def referenced_names(tree: ast.Module) -> set[str]:
    """Every name the cell reads, including inside functions and classes it defines."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Load, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            names.update(node.names)
    return names


def _type_name(value) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


@dataclass
class Capture:
    function: CellFunction
    payload: bytes
    types: dict[str, str]  # type name per captured global

    def summary(self) -> str:
        sizes = {name: len(data) for name, data in self.function.pickled_globals.items()}
        names = ", ".join(f"{name} ({self.types[name]}, {format_size(size)})"
                          for name, size in sorted(sizes.items(), key=lambda kv: -kv[1]))
        return (f"hvdmagic: captured {len(sizes)} global(s){': ' + names if names else ''}; "
                f"payload {format_size(len(self.payload))}")


def format_size(size: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def capture_cell(source: str, user_ns: dict, hidden: set[str] | frozenset[str] = frozenset()) -> Capture:
    """Build the payload for ``source`` (already transformed to plain Python)."""
    tree = parse_cell(source)
    wanted = sorted(
        name for name in referenced_names(tree)
        if name in user_ns and name not in hidden and not _IPYTHON_NAMES.match(name)
    )
    pickled: dict[str, bytes] = {}
    failures = []
    for name in wanted:
        value = user_ns[name]
        if isinstance(value, (io.IOBase, socket.socket)):
            # cloudpickle would ship a read-mode file's current contents, which is
            # never what a rank on another machine wants; refuse open handles outright.
            failures.append(f"'{name}' ({_type_name(value)}): an open file or socket belongs to this process")
            continue
        try:
            pickled[name] = cloudpickle.dumps(value)
        except Exception as exc:  # pickling raises almost anything: TypeError, PicklingError, ...
            failures.append(f"'{name}' ({_type_name(value)}): {exc}")
    if failures:
        raise CaptureError(
            f"the cell uses notebook variable(s) that cannot be sent to the ranks: {'; '.join(failures)}. "
            "Create such objects (locks, sockets, open files, Spark handles) inside the %%horovod cell instead."
        )
    function = CellFunction(source, pickled)
    types = {name: _type_name(user_ns[name]) for name in wanted}
    return Capture(function, cloudpickle.dumps((function, (), {})), types)
