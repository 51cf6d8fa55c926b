"""The live dashboard of a real ``%%horovod --np 2`` cell, in JupyterLab in headless Chromium.

nbclient and nbval only see the widgets' final state; this test checks what a user sees:
progress bars that move and a metric chart that appears while the ranks train.
Needs Debian's chromium (scripts/install_browser.sh) and the dev extras (jupyterlab, playwright).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import nbformat
import pytest
from browser.jupyter import JupyterLab, launch_chromium, missing_chromium

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "artifacts"
SCREENSHOTS = ARTIFACTS / "screenshots"
DOCS_IMAGE = REPO / "docs" / "images" / "dashboard.png"

# The indicator also reads idle for a moment before any kernel is attached ("No Kernel"),
# and Run All then does nothing or asks for a kernel: so wait for a named kernel too.
KERNEL_READY = """() => {
    const toolbar = document.querySelector(".jp-NotebookPanel-toolbar");
    const idle = toolbar?.querySelector(".jp-Notebook-ExecutionIndicator[data-status='idle']");
    const kernel = toolbar?.querySelector("[data-jp-item-name='kernelName']")?.innerText.trim();
    return !!idle && !!kernel && kernel !== "No Kernel";
}"""
DASHBOARD = ".hvdmagic-dashboard"
BARS = f"{DASHBOARD} .widget-hprogress .progress-bar"
STATE = f"{DASHBOARD} .hvdmagic-state"
CHART = f"{DASHBOARD} .hvdmagic-chart svg"
NP = 2

LOAD_CELL = "%load_ext hvdmagic"
# ~15 s of steps: long enough to watch the bars move, short enough for `make test`.
TRAIN_CELL = f"""\
%%horovod --np {NP}
import time
import torch
import horovod.torch as hvd
import hvdmagic

hvd.init()
hvd.allreduce(torch.ones(1), name="warmup")
steps = 150
for i in range(steps):
    time.sleep(0.1)  # the workload
    hvdmagic.log_metrics(step=i, loss=1 / (i + 1))
    hvdmagic.progress(i + 1, total=steps, desc="train")
hvd.rank()
"""

WIDTHS = f"() => Array.from(document.querySelectorAll({json.dumps(BARS)}), e => e.style.width)"


@pytest.fixture
def lab(tmp_path):
    root = tmp_path / "notebooks"
    root.mkdir()
    with JupyterLab(root, home=tmp_path / "jupyter", log=ARTIFACTS / "jupyter-server.log") as server:
        yield server


@pytest.fixture
def page():
    problem = missing_chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        problem = "playwright is not installed: run scripts/setup.sh (it installs the dev extras)"
    if problem:
        pytest.fail(problem, pytrace=False)
    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 900}, device_scale_factor=2)
        finally:
            browser.close()


def wait_for(page, js: str, *, timeout: float, failure: str, arg=None):
    """``page.wait_for_function`` that fails with ``failure`` and the cell outputs."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        return page.wait_for_function(js, arg=arg, timeout=timeout * 1000).json_value()
    except PlaywrightTimeout:
        pass
    pytest.fail(f"{failure} within {timeout:.0f} s.\n{outputs(page)}", pytrace=False)


def outputs(page) -> str:
    text = page.eval_on_selector_all(".jp-OutputArea", "els => els.map(e => e.innerText).join('\\n---\\n')")
    return f"Cell outputs:\n{text or '(none)'}\nServer and kernel log: {ARTIFACTS / 'jupyter-server.log'}"


def run_all_cells(page, url: str) -> None:
    page.goto(url)
    wait_for(page, KERNEL_READY, timeout=90, failure="The notebook did not open with an idle kernel")
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()


@pytest.mark.timeout(300)
def test_live_dashboard_in_jupyterlab(page, lab):
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(LOAD_CELL), nbformat.v4.new_code_cell(TRAIN_CELL)],
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nbformat.write(nb, lab.root / "dashboard.ipynb")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    try:
        run_all_cells(page, f"{lab.url}/lab/tree/dashboard.ipynb?reset")
        check_dashboard(page)
    except BaseException:  # pytest.fail and pytest-timeout raise BaseExceptions too
        with contextlib.suppress(Exception):
            page.screenshot(path=SCREENSHOTS / "failure.png")
        raise


def check_dashboard(page) -> None:
    # Generous: the cell also starts the embedded SparkSession, and the bars sit at 0%
    # through the whole launch, which takes over 30 s on a loaded 2-core machine.
    wait_for(page, f"() => document.querySelectorAll({json.dumps(BARS)}).length === {NP}", timeout=150,
             failure=f"The dashboard ({DASHBOARD}) did not show {NP} rank progress bars")
    first = wait_for(page, f"() => {{ const w = ({WIDTHS})(); return w.some(x => parseFloat(x) > 0) && w; }}",
                     timeout=150, failure="No rank reported any progress")
    assert not all(w == "100%" for w in first), f"the run had already finished when first seen: {first}"
    # Progress must advance while the cell runs, not only when it ends.
    later = wait_for(page, f"first => {{ const w = ({WIDTHS})(); return w.join() !== first.join() && w; }}",
                     arg=first, timeout=30,
                     failure=f"The rank progress bars did not move from {first}")
    print(f"progress bars moved from {first} to {later}")
    wait_for(page, f"() => !!document.querySelector({json.dumps(CHART)})", timeout=30,
             failure=f"No metric chart ({CHART}) appeared")
    page.screenshot(path=SCREENSHOTS / "running.png")

    state = wait_for(
        page,
        f"""() => {{
            const s = document.querySelector({json.dumps(STATE)});
            const t = s ? s.textContent : "";
            return /finished|failed|cancelled/.test(t) && t;
        }}""",
        timeout=120, failure="The dashboard state did not reach finished/failed/cancelled")
    assert "finished" in state, f"the run ended as {state!r}, not finished.\n{outputs(page)}"
    final = page.evaluate(WIDTHS)
    assert final == ["100%"] * NP, f"finished, but not every rank's bar is full: {final}"

    page.screenshot(path=SCREENSHOTS / "finished.png")
    page.locator(DASHBOARD).screenshot(path=SCREENSHOTS / "dashboard.png")
    if os.environ.get("HVDMAGIC_UPDATE_SCREENSHOT") == "1":
        DOCS_IMAGE.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SCREENSHOTS / "dashboard.png", DOCS_IMAGE)
