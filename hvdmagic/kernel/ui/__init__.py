"""How a run is shown: the widget dashboard, or its text twin when no widget front end is there."""

from __future__ import annotations

import os

from hvdmagic.kernel.record import RunRecord


def interactive() -> bool:
    """Whether a front end that renders widgets is likely attached.

    ``HVDMAGIC_NONINTERACTIVE=1`` forces text and ``=0`` forces widgets. Otherwise:
    text outside a Jupyter kernel (terminal IPython, plain Python), and text in a
    kernel that no Jupyter server started (nbclient, nbconvert, nbval, papermill
    start kernels without ``JPY_SESSION_NAME``), since those ignore widget updates.
    """
    forced = os.environ.get("HVDMAGIC_NONINTERACTIVE")
    if forced is not None and forced.strip() != "":
        return forced.strip().lower() in ("0", "false", "no")
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    return "JPY_SESSION_NAME" in os.environ


def make_view(record: RunRecord):
    if interactive():
        from hvdmagic.kernel.ui.dashboard import Dashboard

        return Dashboard(record)
    from hvdmagic.kernel.ui.text import TextView

    return TextView(record)
