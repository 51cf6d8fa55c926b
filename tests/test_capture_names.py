"""Which notebook names a %%horovod cell ships: only those it may read before it assigns them."""

from __future__ import annotations

import ast
import threading

import pytest
from conftest import run

import hvdmagic
from hvdmagic.errors import CaptureError
from hvdmagic.kernel.capture import capture_cell, names_read_before_assigned


def reads(source: str) -> set[str]:
    return names_read_before_assigned(ast.parse(source))


CASES = {
    # straight-line code at the top level
    "assigned before the read": ("x = 1\nx", set()),
    "read before the assignment": ("x\nx = 1", {"x"}),
    "the value runs before the target": ("x = x + 1", {"x"}),
    "the lock of issue 26": ("lock = 'x'\nlock", set()),
    "augmented assignment reads first": ("x += 1", {"x"}),
    "augmented after an assignment": ("x = 0\nx += 1\nx", set()),
    "annotation without a value assigns nothing": ("x: int\nx", {"x", "int"}),
    "annotation with a value": ("x: int = 1\nx", {"int"}),
    "tuple and star unpacking": ("a, (b, *c) = f()\na, b, c", {"f"}),
    "a swap reads both": ("a, b = b, a", {"a", "b"}),
    "attribute and item targets read their object": ("obj.attr = 1\nd[k] = v", {"obj", "d", "k", "v"}),
    "chained assignment": ("a = b = c\na, b", {"c"}),
    "walrus at the top level": ("(n := 5)\nn", set()),
    "walrus in an if test": ("if (n := len(xs)) > 0:\n    pass\nn", {"len", "xs"}),
    "walrus after a short-circuit": ("ok and (n := 1)\nn", {"ok", "n"}),
    "walrus in one arm of a conditional expression": ("y = (x := 1) if c else x", {"c", "x"}),
    "walrus in an assert message": ("assert ok, (m := 'why')\nm", {"ok", "m"}),
    # imports
    "import a.b binds a only": ("import a.b\na, b", {"b"}),
    "import as": ("import numpy as np\nnp.zeros(1)", set()),
    "from import as": ("from m import x as y\ny, x", {"x"}),
    "import star hides nothing": ("from m import *\nz", {"z"}),
    # conditionals
    "assigned on one branch": ("if c:\n    x = 1\nx", {"c", "x"}),
    "assigned on both branches": ("if c:\n    x = 1\nelse:\n    x = 2\nx", {"c"}),
    "assigned on two of three branches": ("if c:\n    x = 1\nelif d:\n    x = 2\nx", {"c", "d", "x"}),
    "read on a branch before it assigns": ("if c:\n    x = x + 1\nelse:\n    x = 0", {"c", "x"}),
    # loops
    "for target after a loop that may not run": ("for x in xs:\n    pass\nx", {"xs", "x"}),
    "for target inside the body": ("for x in xs:\n    x", {"xs"}),
    "the previous iteration's value": ("for x in xs:\n    use(prev)\n    prev = x", {"xs", "use", "prev"}),
    "assigned earlier in the same iteration": ("for x in xs:\n    prev = x\n    use(prev)", {"xs", "use"}),
    "the iterable runs before the target": ("for x in x:\n    pass", {"x"}),
    "while body may not run": ("while c:\n    y = 1\ny", {"c", "y"}),
    "loop else and break": ("while True:\n    total = 0\n    break\nelse:\n    done = 1\ndone, total",
                            {"done", "total"}),
    # del
    "del unbinds": ("x = 1\ndel x\nx", {"x"}),
    "del needs the name": ("del x", {"x"}),
    # global and nonlocal
    "global at the top level": ("global g\ng = 1", {"g"}),
    "function declaring a global it assigns": ("def f():\n    global g\n    g = 1", {"g"}),
    "global assigned after the def": ("def f():\n    global counter\n    counter += 1\ncounter = 0\nf()",
                                      {"counter"}),
    "global assigned before the def": ("counter = 0\ndef f():\n    global counter\n    counter += 1\nf()", set()),
    "nonlocal is the enclosing function's": (
        "def outer():\n    n = 0\n    def inner():\n        nonlocal n\n        n += 1\n    return inner", set()),
    "global inside a closure skips the enclosing local": (
        "def outer():\n    x = 1\n    def inner():\n        global x\n        return x\n    return inner", {"x"}),
    # functions and lambdas defined in the cell
    "function reads a name assigned later": ("def f():\n    return model\nmodel = 1\nf()", {"model"}),
    "function reads a name assigned before": ("model = 1\ndef f():\n    return model\nf()", set()),
    "function locals are never globals": ("def f():\n    model = build()\n    return model", {"build"}),
    "a name local anywhere in a function is local everywhere": ("def f():\n    print(x)\n    x = 1", {"print"}),
    "parameters, defaults, decorators, annotations": (
        "@deco\ndef f(a: T, *args, k=default, **kw) -> R:\n    local = a\n    return local, args, k, kw",
        {"deco", "T", "default", "R"}),
    "closure over the enclosing function": (
        "def outer():\n    k = 1\n    def inner():\n        return k, g\n    return inner", {"g"}),
    "function imports are its own": ("def f():\n    import torch\n    return torch", set()),
    "lambda reads a name assigned later": ("f = lambda v: v * scale\nscale = 2\nf(1)", {"scale"}),
    "lambda reads a name assigned before": ("scale = 2\nf = lambda v: v * scale\nf(1)", set()),
    "a function called later": ("def f():\n    pass\nf()", set()),
    # classes
    "class body runs now, in its own namespace; methods see the module": (
        "class A(Base):\n    size = 1\n    double = size * 2\n    def m(self):\n        return size\nA",
        {"Base", "size"}),
    "class body read": ("class A:\n    x = y", {"y"}),
    "class names stay in the class": ("class A:\n    z = 1\nz", {"z"}),
    "comprehension in a class body skips the class": (
        "class A:\n    n = 3\n    squares = [n * i for i in range(3)]", {"n", "range"}),
    "class in a function": ("def f():\n    class B(Base):\n        x = y\n    return B", {"Base", "y"}),
    # comprehensions
    "comprehension target is its own": ("[x for x in xs]\nx", {"xs", "x"}),
    "comprehension reads": ("[x * k for x in xs]", {"xs", "k"}),
    "comprehension over names assigned before": ("k = 2\nxs = [1]\n[x * k for x in xs]", set()),
    "nested comprehension targets": ("[y for x in xs for y in x]", {"xs"}),
    "the first iterable is the enclosing scope's": ("[x for x in x]", {"x"}),
    "dict comprehension": ("{k: v for k, v in items}", {"items"}),
    "generator reads a name assigned later": ("g = (v for v in vals if v > limit)\nlimit = 1", {"vals", "limit"}),
    "walrus in a comprehension may not run": ("[last := x for x in xs]\nlast", {"xs", "last"}),
    "walrus in a comprehension inside a function binds there": (
        "def f(xs):\n    [last := x for x in xs]\n    return last", set()),
    # with
    "with-as and the body": ("with open(p) as f:\n    data = f.read()\ndata, f", {"open", "p"}),
    "with reads its manager": ("with f:\n    pass", {"f"}),
    "suppress may skip the rest of its body": ("with suppress(E):\n    x = g()\nx", {"suppress", "E", "g", "x"}),
    "inside suppress the order holds": ("with suppress(E):\n    x = g()\n    x", {"suppress", "E", "g"}),
    # try
    "assigned in the body and every handler": (
        "try:\n    x = f()\nexcept E as e:\n    print(e)\n    x = None\nx", {"f", "E", "print"}),
    "a handler that does not assign": ("try:\n    x = f()\nexcept E:\n    pass\nx", {"f", "E", "x"}),
    "except-as is deleted after the handler": ("try:\n    x = f()\nexcept E as e:\n    x = 0\ne", {"f", "E", "e"}),
    "a handler sees only what was sure before the try": ("try:\n    x = f()\nexcept E:\n    x", {"f", "E", "x"}),
    "finally may run after a failure": ("try:\n    x = f()\nfinally:\n    print(x)\nx", {"f", "print", "x"}),
    "after try-finally both hold": ("try:\n    x = f()\nfinally:\n    y = 1\nx, y", {"f"}),
    "try else may not run": ("try:\n    pass\nexcept E:\n    pass\nelse:\n    z = 1\nz", {"E", "z"}),
    # match
    "match captures, guards, class patterns and a catch-all": (
        "match cmd:\n    case [action, obj]:\n        r = obj\n    case Point(x=px) if px > lim:\n        r = px\n"
        "    case _:\n        r = None\nr, action", {"cmd", "Point", "lim", "action"}),
    "match without a catch-all": (
        "match v:\n    case {'k': kv, **rest}:\n        out = rest\n"
        "    case [first, *others]:\n        out = others\nout",
        {"v", "out"}),
    "match value patterns read": ("match v:\n    case Color.RED:\n        pass", {"v", "Color"}),
}


