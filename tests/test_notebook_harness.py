"""notebooks/conftest.py: nbval keeps a cell's IOPub messages however many the cell sends before
its reply (a live dashboard sends hundreds a fit). Each side runs nbval on a notebook whose first
cell floods IOPub the way a CrossValidator of dashboards does, and whose second cell must still run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A flood no receiver can hold while nbval waits for the reply: zmq's two pipes hold 1000 messages each,
# and TCP's buffers at most 36 MB (this machine's tcp_rmem and tcp_wmem maxima), about 1150 of these
# 32 KB updates; 4000 are sent. The flush waits until the kernel's IOPub thread has handed every update
# to its socket, so they meet the full pipes before the reply lets nbval read, however slow either side is.
# They go in bursts of 200 (6.4 MB) with a pause of 0.2 s after each: 4000 in about 5 s is still over ten
# times the rate of notebook 13's dashboards (1600 messages in 21 s), and a client that reads as they
# come (the conftest's) keeps up with it on a loaded machine too. Sent with no pause at all, beside a
# second `make test` (a load of 12), the client's process was starved long enough for 68 MB to pile up.
FLOOD = ("import sys, time\n"
         "from IPython.display import HTML, display\n"
         "handle = display(HTML(''), display_id=True)\n"
         "for i in range(4000):\n"
         "    handle.update(HTML(str(i) + ' ' * 32000))\n"
         "    if i % 200 == 199:\n"
         "        time.sleep(0.2)  # a dashboard's pace, not a wait for anything\n"
         "sys.stdout.flush()\n"
         "print('flooded')")


def _run_nbval(folder: Path) -> subprocess.CompletedProcess:
    cells = [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": source}
             for source in (FLOOD, "print(1 + 1)")]
    notebook = {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                             "language": "python"}},
                "nbformat": 4, "nbformat_minor": 5}
    (folder / "flood.ipynb").write_text(json.dumps(notebook))
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--nbval-lax", "-q",
                           "--rootdir", str(folder), "flood.ipynb"],
                          cwd=folder, capture_output=True, text=True, timeout=240)


def _said(run: subprocess.CompletedProcess) -> str:
    """nbval's output without its line per widget update it does not handle: the failure's reason stays."""
    return "\n".join(line for line in (run.stdout + run.stderr).splitlines()
                     if not line.startswith("unhandled iopub msg"))[-4000:]


def test_nbval_with_the_notebooks_conftest_keeps_a_flooding_cells_idle_status(tmp_path):
    shutil.copy(REPO / "notebooks" / "conftest.py", tmp_path / "conftest.py")
    run = _run_nbval(tmp_path)
    assert run.returncode == 0 and "2 passed" in run.stdout, _said(run)


def test_nbval_alone_loses_a_flooding_cells_idle_status(tmp_path):
    """The other side: without the conftest the same notebook fails as CI's notebook 13 did, so the
    test above would catch the conftest being dropped or nbval changing how it reads."""
    run = _run_nbval(tmp_path)
    assert run.returncode != 0 and "waiting for output" in run.stdout, _said(run)
