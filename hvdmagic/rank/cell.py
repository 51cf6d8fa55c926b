"""A notebook cell as the ranks run it.

The cell runs on each rank like a notebook cell: its statements execute in a
fresh module namespace seeded with the captured globals, and the value of a
trailing expression is the result. (Wrapping the body in a ``def`` would make
``model = model.cuda()`` fail with UnboundLocalError for a notebook global.)
The kernel builds a ``CellFunction`` (``hvdmagic.kernel.capture``); cloudpickle
ships it by reference to this module, which every rank can import.

Functions defined in other notebook cells are compiled from files that exist
only in the kernel's linecache (``/tmp/ipykernel_1234/567.py``). The kernel
ships those cells' lines with a display name (``Cell In[3]``); they are
registered here before the user's code runs, so that a rank's traceback shows
the frame as IPython would, with its source line.
"""

from __future__ import annotations

import ast
import builtins
import linecache
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CELL_FILENAME = "<horovod-cell>"


def session_filename(cell_id: int) -> str:
    """The file a session's ranks compile its ``cell_id``-th cell into: each its own, since the
    functions a cell defines live on in the ranks' namespace, and their frames name it later."""
    return f"<horovod-cell-{cell_id}>"

# filename -> how a rank's traceback names it ("Cell In[3]"); filled before the user's code runs.
DISPLAY_NAMES: dict[str, str] = {}

# filename -> (display name, source lines), as the kernel ships a notebook cell's source.
Sources = dict[str, tuple[str, list[str]]]


def register_sources(sources: Sources) -> None:
    """Make the notebook cells' lines and names known to this process's tracebacks."""
    for filename, (name, lines) in sources.items():
        if lines:
            # mtime None: linecache.checkcache never drops it for a file that is not on disk here.
            linecache.cache[filename] = (sum(map(len, lines)), None, list(lines), filename)
        if name:
            DISPLAY_NAMES[filename] = name


# A launcher's command line pasted into a cell (``!deepspeed train.py``) would start the launcher, and
# its processes, in every rank: the words that start one, and what each launcher is called.
_LAUNCHERS = {("deepspeed",): "deepspeed", ("torchrun",): "torchrun", ("accelerate", "launch"): "accelerate launch",
              ("horovodrun",): "horovodrun"}


def _launcher(words: list[str]) -> tuple[str, int]:
    """The launcher ``words`` start, and how many words name it; ("", 0) for any other command."""
    if words[:1] and words[0].startswith("python") and words[1:3] == ["-m", "torch.distributed.run"]:
        return "torch.distributed.run", 3
    for start, launcher in _LAUNCHERS.items():
        if tuple(words[:len(start)]) == start:
            return launcher, len(start)
    return "", 0


def _refuse_launcher(cmd: str) -> None:
    import shlex

    try:
        words = shlex.split(cmd)
    except ValueError:
        return  # the shell says what is wrong with it
    launcher, named = _launcher(words)
    if not launcher:
        return
    script = next((word for word in words[named:] if word.endswith(".py")), "the script")
    ranks = os.environ.get("WORLD_SIZE", "N")
    raise RuntimeError(
        f"!{cmd.strip()} would start {launcher}, and the processes it launches, in each of the cell's ranks. "
        f"The cell's ranks are the processes a launcher starts, with torch.distributed's environment set: put "
        f"{script}'s training code in the cell (deepspeed.initialize, Hugging Face's Trainer and Accelerator find "
        f"that environment), or run the script on the ranks from a normal cell with hvdmagic's drop-in: "
        f'TorchDistributor(num_processes={ranks}).run("{script}", ...).')


class _RankShell:
    """What ``get_ipython()`` answers on a rank: enough for ``!cmd`` lines in a cell."""

    def system(self, cmd: str) -> int:
        import subprocess

        _refuse_launcher(cmd)
        return subprocess.call(cmd, shell=True)

    def getoutput(self, cmd: str, split: bool = True):
        import subprocess

        _refuse_launcher(cmd)
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
    # The notebook cells that the captured functions were defined in (``Sources``), and the name
    # of this cell itself ("Cell In[7]"; "" keeps ``filename``). Read with getattr: a pickle made
    # before these fields existed has neither.
    sources: Sources = field(default_factory=dict)
    display_name: str = ""
    # The cell as the kernel parsed it (once, for the capture and its checks): its statements,
    # and the trailing expression whose value is the cell's result. None from an older kernel.
    code: tuple[ast.Module, ast.Expression | None] | None = None
    # By global: the blobs (digests) its pickle's out-of-band buffers are, in order; the
    # rank maps them from its host's cache (``rank.blobs``). Absent from an older kernel.
    global_buffers: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def __call__(self, namespace: dict | None = None, filename: str | None = None):
        """Run the cell in a fresh module namespace, or in ``namespace`` (a session rank's own,
        kept between cells): the notebook globals it reads are set there first, so they win
        over a rank variable of the same name. ``filename`` names the code: a session gives
        each cell its own, so functions defined in an earlier cell keep their source lines."""
        from hvdmagic.rank import blobs

        filename = filename or self.filename
        register_sources(getattr(self, "sources", None) or {})
        # Registered so that tracebacks show the cell's own lines (the kernel checked the syntax).
        lines = self.source.splitlines(keepends=True)
        register_sources({filename: (getattr(self, "display_name", ""), lines)})
        body, last = getattr(self, "code", None) or split_last_expression(ast.parse(self.source, filename))
        if namespace is None:
            namespace = {}
        namespace.setdefault("__name__", "__main__")
        namespace.setdefault("__builtins__", builtins)
        namespace.setdefault("get_ipython", _RankShell)
        buffers = getattr(self, "global_buffers", None) or {}
        namespace.update({name: blobs.load(data, buffers.get(name, ())) for name, data in self.pickled_globals.items()})
        exec(compile(body, filename, "exec"), namespace)
        if last is None:
            return None
        return eval(compile(last, filename, "eval"), namespace)


@dataclass
class SourcedFunction:
    """A plain function (``hvdmagic.run``) plus the notebook cells its code comes from.

    Built by ``hvdmagic.kernel.capture.with_notebook_sources``; calls ``fn`` after
    registering ``sources`` so that tracebacks name those cells as IPython does.
    """

    fn: Callable
    sources: Sources = field(default_factory=dict)

    def __call__(self, *args, **kwargs) -> Any:
        register_sources(self.sources)
        return self.fn(*args, **kwargs)