@pytest.mark.unit
@pytest.mark.parametrize("source, expected", CASES.values(), ids=CASES.keys())
def test_names_read_before_assigned(source, expected):
    assert reads(source) == expected


@pytest.mark.unit
def test_capture_does_not_pickle_a_global_the_cell_assigns_first():
    user_ns = {"lock": threading.Lock(), "scale": 3}
    capture = capture_cell("lock = 'x'\nlock * scale\n", user_ns, shell=False)
    assert set(capture.function.pickled_globals) == {"scale"}
    assert capture.summary().startswith("hvdmagic: captured 1 global(s): scale (int, ")


@pytest.mark.unit
def test_a_long_capture_summary_breaks_between_globals_never_inside_one():
    user_ns = {f"feature_matrix_{i}": list(range(10 * i)) for i in range(1, 9)}
    capture = capture_cell(" + ".join(user_ns) + "\n", user_ns, shell=False)
    summary = capture.summary()
    lines = summary.splitlines()
    assert lines[0] == "hvdmagic: captured 8 global(s):", summary
    assert len(lines) > 2 and all(len(line) <= 100 and line.startswith("  ") for line in lines[1:]), summary
    assert all(line.endswith(",") for line in lines[1:-1]) and "; payload " in lines[-1], summary
    for name in user_ns:  # each global whole, on one line, with its type and size
        assert sum(f"{name} (list, " in line for line in lines) == 1, summary
    short = capture_cell("scale\n", {"scale": 3}, shell=False).summary()
    assert "\n" not in short and short.startswith("hvdmagic: captured 1 global(s): scale (int, ")


