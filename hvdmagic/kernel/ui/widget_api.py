"""What ipywidgets 7 and 8 spell differently, in one place.

Databricks' runtimes and Colab ship ipywidgets 7; a new virtualenv gets 8. The dashboard uses
the widgets both share, and reaches the two differences it needs through here: a widget view's
display bundle (8 returns it from ``_repr_mimebundle_``; 7 builds and displays it inside
``_ipython_display_``), and the titles of a Tab or an Accordion (8 takes ``titles=``; 7 has
``set_title`` per page). Each asks the widget what it has, not which version is installed.
"""

from __future__ import annotations

import ipywidgets as widgets


def view_bundle(widget: widgets.Widget) -> dict:
    """The display bundle of ``widget``'s view, to display with a display id (``raw=True``)."""
    make = getattr(widget, "_repr_mimebundle_", None)
    if make is not None:
        return make()
    # ipywidgets 7's _ipython_display_ builds the same bundle, but displays it without a display id.
    return {"text/plain": repr(widget)[:110],
            "application/vnd.jupyter.widget-view+json": {"version_major": 2, "version_minor": 0,
                                                          "model_id": widget.model_id}}


def titled(container: widgets.Box, titles) -> widgets.Box:
    """``container`` (a Tab or an Accordion) with its pages titled ``titles``, in order."""
    if container.has_trait("titles"):
        container.titles = tuple(titles)
    else:
        for index, title in enumerate(titles):
            container.set_title(index, title)
    return container
