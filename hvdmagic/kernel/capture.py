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
from hvdmagic.blob_transfer import format_size
from hvdmagic.errors import CaptureError, CellSyntaxError
from hvdmagic.kernel.framework_check import modules_imported
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


def names_read_before_assigned(tree: ast.Module) -> set[str]:
    """The names the cell may read from the notebook: what the capture ships.

    A name the cell surely assigns before any read of it never reads the notebook's value,
    so shipping that value would only cost time, or fail the cell (``lock = 'x'`` with a
    ``threading.Lock`` named ``lock`` in the notebook). The rule leans one way: when in
    doubt, a name is shipped. An extra name that pickles costs little; a name the cell reads
    but was not shipped is a NameError on the ranks.
    """
    flow = _CellFlow(reads=set(), assigned=set())
    flow.block(tree.body)
    return flow.reads


# Context managers that can swallow an exception and so skip the rest of their body.
_SWALLOWING = {"suppress", "raises", "assertRaises", "assertRaisesRegex"}


# Past this, the capture summary is broken between globals, not wherever a front end wraps it.
SUMMARY_WIDTH = 100

class _CellFlow(ast.NodeVisitor):
    """Walks the cell's top-level statements (or a class body) in the order they run.

    ``assigned``: the names surely bound at this point, on every path that gets here.
    ``reads``: the names read at some point where they were not surely bound (shared with
    the class bodies inside). Branches start from the same ``assigned`` and merge by
    intersection: a name assigned on one branch only is not sure after it.
    """

    def __init__(self, reads: set[str], assigned: set[str], module_names: set[str] | None = None):
        self.reads = reads
        self.assigned = assigned
        # In a class body: the module's sure names when the class statement ran. Functions and
        # comprehensions in a class body do not see the class's own names, only the module's.
        self.module_names = module_names

    @property
    def _enclosing(self) -> set[str]:
        """The sure names that a function or comprehension defined here looks up as globals."""
        return self.assigned if self.module_names is None else self.module_names

    def block(self, nodes) -> None:
        for node in nodes:
            self.visit(node)

    def _read(self, name: str) -> None:
        if name not in self.assigned:
            self.reads.add(name)

    def _branches(self, *branches) -> None:
        """Run each branch (a list of nodes) from the current state; keep what all of them assigned."""
        before, ends = self.assigned, []
        for branch in branches:
            self.assigned = set(before)
            self.block(branch)
            ends.append(self.assigned)
        self.assigned = set.intersection(*ends)

    def _nested_scope(self, node: ast.AST) -> None:
        """A function, lambda or comprehension: its global reads count unless already sure here.

        A function's body runs when it is called, maybe after a later top-level assignment;
        counting its reads now (against what is sure at the ``def``) errs towards shipping.
        """
        self.reads |= _global_reads(node) - self._enclosing

    # Names and assignments.

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self._read(node.id)
        elif isinstance(node.ctx, ast.Store):
            self.assigned.add(node.id)
        else:  # del x: x must exist (maybe the notebook's), and is unbound afterwards
            self._read(node.id)
            self.assigned.discard(node.id)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)  # the value runs before the targets: `x = x + 1` reads x
        self.block(node.targets)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.target, ast.Name):
            self._read(node.target.id)  # x += 1 reads x first
        self.visit(node.value)
        self.visit(node.target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        self.visit(node.annotation)  # evaluated at module and class level
        if node.value is not None or not isinstance(node.target, ast.Name):
            self.visit(node.target)  # `x: int` alone assigns nothing; `a.b: int` evaluates a

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self.visit(node.target)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.assigned.add(alias.asname or alias.name.split(".")[0])  # import a.b binds a

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.name != "*":  # import * binds names unknown here: it makes none of them sure
                self.assigned.add(alias.asname or alias.name)

    def visit_Global(self, node: ast.Global) -> None:
        for name in node.names:  # a no-op at module level; shipped all the same, as ever
            self._read(name)

    visit_Nonlocal = visit_Global

    # Control flow.

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        self._branches(node.body, node.orelse)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self.visit(node.test)
        self._branches([node.body], [node.orelse])

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        self.visit(node.values[0])
        self._branches(node.values[1:], [])  # `a and (b := f())`: short-circuits may skip the rest

    def visit_Assert(self, node: ast.Assert) -> None:
        self.visit(node.test)
        if node.msg is not None:
            self._branches([node.msg], [])  # evaluated only when the assertion fails

    def visit_For(self, node: ast.For) -> None:
        self.visit(node.iter)
        # The body may run zero times, so neither the target nor what the body assigns is sure
        # after the loop. One pass over the body from the state before it is enough: a read that
        # comes before the body's assignment of that name is a read on the first iteration.
        self._branches([node.target, *node.body], [])
        self._branches(node.orelse, [])  # skipped after a break

    visit_AsyncFor = visit_For

    def visit_While(self, node: ast.While) -> None:
        self.visit(node.test)
        self._branches(node.body, [])
        self._branches(node.orelse, [])

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            self.visit(item.context_expr)
            if item.optional_vars is not None:
                self.visit(item.optional_vars)  # with-as: bound before the body runs
        if any(_swallows(item.context_expr) for item in node.items):
            self._branches(node.body, [])
        else:
            self.block(node.body)

    visit_AsyncWith = visit_With

    def visit_Try(self, node: ast.Try) -> None:
        before = set(self.assigned)
        self.block(node.body)
        self.block(node.orelse)
        ends = [self.assigned]
        for handler in node.handlers:
            # The body may have failed at any point: a handler sees only what was sure before it.
            self.assigned = set(before)
            if handler.type is not None:
                self.visit(handler.type)
            if handler.name is not None:
                self.assigned.add(handler.name)
            self.block(handler.body)
            self.assigned.discard(handler.name)  # except E as e: Python deletes e after the handler
            ends.append(self.assigned)
        after = set.intersection(*ends)
        # finally also runs when an exception leaves the body or a handler at any point: it sees
        # only what was sure before the try. The code after the try runs only when nothing
        # escaped, so what the body or every handler assigned holds there too.
        self.assigned = before & after
        self.block(node.finalbody)
        self.assigned |= after

    visit_TryStar = visit_Try

    def visit_Match(self, node: ast.Match) -> None:
        self.visit(node.subject)
        cases = [[case.pattern, *([case.guard] if case.guard else []), *case.body] for case in node.cases]
        last = node.cases[-1]
        catch_all = isinstance(last.pattern, ast.MatchAs) and last.pattern.pattern is None and last.guard is None
        self._branches(*cases, *([] if catch_all else [[]]))  # unless `case _:` ends it, none may match

    def visit_MatchAs(self, node: ast.MatchAs) -> None:
        self.generic_visit(node)
        if node.name is not None:
            self.assigned.add(node.name)

    def visit_MatchStar(self, node: ast.MatchStar) -> None:
        if node.name is not None:
            self.assigned.add(node.name)

    def visit_MatchMapping(self, node: ast.MatchMapping) -> None:
        self.generic_visit(node)
        if node.rest is not None:
            self.assigned.add(node.rest)

    # Definitions and their own scopes.

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.block(node.decorator_list)
        self._arguments(node.args)
        if node.returns is not None:
            self.visit(node.returns)
        self._nested_scope(node)
        self.assigned.add(node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._arguments(node.args)
        self._nested_scope(node)

    def _arguments(self, args: ast.arguments) -> None:
        """What a def evaluates where it stands: defaults and annotations."""
        self.block(args.defaults)
        self.block(default for default in args.kw_defaults if default is not None)
        for arg in (*args.posonlyargs, *args.args, args.vararg, *args.kwonlyargs, args.kwarg):
            if arg is not None and arg.annotation is not None:
                self.visit(arg.annotation)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.block(node.decorator_list)
        self.block(node.bases)
        self.block(keyword.value for keyword in node.keywords)
        # The body runs now, in order, in the class's own namespace: it reads the module's sure
        # names and its own, and what it assigns stays in the class.
        module_names = set(self._enclosing)
        _CellFlow(self.reads, set(module_names), module_names).block(node.body)
        self.assigned.add(node.name)

    def _comprehension(self, node) -> None:
        self.visit(node.generators[0].iter)  # the first iterable is evaluated here, in this scope
        # The rest runs now, in the comprehension's own scope. A walrus in it binds here, but the
        # comprehension may not run it (no items): it makes nothing sure.
        self._nested_scope(node)

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension


def _swallows(context) -> bool:
    """``with suppress(...)``, ``with pytest.raises(...)``: the rest of the body may be skipped."""
    function = context.func if isinstance(context, ast.Call) else context
    name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
    return name in _SWALLOWING


class _ScopeNames(ast.NodeVisitor):
    """The names one function, lambda, comprehension or class scope binds, reads and declares.

    Inside a function Python does not go by order: a name bound anywhere in its body is local
    to all of it. So this pass just collects; ``_global_reads`` applies the rule.
    """

    def __init__(self):
        self.bound: set[str] = set()
        self.walrus: set[str] = set()  # in a comprehension, these bind in the enclosing function
        self.loads: set[str] = set()
        self.declared_global: set[str] = set()
        self.declared_nonlocal: set[str] = set()
        self.inner_free: set[str] = set()  # the free names of the scopes nested in this one
        self.inner_global: set[str] = set()  # names they declare global: global whatever this scope binds

    def visit_Name(self, node: ast.Name) -> None:
        (self.loads if isinstance(node.ctx, ast.Load) else self.bound).add(node.id)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.walrus.add(node.target.id)
        self.visit(node.value)

    def visit_alias(self, node: ast.alias) -> None:
        if node.name != "*":
            self.bound.add(node.asname or node.name.split(".")[0])

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name is not None:
            self.bound.add(node.name)
        self.generic_visit(node)

    def visit_MatchAs(self, node) -> None:
        if node.name is not None:
            self.bound.add(node.name)
        self.generic_visit(node)

    visit_MatchStar = visit_MatchAs

    def visit_MatchMapping(self, node: ast.MatchMapping) -> None:
        if node.rest is not None:
            self.bound.add(node.rest)
        self.generic_visit(node)

    def visit_Global(self, node: ast.Global) -> None:
        self.declared_global.update(node.names)

    def visit_Nonlocal(self, node: ast.Nonlocal) -> None:
        self.declared_nonlocal.update(node.names)

    def _inner(self, node, evaluated_here) -> None:
        for part in evaluated_here:
            if part is not None:
                self.visit(part)
        free, declared_global, walrus = _scope_names(node)
        self.inner_free |= free
        self.inner_global |= declared_global
        self.walrus |= walrus

    def visit_FunctionDef(self, node) -> None:
        self.bound.add(node.name)
        args = node.args
        annotations = [arg.annotation for arg in (*args.posonlyargs, *args.args, args.vararg,
                                                  *args.kwonlyargs, args.kwarg) if arg is not None]
        self._inner(node, [*node.decorator_list, *args.defaults, *args.kw_defaults, *annotations, node.returns])

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._inner(node, [*node.args.defaults, *node.args.kw_defaults])

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.bound.add(node.name)
        self._inner(node, [*node.decorator_list, *node.bases, *(keyword.value for keyword in node.keywords)])

    def _comprehension(self, node) -> None:
        self._inner(node, [node.generators[0].iter])

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _comprehension


def _scope_names(node) -> tuple[set[str], set[str], set[str]]:
    """For a function, lambda, comprehension or class: (its free names, the names it or a scope
    in it declares global, the walrus targets it binds in the scope around it)."""
    scope = _ScopeNames()
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        for index, generator in enumerate(node.generators):
            if index:  # the first iterable belongs to the enclosing scope
                scope.visit(generator.iter)
            scope.visit(generator.target)
            for condition in generator.ifs:
                scope.visit(condition)
        for part in (node.key, node.value) if isinstance(node, ast.DictComp) else (node.elt,):
            scope.visit(part)
        # Only the targets are the comprehension's own; a walrus binds in the enclosing scope.
        free = (scope.loads | scope.inner_free) - scope.bound
        return free, scope.inner_global, scope.walrus
    if isinstance(node, ast.ClassDef):
        for statement in node.body:
            scope.visit(statement)
        # A class body inside a function: it reads its own names once assigned, the enclosing
        # ones before. Which comes first is a question of order; every name it reads counts.
        free = (scope.loads | scope.inner_free) - scope.declared_nonlocal
        return free, scope.declared_global | scope.inner_global, set()
    args = node.args
    params = {arg.arg for arg in (*args.posonlyargs, *args.args, args.vararg, *args.kwonlyargs, args.kwarg)
              if arg is not None}
    for statement in node.body if isinstance(node.body, list) else [node.body]:
        scope.visit(statement)
    local = (params | scope.bound | scope.walrus) - scope.declared_global - scope.declared_nonlocal
    free = (scope.loads | scope.inner_free) - local - scope.declared_nonlocal
    return free, scope.declared_global | scope.inner_global, set()


def _global_reads(node) -> set[str]:
    """The module names a function, lambda, comprehension or class reads when it runs."""
    free, declared_global, _ = _scope_names(node)
    return free | declared_global


def _type_name(value) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


@dataclass
class Capture:
    function: CellFunction
    payload: Shipment
    types: dict[str, str]  # type name per captured global
    sizes: dict[str, int]  # bytes per captured global, its out-of-band buffers included

    def summary(self, width: int = SUMMARY_WIDTH) -> str:
        """One line, or, past ``width`` characters, one global per comma-ended line.

        Broken between globals by hvdmagic: a front end would break the long line anywhere,
        even inside a name (JupyterLab wraps output text at any character)."""
        items = [f"{name} ({self.types[name]}, {format_size(size)})"
                 for name, size in sorted(self.sizes.items(), key=lambda kv: -kv[1])]
        head = f"hvdmagic: captured {len(self.sizes)} global(s)"
        tail = f"payload {format_size(self.payload.size)}"
        line = f"{head}{': ' + ', '.join(items) if items else ''}; {tail}"
        if len(line) <= width:
            return line
        lines, current = [f"{head}:"], "  "
        for i, item in enumerate(items):
            item += "," if i < len(items) - 1 else f"; {tail}"
            if current.strip() and len(current) + 1 + len(item) > width:
                lines.append(current)
                current = "  "
            current += (" " if current.strip() else "") + item
        return "\n".join([*lines, current])



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
        name for name in names_read_before_assigned(tree)
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
    shell = running_shell() if shell is None else shell
    function = CellFunction(source, pickled, sources=notebook_sources([user_ns[name] for name in pickled], shell),
                            display_name=_current_cell_name(shell) or "", code=split_last_expression(tree),
                            global_buffers={name: digests for name, digests in global_buffers.items() if digests})
    types = {name: _type_name(user_ns[name]) for name in wanted}
    payload = shipment.pack((function, (), {}), label="the cell's captured globals", blobs=blobs, buffers=buffers,
                            imports=modules_imported(tree))
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


def running_shell():
    """The IPython shell this kernel runs, or None outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


# IPython 7 (Colab's) names a cell's file by its execution count, where it compiles it itself.
_IPYTHON7_INPUT = re.compile(r"^<ipython-input-(\d+)-[0-9a-f]+>$")


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
    if count is None and (ipython7 := _IPYTHON7_INPUT.match(filename)):  # IPython 7 keeps no map
        count = int(ipython7.group(1))
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
    if getattr(getattr(shell, "compile", None), "format_code_name", None) is None:
        # IPython 7 in ipykernel >= 6, whose compiler names a cell's file by a hash of its code alone: the
        # running cell is the execution count, which IPython 7 increments once the cell has run.
        count = getattr(shell, "execution_count", None)
        return f"Cell In[{count}]" if isinstance(count, int) else None
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
    return {filename: cell for filename in sorted(code_filenames(values))
            if (cell := notebook_cell(shell, filename)) is not None}


def notebook_cell(shell, filename: str) -> tuple[str, list[str]] | None:
    """("Cell In[3]", the cell's lines) for a file IPython compiled a notebook cell into; else None."""
    name = _cell_name(shell, filename)
    if name is None:
        return None
    entry = linecache.cache.get(filename)
    return name, list(entry[2]) if entry and len(entry) == 4 else linecache.getlines(filename)


def with_notebook_sources(fn: Callable, *values, shell=None) -> Callable:
    """``fn``, wrapped to bring the notebook cells it (and ``values``) comes from, for ``hvdmagic.run``.

    A rank's traceback then names a frame in such a cell ``Cell In[3], line 5`` with
    its source line. Returns ``fn`` itself when it holds no notebook code.
    """
    sources = notebook_sources([fn, *values], running_shell() if shell is None else shell)
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
