"""A rank's traceback names notebook cells as IPython does: ``Cell In[3], line 5`` plus the source line.

A function defined in another cell is compiled from a file that exists only in
the kernel's linecache (``/tmp/ipykernel_1234/567.py``, ``<ipython-input-3-...>``);
the kernel ships those cells' lines and names with the capture.
"""

from __future__ import annotations

import linecache
import os
import pickle
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest

from hvdmagic import pickling
from hvdmagic.errors import JobFailed
from hvdmagic.kernel.capture import capture_cell, code_filenames, notebook_sources, with_notebook_sources
from hvdmagic.rank import cell as rank_cell
from hvdmagic.rank.cell import CELL_FILENAME, CellFunction, SourcedFunction
from hvdmagic.rank.outcome import _name_cells, _user_traceback

BOOM_CELL = """\
x = 1

def boom(n):
    y = n * 2
    raise ValueError(f"boom {y}")
"""
BOOM_LINE = 5  # the raise


def cell(ip, source: str):
    """Run a cell as a notebook does, counting it (ip.run_cell alone gives every cell the same number)."""
    outcome = ip.run_cell(source, store_history=True)
    assert outcome.error_before_exec is None
    return outcome


def filename_of(ip, function: str) -> str:
    """The file IPython compiled the cell defining ``function`` into."""
    return ip.user_ns[function].__code__.co_filename


def next_line(lines: list[str], header: str) -> str:
    index = next(i for i, line in enumerate(lines) if line.strip().startswith(header))
    return lines[index + 1].strip()


@pytest.fixture
def clean_rank_state(monkeypatch):
    """What register_sources writes into this process (linecache, DISPLAY_NAMES) is undone after the test."""
    monkeypatch.setattr(rank_cell, "DISPLAY_NAMES", {})
    monkeypatch.setattr(linecache, "cache", dict(linecache.cache))


@pytest.mark.profile
def test_frame_in_another_cell_is_shown_as_that_cell(ip):
    defined = cell(ip, BOOM_CELL)
    run = ip.run_cell("%%horovod --np -2\nimport os\nboom(3)\n", store_history=True)
    assert run.execution_count == defined.execution_count + 1
    error = run.error_in_exec
    assert isinstance(error, JobFailed), error
    rendered = "\n".join(error._render_traceback_())
    lines = rendered.splitlines()

    header = f"Cell In[{defined.execution_count}], line {BOOM_LINE}, in boom"
    assert header in rendered, rendered
    assert next_line(lines, header) == 'raise ValueError(f"boom {y}")', rendered
    # The %%horovod cell itself, numbered as the notebook numbers it (line 1 is the %%horovod line).
    own = f"Cell In[{run.execution_count}], line 3, in <module>"
    assert own in rendered, rendered
    assert next_line(lines, own) == "boom(3)"
    for path in ("/tmp/ipykernel", "<ipython-input", CELL_FILENAME, 'File "'):
        assert path not in rendered, rendered
    assert "ValueError: boom 6" in rendered


@pytest.mark.unit
def test_only_the_referenced_cells_are_shipped_with_methods_and_their_helpers(ip):
    cell(ip, "def unrelated():\n    return 0\n")
    helper = cell(ip, "import os\ndef helper():\n    raise KeyError('k')\n")
    model = cell(ip, "class Model:\n    @property\n    def size(self):\n        return 1\n"
                     "    def forward(self):\n        return helper()\n")
    capture = capture_cell("Model().forward()\n", ip.user_ns)
    sources = capture.function.sources
    assert set(sources) == {filename_of(ip, "helper"), ip.user_ns["Model"].forward.__code__.co_filename}
    name, lines = sources[filename_of(ip, "helper")]
    assert name == f"Cell In[{helper.execution_count}]"
    assert lines[2] == "    raise KeyError('k')\n"  # line 3, as the function's code numbers it
    assert sources[ip.user_ns["Model"].forward.__code__.co_filename][0] == f"Cell In[{model.execution_count}]"


@pytest.mark.unit
def test_closures_partials_instances_and_containers_are_followed(ip):
    cell(ip, "def make():\n    def inner():\n        return 1\n    return inner\n")
    cell(ip, "import functools\nclosure = make()\npart = functools.partial(make)\n"
             "class Box:\n    pass\nbox = Box()\nbox.fn = closure\n")
    filename = filename_of(ip, "make")
    for value in ("closure", "part", "box", "[closure]", "{'k': (closure,)}"):
        found = code_filenames([ip.ev(value)])
        assert filename in found, value
    assert code_filenames([1, "text", [2.0] * 10]) == set()


