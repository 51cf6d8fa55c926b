"""A run in a Jupyter kernel: nothing while it is quick, the widget dashboard once it is not.

As tqdm's ``delay=``: the live widgets appear only once the run has gone on for ``delay()``
seconds (``DELAY``, or ``HVDMAGIC_DASHBOARD_DELAY``). A run that ends sooner, such as a
trivial cell on a session's warm ranks, never creates a widget model, nor imports
ipywidgets: its output is its final record alone, ``Snapshot(record, compact=True)``,
shown once. Building some ninety widget models and closing them again cost a trivial
cell several times its own time, and left a full snapshot per cell.

A run that goes on gets the full ``Dashboard``, built then from the run's record: the
record holds everything since the start (every line, bar, metric and stage), so nothing
of the first part is lost. A helper thread, in a copy of the cell's context (so that its
messages land in the cell), waits out the delay and builds it. Until then the kernel's
interrupt works as ever, and an error or a Stop ends the run with the full snapshot.
"""

from __future__ import annotations

import contextvars
import math
import os
import threading

from hvdmagic.kernel.record import RunRecord
from hvdmagic.protocol import Event

DELAY = 0.4  # seconds a run goes on before its live widgets appear
DELAY_ENV = "HVDMAGIC_DASHBOARD_DELAY"


def delay() -> float:
    """``DELAY``, or the seconds ``HVDMAGIC_DASHBOARD_DELAY`` gives (0: the widgets at once);
    a value that is not a number of seconds, zero or more, is ignored."""
    raw = os.environ.get(DELAY_ENV, "").strip()
    try:
        seconds = float(raw) if raw else DELAY
    except ValueError:
        return DELAY
    return seconds if math.isfinite(seconds) and seconds >= 0 else DELAY


class LiveView:
    def __init__(self, record: RunRecord, delay_s: float | None = None):
        self.record = record
        self.delay = delay() if delay_s is None else delay_s
        self.dashboard = None  # the Dashboard, once the run outlived the delay
        self.error: BaseException | None = None  # why the dashboard could not be shown, if it could not
        self._lock = threading.Lock()  # close() waits for a dashboard being built, and then closes it
        self._closed = False
        self._timer: threading.Timer | None = None

    # -- the view protocol ----------------------------------------------------
    def start(self) -> None:
        if self.delay <= 0:
            self._show()
            return
        context = contextvars.copy_context()
        self._timer = threading.Timer(self.delay, context.run, args=(self._show,))
        self._timer.name = "hvdmagic-dashboard-delay"
        self._timer.daemon = True
        self._timer.start()

    def on_event(self, event: dict) -> None:
        # Everything is in the record, which the dashboard is drawn from. But a rank stopped at
        # breakpoint() is about to ask in the cell's output: the dashboard goes above pdb's lines
        # rather than between them, however late the delay's thread would have built it.
        if event.get("type") == Event.DEBUG_PROMPT and self.dashboard is None and self._timer is not None:
            self._timer.cancel()
            self._show()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            self._closed = True
            board = self.dashboard
        if board is not None:
            board.close()
            return
        if self.record.ended_before_launch:  # nothing was shown, no rank started: the error is all
            return
        from IPython.display import display

        from hvdmagic.kernel.ui.snapshot import Snapshot

        display(Snapshot(self.record, compact=True))

    # -- the delayed part -------------------------------------------------------
    def _show(self) -> None:
        with self._lock:
            if self._closed or self.dashboard is not None or self.error is not None:
                return  # ended, or shown (or failed) already by the other of the delay and a breakpoint
            try:
                from hvdmagic.kernel.ui.dashboard import Dashboard

                board = Dashboard(self.record)
            except Exception as exc:  # a view problem must never end the run; the snapshot still comes
                self.error = exc
                return
            try:
                board.start()
            except Exception as exc:
                self.error = exc
                if board.handle is None:  # nothing shown: the snapshot comes as if the run had been quick
                    board.discard()
                    return
            self.dashboard = board
