"""A notebook cell as the ranks run it.

The cell runs on each rank like a notebook cell: its statements execute in a
fresh module namespace seeded with the captured globals, and the value of a
trailing expression is the result. (Wrapping the body in a ``def`` would make
``model = model.cuda()`` fail with UnboundLocalError for a notebook global.)
The kernel builds a ``CellFunction`` (``hvdmagic.kernel.capture``); cloudpickle
ships it by reference to this module, which every rank can import.
"""

from __future__ import annotations

import ast
import builtins
import linecache
from dataclasses import dataclass, field

CELL_FILENAME = "<horovod-cell>"


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


def split_last_expression(tree: ast.Module) -> tuple[ast.Module, ast.Expression | None]:
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        return ast.Module(tree.body[:-1], type_ignores=[]), last
    return tree, None


@dataclass
class CellFunction:
    source: str
    # Each global pickled on its own: its size is reported, and no value is pickled twice.
    pickled_globals: dict[str, bytes] = field(default_factory=dict)
    filename: str = CELL_FILENAME

    def __call__(self):
        import cloudpickle

        # Registered so that tracebacks show the cell's own lines (the kernel checked the syntax).
        lines = self.source.splitlines(keepends=True)
        linecache.cache[self.filename] = (len(self.source), None, lines, self.filename)
        body, last = split_last_expression(ast.parse(self.source, self.filename))
        namespace = {"__name__": "__main__", "__builtins__": builtins, "get_ipython": _RankShell}
        namespace.update({name: cloudpickle.loads(data) for name, data in self.pickled_globals.items()})
        exec(compile(body, self.filename, "exec"), namespace)
        if last is None:
            return None
        return eval(compile(last, self.filename, "eval"), namespace)
