"""Turn a cell into a picklable callable plus the notebook globals it reads.

The cell runs on each rank like a notebook cell: its statements execute in a
fresh module namespace seeded with the captured globals, and the value of a
trailing expression is the result. (Wrapping the body in a ``def`` would make
``model = model.cuda()`` fail with UnboundLocalError for a notebook global.)
Line numbers are kept, so a rank's traceback points at the cell's own lines.
"""

from __future__ import annotations

import ast
import builtins
import io
import linecache
import re
import socket
import traceback
from dataclasses import dataclass, field

import cloudpickle

from hvdmagic.errors import CaptureError, CellSyntaxError

CELL_FILENAME = "<horovod-cell>"
# IPython's own bookkeeping names (In, _i3, _42, ...), never worth shipping.
_IPYTHON_NAMES = re.compile(r"^(_+|_i+|_\d+|_i\d+|_ih|_oh|_dh|In|Out|get_ipython|exit|quit)$")


class _RankShell:
    """What ``get_ipython()`` answers on a rank: enough for ``!cmd`` lines in a cell."""

    def system(self, cmd: str) -> int:
        import subprocess

        return subprocess.call(cmd, shell=True)

    def getoutput(self, cmd: str, split: bool = True):
        import subprocess

        out = subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout
        return out.splitlines() if split else out

    def __getattr__(self, name):
        raise RuntimeError(f"get_ipython().{name} is not available inside a %%horovod rank: "
                           "only !shell commands are. Run IPython magics in a normal cell.")


@dataclass
class CellFunction:
    source: str
    # Each global pickled on its own: its size is reported, and no value is pickled twice.
    pickled_globals: dict[str, bytes] = field(default_factory=dict)
    filename: str = CELL_FILENAME

    def __call__(self):
        lines = self.source.splitlines(keepends=True)
        linecache.cache[self.filename] = (len(self.source), None, lines, self.filename)
        body, last = split_last_expression(parse_cell(self.source, self.filename))
        namespace = {"__name__": "__main__", "__builtins__": builtins, "get_ipython": _RankShell}
        namespace.update({name: cloudpickle.loads(data) for name, data in self.pickled_globals.items()})
        exec(compile(body, self.filename, "exec"), namespace)
        if last is None:
            return None
        return eval(compile(last, self.filename, "eval"), namespace)


def parse_cell(source: str, filename: str = CELL_FILENAME) -> ast.Module:
    try:
        return ast.parse(source, filename)
    except SyntaxError as exc:
        raise CellSyntaxError("".join(traceback.format_exception_only(type(exc), exc))) from None


def split_last_expression(tree: ast.Module) -> tuple[ast.Module, ast.Expression | None]:
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        return ast.Module(tree.body[:-1], type_ignores=[]), last
    return tree, None


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
