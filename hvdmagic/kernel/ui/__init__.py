"""How a run is shown: the widget dashboard in a Jupyter kernel, its text twin elsewhere.

In a Jupyter kernel a run shows nothing until it has gone on for a moment; then the
dashboard, made of widgets while the run is live, which becomes a static snapshot
(``snapshot.Snapshot``: HTML and text) when it ends. A run that ends sooner leaves a
compact snapshot only. The text view prints rank output and ends with the same
snapshot's text. All read the run's ``RunRecord``. ``make_view`` (here) picks the view.

- ``live``: ``LiveView``, a Jupyter kernel's view: the delay, then the ``Dashboard``; or the compact record;
- ``dashboard``: ``Dashboard``, the live ipywidgets view, redrawn from the record by a thread;
- ``text``: ``TextView``, rank output and epoch lines as plain text, for terminals and plain Python;
- ``snapshot``: ``Snapshot``, a finished run as static HTML and text without timings, and its ``summary``;
- ``progress_text``: progress as text (rows, stages, overall progress, rates), shared by all three;
- ``grouping``: a run of more than eight ranks grouped: rows of ranks that read the same, each line once;
- ``charts``: inline SVG charts of metric series, for the dashboard and the snapshot.
- ``widget_api``: what ipywidgets 7 and 8 spell differently (a view's display bundle, page titles).

Runs in the notebook kernel. Within ``ui`` the arrows go one way: ``live`` → ``dashboard``
(only once the delay has passed) and ``snapshot``; ``dashboard`` and ``text`` →
``snapshot``; all three → ``grouping`` → ``progress_text``; ``dashboard`` → ``widget_api``;
``dashboard`` and ``snapshot`` → ``charts``, which imports only the standard library.
Besides each other these modules may import ``kernel.record``, ``kernel.timeline``,
``kernel.noise``, ``protocol`` and ``metric_rows``. Only ``dashboard`` and its ``widget_api``
import ipywidgets (and numpy, when it draws);
IPython only to display or to ask whether a kernel is there. Nothing here imports
``launch`` or the rest of ``kernel``.
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
        from hvdmagic.kernel.ui.live import LiveView

        return LiveView(record)
    from hvdmagic.kernel.ui.text import TextView

    return TextView(record)
