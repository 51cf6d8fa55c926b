"""How a run is shown: the widget dashboard in a Jupyter kernel, its text twin elsewhere.

The dashboard is made of widgets while the run is live and becomes a static snapshot
(``snapshot.Snapshot``: HTML and text) when it ends; the text view prints rank output
and ends with the same snapshot's text. Both read the run's ``RunRecord``;
``format`` holds the progress text they share.
"""

from __future__ import annotations

import os

from hvdmagic.kernel.record import RunRecord


def interactive() -> bool:
    """Whether to show the widget dashboard rather than the text view.

    ``HVDMAGIC_NONINTERACTIVE=1`` forces text and ``=0`` forces widgets. Otherwise, as
    tqdm.auto and ipywidgets decide: widgets in any Jupyter (ZMQ) kernel, whichever front
    end started it (JupyterLab, Notebook, VS Code, Colab, Databricks, nbclient, papermill);
    text in terminal IPython and plain Python. A front end that does not render widgets
    shows the display's text/plain meanwhile, and every front end keeps the snapshot that
    replaces the widgets when the run ends.
    """
    forced = os.environ.get("HVDMAGIC_NONINTERACTIVE")
    if forced is not None and forced.strip() != "":
        return forced.strip().lower() in ("0", "false", "no")
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def make_view(record: RunRecord):
    if interactive():
        from hvdmagic.kernel.ui.dashboard import Dashboard

        return Dashboard(record)
    from hvdmagic.kernel.ui.text import TextView

    return TextView(record)
