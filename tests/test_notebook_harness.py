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

# 3000 updates of an 8 KB display: more than zmq's two 1000-message pipes and TCP's buffers hold.
FLOOD = ("from IPython.display import HTML, display\n"
         "handle = display(HTML(''), display_id=True)\n"
         "for i in range(3000):\n"
         "    handle.update(HTML(str(i) + ' ' * 8000))\n"
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


def test_nbval_with_the_notebooks_conftest_keeps_a_flooding_cells_idle_status(tmp_path):
    shutil.copy(REPO / "notebooks" / "conftest.py", tmp_path / "conftest.py")
    run = _run_nbval(tmp_path)
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]


def test_nbval_alone_loses_a_flooding_cells_idle_status(tmp_path):
    """The other side: without the conftest the same notebook fails as CI's notebook 13 did, so the
    test above would catch the conftest being dropped or nbval changing how it reads."""
    run = _run_nbval(tmp_path)
    assert run.returncode != 0 and "waiting for output" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