@pytest.mark.unit
def test_the_cell_keeps_its_file_name_without_a_shell():
    capture = capture_cell("y = 1\n", {}, shell=False)
    assert capture.function.display_name == ""
    assert capture.function.sources == {}


@pytest.mark.profile
@pytest.mark.unit
def test_a_frame_in_a_shipped_cell_is_named_and_shows_its_source(clean_rank_state):
    filename = "/tmp/ipykernel_1234/567.py"  # exists only in "the kernel": nowhere on this machine
    source = "def f():\n    return g()\n\ndef g():\n    raise RuntimeError('deep')\n"
    scope: dict = {}
    exec(compile(source, filename, "exec"), scope)
    rank_cell.register_sources({filename: ("Cell In[12]", source.splitlines(keepends=True))})
    with pytest.raises(RuntimeError) as caught:
        scope["f"]()
    text = _user_traceback(caught.value)
    lines = text.splitlines()
    assert next_line(lines, "Cell In[12], line 2, in f") == "return g()", text
    assert next_line(lines, "Cell In[12], line 5, in g") == "raise RuntimeError('deep')", text
    assert filename not in text
    assert text.rstrip().endswith("RuntimeError: deep")


@pytest.mark.unit
def test_name_cells_rewrites_only_mapped_frame_headers():
    text = (
        "Traceback (most recent call last):\n"
        '  File "<horovod-cell>", line 3, in <module>\n'
        "    boom(3)\n"
        '  File "/tmp/ipykernel_1/2.py", line 5, in boom\n'
        "    raise ValueError('File \"x\", line 1')\n"
        '  File "/usr/lib/python3.11/json/__init__.py", line 346, in loads\n'
        "    return _default_decoder.decode(s)\n"
        '  |   File "/tmp/ipykernel_1/2.py", line 7, in grouped\n'
        '  File "<horovod-cell>", line 9\n'
        "ValueError: boom\n"
    )
    names = {CELL_FILENAME: "Cell In[4]", "/tmp/ipykernel_1/2.py": "Cell In[2]"}
    assert _name_cells(text, names) == (
        "Traceback (most recent call last):\n"
        "  Cell In[4], line 3, in <module>\n"
        "    boom(3)\n"
        "  Cell In[2], line 5, in boom\n"
        "    raise ValueError('File \"x\", line 1')\n"
        '  File "/usr/lib/python3.11/json/__init__.py", line 346, in loads\n'
        "    return _default_decoder.decode(s)\n"
        "  |   Cell In[2], line 7, in grouped\n"
        "  Cell In[4], line 9\n"
        "ValueError: boom\n"
    )
    assert _name_cells(text, {}) == text


@pytest.mark.unit
def test_a_cell_function_pickled_before_the_new_fields_still_runs(clean_rank_state):
    function = CellFunction("1 + 1\n", {})
    state = cloudpickle.dumps(function)
    old = pickle.loads(state)
    del old.__dict__["sources"], old.__dict__["display_name"]  # as unpickled from an older kernel
    assert old() == 2
    assert rank_cell.DISPLAY_NAMES == {}
    assert linecache.getline(CELL_FILENAME, 1) == "1 + 1\n"


@pytest.mark.unit
def test_a_cell_function_registers_its_name_and_sources(clean_rank_state):
    function = CellFunction("1 / 0\n", {}, sources={"<other>": ("Cell In[1]", ["a = 1\n"])},
                            display_name="Cell In[2]")
    with pytest.raises(ZeroDivisionError) as caught:
        pickle.loads(cloudpickle.dumps(function))()
    assert rank_cell.DISPLAY_NAMES == {"<other>": "Cell In[1]", CELL_FILENAME: "Cell In[2]"}
    assert linecache.getline("<other>", 1) == "a = 1\n"
    text = _user_traceback(caught.value)
    assert "  Cell In[2], line 1, in <module>\n    1 / 0\n" in text, text


