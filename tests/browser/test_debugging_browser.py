"""pdb in a rank, typed in JupyterLab's own input box (issue 61): ``%debug`` after a session's cell
failed, and ``breakpoint()`` in a running cell.

One notebook: a local session, a cell that fails on rank 1, ``%debug`` answered with ``p x`` and
``q``, then a cell whose rank 1 stops at ``breakpoint()``, answered with ``p x`` and ``c``. Each line
is typed into the stdin box JupyterLab shows under the cell, as a user does. Screenshots under
artifacts/screenshots/: debug-prompt.png (pdb's answer under %debug, the next prompt waiting),
breakpoint-prompt.png (rank 1 at its breakpoint, the dashboard above the prompt) and
debug-finished.png (the notebook at its end).
"""

from __future__ import annotations

import json
import re

import pytest
from test_browser import (  # noqa: F401 (lab and browser are the fixtures this module shares)
    LOAD_CELL,
    NOTEBOOK_CELLS,
    SCREENSHOTS,
    browser,
    cell_js,
    cell_text,
    lab,
    new_page,
    open_notebook,
    run_all_cells,
    shut_down_kernels,
    wait_for,
    wait_until_idle,
    write_notebook,
)

pytestmark = pytest.mark.browser

STDIN_BOX = ".jp-Stdin-input"
SETUP = "%horovod start --np -2"
FAILING = """\
%%horovod
import horovod.torch as hvd
hvd.init()
x = hvd.rank() * 3
assert hvd.rank() != 1, f"rank 1 with x={x}"
"""
DEBUG = "%debug"
STOPPING = """\
%%horovod
y = x + 1
if hvd.rank() == 1:
    breakpoint()
y * 10
"""


def _answer(page, cell: int, after: str, line: str, *, timeout: float) -> None:
    """Wait until cell ``cell`` shows the stdin box with ``after`` in its output, then type ``line`` and Enter.
    ``after`` is what a user reads before typing (where pdb stopped), not the box's own prompt: the kernel
    sends the box on its stdin channel and the text above it on iopub, and the server may forward the box
    first, so a line typed at once would be shown above pdb's header."""
    # One box: the one answered last is replaced by its line a moment after Enter.
    boxes = f"cell?.querySelectorAll({json.dumps(STDIN_BOX)}).length === 1"
    wait_for(page, cell_js(cell, f"{boxes} && cell.querySelector('.jp-OutputArea').innerText.includes("
                                 f"{json.dumps(after)})"),
             timeout=timeout, failure=f"cell {cell + 1} did not ask for a line after {after!r}")
    field = page.locator(f"{NOTEBOOK_CELLS} >> nth={cell}").locator(STDIN_BOX).last
    field.fill(line)
    field.press("Enter")


@pytest.mark.timeout(300)
def test_debug_and_breakpoint_are_typed_in_jupyterlabs_input_box(lab, browser):  # noqa: F811 (the shared fixtures)
    path = write_notebook(lab, "debugging.ipynb", LOAD_CELL, SETUP, FAILING, DEBUG, STOPPING, "print('after', 1 + 1)")
    try:
        with new_page(browser, "debugging") as page:
            open_notebook(page, lab, path.name)
            run_all_cells(page)  # it halts at the failing cell, as Run All does at an error
            wait_for(page, cell_js(2, "!!cell?.querySelector('.jp-OutputArea').innerText.includes('JobFailed')"),
                     timeout=180, failure="the failing cell did not fail")
            page.locator(f"{NOTEBOOK_CELLS} >> nth=3").locator(".jp-InputArea-editor").click()
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Run Selected Cell and All Below", exact=True).click()
            # %debug: pdb in rank 1 at the failed assert.
            _answer(page, 3, "-> assert hvd.rank() != 1", "p x", timeout=180)
            # JupyterLab shows a typed line after its prompt with a space, and blank lines between outputs.
            answered = "/\\(Pdb\\)\\s+p x\\s+3\\s/.test(cell.querySelector('.jp-OutputArea').innerText)"
            wait_for(page, cell_js(3, answered), timeout=30, failure="%debug did not answer p x with rank 1's x")
            page.screenshot(path=SCREENSHOTS / "debug-prompt.png")
            _answer(page, 3, "(Pdb) ", "q", timeout=30)
            # breakpoint(): rank 1 stops, its prompt names it; rank 0 waits.
            _answer(page, 4, "-> breakpoint()", "p y", timeout=60)
            answered = "/\\(Pdb rank 1\\)\\s+p y\\s+4\\s/.test(cell.querySelector('.jp-OutputArea').innerText)"
            wait_for(page, cell_js(4, answered), timeout=30,
                     failure="breakpoint()'s pdb did not answer p y with rank 1's y")
            wait_for(page, cell_js(4, "cell.querySelector('.jp-OutputArea').innerText.includes('in the debugger')"),
                     timeout=30, failure="the dashboard did not show rank 1 in the debugger")
            page.screenshot(path=SCREENSHOTS / "breakpoint-prompt.png")
            _answer(page, 4, "(Pdb rank 1) ", "c", timeout=30)
            wait_for(page, cell_js(5, "cell.querySelector('.jp-OutputArea').innerText.includes('after 2')"),
                     timeout=90, failure="the notebook did not run on to its last cell")
            wait_until_idle(page, timeout=30, what="the notebook's end")
            debug_text, stopping_text = cell_text(page, 3), cell_text(page, 4)
            page.screenshot(path=SCREENSHOTS / "debug-finished.png", full_page=True)
    finally:
        shut_down_kernels(lab)
    assert "hvdmagic: pdb in rank 1, where AssertionError: rank 1 with x=3 was raised" in debug_text, debug_text
    assert re.search(r"\(Pdb\)\s+p x\s+3\s+\(Pdb\)\s+q", debug_text), debug_text
    assert "hvdmagic: rank 1 stopped at breakpoint()" in stopping_text, stopping_text
    # The snapshot replaces the live dashboard where it was shown: between the answer and the next line typed.
    assert re.search(r"\(Pdb rank 1\)\s+p y\s+4\s", stopping_text), stopping_text
    assert re.search(r"\(Pdb rank 1\)\s+c\s", stopping_text) and "finished" in stopping_text, stopping_text
