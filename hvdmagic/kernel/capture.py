"""Turn a cell into a picklable callable plus the notebook globals it reads.

The callable is a ``hvdmagic.rank.cell.CellFunction``, which says how a rank runs
the cell. Line numbers are kept, so a rank's traceback points at the cell's own lines.
Functions from other notebook cells come with those cells' lines and names
(``Cell In[3]``), so a rank's traceback shows their frames as IPython would.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import itertools
import linecache
import re
import socket
import sys
import sysconfig
import traceback
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import cloudpickle

from hvdmagic import pickling
from hvdmagic.errors import CaptureError, CellSyntaxError
from hvdmagic.launch import shipment
from hvdmagic.launch.shipment import Shipment
from hvdmagic.protocol import Blob
from hvdmagic.rank.cell import CELL_FILENAME, CellFunction, SourcedFunction, Sources, split_last_expression

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
    payload: Shipment
    types: dict[str, str]  # type name per captured global
    sizes: dict[str, int]  # bytes per captured global, its out-of-band buffers included

    def summary(self) -> str:
        names = ", ".join(f"{name} ({self.types[name]}, {format_size(size)})"
                          for name, size in sorted(self.sizes.items(), key=lambda kv: -kv[1]))
        return (f"hvdmagic: captured {len(self.sizes)} global(s){': ' + names if names else ''}; "
                f"payload {format_size(self.payload.size)}")


def format_size(size: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def capture_cell(source: str, user_ns: dict, hidden: set[str] | frozenset[str] = frozenset(),
                 shell=None, tree: ast.Module | None = None) -> Capture:
    """Build the payload for ``source`` (already transformed to plain Python).

    ``shell`` (None: the running IPython shell, if any; False: none) names the
    notebook cells in the ranks' tracebacks; without one, frames keep their file names.
    ``tree``: ``parse_cell(source)``, when the caller has parsed it already; the ranks
    get it with the source, and parse nothing.
    """
    tree = tree or parse_cell(source)
    wanted = sorted(
        name for name in referenced_names(tree)
        if name in user_ns and name not in hidden and not _IPYTHON_NAMES.match(name)
    )
    pickled: dict[str, bytes] = {}
    global_buffers: dict[str, tuple[str, ...]] = {}
    blobs: dict[str, Blob] = {}
    buffers: dict[str, memoryview] = {}
    sizes: dict[str, int] = {}
    failures = []
    for name in wanted:
        value = user_ns[name]
        if isinstance(value, (io.IOBase, socket.socket)):
            # cloudpickle would ship a read-mode file's current contents, which is
            # never what a rank on another machine wants; refuse open handles outright.
            failures.append(f"'{name}' ({_type_name(value)}): an open file or socket belongs to this process")
            continue
        try:
            with users_module_by_value(value):
                pickled[name], views = pickling.dumps_out_of_band(value)
        except MemoryError:
            raise CaptureError(_too_large(name, value)) from None
        except Exception as exc:  # pickling raises almost anything: TypeError, PicklingError, ...
            failures.append(f"'{name}' ({_type_name(value)}): {exc}")
            continue
        global_buffers[name], named, by_digest = shipment.blobs_of(views, f"{name} ({_type_name(value)})")
        blobs.update(named)
        buffers.update(by_digest)
        sizes[name] = len(pickled[name]) + sum(view.nbytes for view in views)
    if failures:
        raise CaptureError(
            f"the cell uses notebook variable(s) that cannot be sent to the ranks: {'; '.join(failures)}. "
            "Create such objects (locks, sockets, open files, Spark handles) inside the %%horovod cell instead."
        )
    shell = _shell() if shell is None else shell
    function = CellFunction(source, pickled, sources=notebook_sources([user_ns[name] for name in pickled], shell),
                            display_name=_current_cell_name(shell) or "", code=split_last_expression(tree),
                            global_buffers={name: digests for name, digests in global_buffers.items() if digests})
    types = {name: _type_name(user_ns[name]) for name in wanted}
    payload = shipment.pack((function, (), {}), label="the cell's captured globals", blobs=blobs, buffers=buffers)
    return Capture(function, payload, types, sizes)


def _too_large(name: str, value) -> str:
    nbytes = getattr(value, "nbytes", None)
    size = f", {format_size(nbytes)}" if isinstance(nbytes, int) else ""
    return (f"the cell uses notebook variable '{name}' ({_type_name(value)}{size}), and this kernel ran out of "
            "memory pickling it for the ranks. Pass large data with --data (a Spark DataFrame, sharded "
            "across the ranks), or load it inside the %%horovod cell from a file every rank can read.")


# How many objects the search for notebook code looks at, at most, and how many items of one container:
# a global holding a million-element list must not make every cell slow to start.
_WALK_BUDGET = 20_000
_WALK_ITEMS = 1_000


def _shell():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _cell_name(shell, filename: str) -> str | None:
    """"Cell In[3]" for a file IPython compiled a cell into, as IPython's tracebacks name it; else None."""
    compiler = getattr(shell, "compile", None)
    format_code_name = getattr(compiler, "format_code_name", None)  # IPython >= 8
    if format_code_name is not None:
        try:
            label = format_code_name(filename)
        except Exception:
            return None
        return f"{label[0]} {label[1]}" if label else None
    count = getattr(compiler, "_filename_map", {}).get(filename)
    return None if count is None else f"Cell In[{count}]"