@pytest.mark.unit
def test_hvdmagic_frames_between_the_users_are_left_out(clean_rank_state):
    """hvdmagic's wrappers inside the user's calls (collective_wait's around horovod's synchronize,
    ``track`` around a loader) are not the user's code: the user's frames on both sides stay."""
    import hvdmagic

    def loader():
        yield 1
        raise OSError("disk gone")

    def train():
        for _ in hvdmagic.track(loader()):
            pass

    with pytest.raises(OSError) as caught:
        train()
    text = _user_traceback(caught.value)
    assert "hvdmagic/" not in text, text
    assert "in train\n" in text and "in loader\n" in text, text


@pytest.mark.unit
def test_with_notebook_sources_wraps_notebook_functions_for_run(ip, clean_rank_state):
    defined = cell(ip, BOOM_CELL)
    wrapped = with_notebook_sources(ip.user_ns["boom"], shell=ip)
    assert isinstance(wrapped, SourcedFunction)
    assert list(wrapped.sources) == [filename_of(ip, "boom")]
    assert with_notebook_sources(len, shell=ip) is len
    assert notebook_sources([ip.user_ns["boom"]], None) == {}

    filename = filename_of(ip, "boom")
    rank_side = pickle.loads(pickling.dumps(wrapped))
    linecache.cache.pop(filename)  # a rank's process has never seen the kernel's cells
    with pytest.raises(ValueError) as caught:
        rank_side(3)
    text = _user_traceback(caught.value)
    header = f"Cell In[{defined.execution_count}], line {BOOM_LINE}, in boom"
    assert next_line(text.splitlines(), header) == 'raise ValueError(f"boom {y}")', text


@pytest.mark.profile
@pytest.mark.unit
def test_shipped_code_keeps_its_file_name_whatever_cloudpickle_writes(ip):
    """cloudpickle >= 3.1.3 writes ``<dynamic-code>`` for the file of every code object it ships by value."""
    cell(ip, "class Net:\n    def forward(self):\n        def inner():\n            return 1\n        return inner\n"
             "def make():\n    return lambda: 2\n")
    filename = filename_of(ip, "make")
    net, make = pickle.loads(pickling.dumps((ip.user_ns["Net"], ip.user_ns["make"])))
    forward = net.forward.__code__
    nested = next(const for const in forward.co_consts if isinstance(const, type(forward)))
    for code in (forward, nested, make.__code__, make().__code__):
        assert code.co_filename == filename, code
    assert net().forward()() == 1 and make()() == 2


# The oldest cloudpickle pyproject.toml allows, put first on the path by scripts/setup.sh.
OLDEST_CLOUDPICKLE = Path(sys.prefix) / "oldest-cloudpickle"


def test_tracebacks_name_cells_under_the_oldest_cloudpickle_too():
    """The end-to-end traceback test again, in a fresh interpreter (and its ranks) importing the oldest cloudpickle."""
    version = next(OLDEST_CLOUDPICKLE.glob("cloudpickle-*.dist-info"), None)
    assert version is not None, f"no cloudpickle in {OLDEST_CLOUDPICKLE}: run `make setup` (scripts/setup.sh)"
    expected = version.name.removeprefix("cloudpickle-").removesuffix(".dist-info")
    assert expected != cloudpickle.__version__, "the oldest cloudpickle is the locked one: nothing to compare"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(OLDEST_CLOUDPICKLE),
                                                                      os.environ.get("PYTHONPATH")])),
           "HVDMAGIC_EXPECT_CLOUDPICKLE": expected, "HVDMAGIC_FAIL_ON_SKIP": ""}
    tests = [test_runs_under_the_expected_cloudpickle,
             test_shipped_code_keeps_its_file_name_whatever_cloudpickle_writes,
             test_frame_in_another_cell_is_shown_as_that_cell]
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           *(f"{__file__}::{test.__name__}" for test in tests)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and f"{len(tests)} passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


def test_runs_under_the_expected_cloudpickle(ip):
    """Under the oldest-cloudpickle run above, the kernel and its ranks both import that version."""
    expected = os.environ.get("HVDMAGIC_EXPECT_CLOUDPICKLE", cloudpickle.__version__)
    assert cloudpickle.__version__ == expected
    ranks = ip.run_cell("%%horovod --np -2\nimport cloudpickle\ncloudpickle.__version__\n")
    assert ranks.error_in_exec is None, ranks.error_in_exec
    assert ranks.result == expected