@pytest.mark.unit
def test_capture_still_pickles_a_global_assigned_on_one_branch_only():
    with pytest.raises(CaptureError, match=r"'lock' \(_thread.lock\)"):
        capture_cell("if flag:\n    lock = 'x'\nlock\n", {"lock": threading.Lock(), "flag": False}, shell=False)


def test_a_cell_that_assigns_a_notebook_lock_first_runs(ip):
    ip.run_cell("import threading\nlock = threading.Lock()")
    result, error = run(ip, "%%horovod --np -2\nlock = 'x'\nlock")
    assert error is None, error
    assert result == "x"
    assert "lock" not in hvdmagic.last_run().capture


def test_a_name_assigned_conditionally_is_shipped(ip):
    ip.run_cell("value = 41")
    result, error = run(ip, "%%horovod --np -2\nimport os\nif os.environ.get('HVDMAGIC_NEVER_SET_IN_TESTS'):\n"
                            "    value = 0\nvalue + 1")
    assert error is None, error
    assert result == 42
    assert "value (int, " in hvdmagic.last_run().capture


def test_the_summary_lists_only_what_the_cell_reads_from_the_notebook(ip, capfd):
    ip.run_cell("model = list(range(100_000))\nx_train = [0.0] * 1000\nscale = 3")
    capfd.readouterr()
    result, error = run(ip, "%%horovod --np -2\nmodel = [scale]\nx_train = model * 2\nlen(x_train)")
    assert error is None, error
    assert result == 2
    summary = hvdmagic.last_run().capture
    assert summary.startswith("hvdmagic: captured 1 global(s): scale (int, "), summary
    assert "model" not in summary and "x_train" not in summary
    assert summary in capfd.readouterr().out  # a fresh cell prints it