def _current_cell_name(shell) -> str | None:
    """The name of the notebook cell running now (the %%horovod cell), found on the call stack.

    ``shell.execution_count`` is not it: IPython 9 increments it before the cell runs, 8 after.
    The cell's top-level code runs in a ``<module>`` frame compiled from the cell's file.
    """
    if shell is None or shell is False:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and (name := _cell_name(shell, frame.f_code.co_filename)):
            return name
        frame = frame.f_back
    return None


def _code_names(code: types.CodeType) -> set[str]:
    """The global (and attribute) names a code object and the code nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def code_filenames(values: Iterable) -> set[str]:
    """The files that the code in ``values`` was compiled from.

    Pragmatic, not a full object-graph walk: functions (their nested code, closures,
    defaults and, for notebook functions, the globals they use, as cloudpickle
    ships them), methods, partials, classes defined in the notebook (their
    methods, properties, static and class methods), instances of such classes, and
    the items of lists, tuples, sets and dicts.
    """
    filenames: set[str] = set()
    seen: set[int] = set()
    stack = list(values)
    budget = _WALK_BUDGET
    while stack and budget > 0:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        budget -= 1
        if isinstance(value, types.CodeType):
            filenames.add(value.co_filename)
            stack.extend(const for const in value.co_consts if isinstance(const, types.CodeType))
        elif isinstance(value, types.FunctionType):
            stack.append(value.__code__)
            stack.extend(_closure_values(value))
            stack.extend(value.__defaults__ or ())
            stack.extend((value.__kwdefaults__ or {}).values())
            if hasattr(value, "__wrapped__"):
                stack.append(value.__wrapped__)
            if value.__module__ == "__main__":  # a library's functions are shipped by reference
                scope = value.__globals__
                stack.extend(scope[name] for name in _code_names(value.__code__) if name in scope)
        elif isinstance(value, (types.MethodType, staticmethod, classmethod)):
            stack.append(value.__func__)
        elif isinstance(value, property):
            stack.extend(part for part in (value.fget, value.fset, value.fdel) if part is not None)
        elif isinstance(value, functools.partial):
            stack.extend((value.func, *value.args, *value.keywords.values()))
        elif isinstance(value, type):
            for klass in value.__mro__:
                if klass.__module__ == "__main__":
                    stack.extend(vars(klass).values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(itertools.islice(value, _WALK_ITEMS))
        elif isinstance(value, dict):
            stack.extend(itertools.islice(value.values(), _WALK_ITEMS))
        elif type(value).__module__ == "__main__":
            stack.append(type(value))
            stack.extend(itertools.islice(getattr(value, "__dict__", {}).values(), _WALK_ITEMS))
    return filenames


def _closure_values(function: types.FunctionType) -> list:
    values = []
    for cell in function.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # a closure variable not assigned yet
            pass
    return values


def notebook_sources(values: Iterable, shell=None) -> Sources:
    """For the notebook cells that the code in ``values`` was defined in: their name and lines.

    Maps the file IPython compiled each cell into (``/tmp/ipykernel_1234/567.py``,
    ``<ipython-input-3-...>``) to (``"Cell In[3]"``, the cell's lines), from the
    kernel's linecache. Only the cells actually referenced are included.
    """
    if shell is None or shell is False:
        return {}
    sources: Sources = {}
    for filename in sorted(code_filenames(values)):
        name = _cell_name(shell, filename)
        if name is not None:
            entry = linecache.cache.get(filename)
            lines = list(entry[2]) if entry and len(entry) == 4 else linecache.getlines(filename)
            sources[filename] = (name, lines)
    return sources


def with_notebook_sources(fn: Callable, *values, shell=None) -> Callable:
    """``fn``, wrapped to bring the notebook cells it (and ``values``) comes from, for ``hvdmagic.run``.

    A rank's traceback then names a frame in such a cell ``Cell In[3], line 5`` with
    its source line. Returns ``fn`` itself when it holds no notebook code.
    """
    sources = notebook_sources([fn, *values], _shell() if shell is None else shell)
    return SourcedFunction(fn, sources) if sources else fn


def is_users_own(module) -> bool:
    """A module from the user's files, not an installed package or the standard library."""
    path = getattr(module, "__file__", None)
    if not path or module.__name__ == "__main__":
        return False
    installed = {sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib", "platstdlib")}
    return not any(Path(path).resolve().is_relative_to(Path(root).resolve()) for root in installed)


@contextlib.contextmanager
def users_module_by_value(owner):
    """While pickling: ship ``owner``'s module by value when it is the user's own file.

    cloudpickle pickles a function from an importable module by reference, and a rank
    (a fresh interpreter, maybe on another machine, in another folder) cannot import the
    user's ``train.py`` from the notebook's folder.
    """
    module = sys.modules.get(getattr(owner, "__module__", "") or "")
    if module is None or not is_users_own(module):
        yield
        return
    cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        cloudpickle.unregister_pickle_by_value(module)
