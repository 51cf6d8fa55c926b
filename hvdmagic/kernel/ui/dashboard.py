"""The live ipywidgets dashboard of one run: header, a row per rank, rank-0 charts, logs.

The job loop only updates the RunRecord. A helper thread redraws from it at most
``MAX_FPS`` times a second, inside ``hold_sync`` so each widget sends one message
per redraw. The thread runs in a copy of the cell's context, so its updates land
in the launching cell under ipykernel 6 and 7 alike. No user code ever runs
inside an output widget: ranks run in other processes and their output is only
ever text we render.
"""

from __future__ import annotations

import contextvars
import html
import math
import threading
from collections.abc import Sequence

import ipywidgets as widgets
from IPython.display import display

from hvdmagic.kernel.record import RankRecord, RunRecord
from hvdmagic.kernel.timeline import describe

MAX_FPS = 10
CHART_POINTS = 300  # per metric on screen; the record keeps the full history
LOG_LINES = 200  # per pane on screen
_STATE_COLOURS = {"launching": "#888", "running": "#1f77b4", "finished": "#2ca02c",
                  "failed": "#d62728", "cancelled": "#ff7f0e", "stopped": "#888"}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    return f"{seconds // 60}:{seconds % 60:02d}"


def _label(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.4g}"


def svg_chart(name: str, steps: Sequence[float], values: Sequence[float], width: int = 300, height: int = 120) -> str:
    """An inline SVG line chart of ``values`` against ``steps``, downsampled for display."""
    xs, ys = list(steps[-1:]), list(values[-1:])
    if len(steps) > CHART_POINTS:
        stride = -(-len(steps) // CHART_POINTS)
        xs, ys = list(steps[::stride]) + xs, list(values[::stride]) + ys
    else:
        xs, ys = list(steps), list(values)
    latest = ys[-1]
    # A logged NaN or inf shows as the latest value but has no place on the axes.
    points = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)] or [(xs[-1], 0.0)]
    xs, ys = [x for x, _ in points], [y for _, y in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    pad = 24

    def sx(x):
        return pad + (x - x0) / ((x1 - x0) or 1) * (width - 2 * pad)

    def sy(y):
        return height - pad + -(y - y0) / ((y1 - y0) or 1) * (height - 2 * pad)

    path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys))
    label = html.escape(name)
    return (
        f'<div class="hvdmagic-chart" data-metric="{label}">'
        f'<svg width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" aria-label="{label}">'
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="white" stroke="#ddd"/>'
        f'<text x="{pad}" y="14" font-size="12" font-weight="bold">{label}</text>'
        f'<text x="{width - pad}" y="14" font-size="10" text-anchor="end">{latest:.4g}</text>'
        f'<text x="2" y="{pad + 4}" font-size="9">{y1:.3g}</text>'
        f'<text x="2" y="{height - pad}" font-size="9">{y0:.3g}</text>'
        f'<text x="{pad}" y="{height - 6}" font-size="9">{_label(x0)}</text>'
        f'<text x="{width - pad}" y="{height - 6}" font-size="9" text-anchor="end">{_label(x1)}</text>'
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{path}"/>'
        f"</svg></div>"
    )


class _RankRow:
    def __init__(self, rank: int):
        self.label = widgets.HTML(f"<b>rank {rank}</b>", layout=widgets.Layout(width="150px"))
        self.bar = widgets.FloatProgress(value=0, min=0, max=1, layout=widgets.Layout(width="240px"))
        self.stats = widgets.HTML(layout=widgets.Layout(width="230px"))
        self.line = widgets.HTML(layout=widgets.Layout(flex="1", overflow="hidden"))
        self.state = widgets.HTML(layout=widgets.Layout(width="80px"))
        self.box = widgets.HBox([self.label, self.bar, self.stats, self.state, self.line])
        self.box.add_class("hvdmagic-rank")

    def draw(self, record: RankRecord) -> None:
        host = f" <small>@ {html.escape(record.host)}</small>" if record.host else ""
        self.label.value = f"<b>rank {record.rank}</b>{host}"
        bar = record.bar
        if bar is not None:
            self.bar.max = bar.total if bar.total else max(bar.step, 1)
            self.bar.value = min(bar.step, self.bar.max)
            rate = f" · {bar.rate:.3g} it/s" if bar.rate else ""
            eta = f" · ETA {_duration(bar.eta)}" if bar.eta is not None and record.state == "running" else ""
            total = f"/{bar.total:g}" if bar.total is not None else ""
            desc = f"{html.escape(record.last_bar)} " if record.last_bar else ""
            self.stats.value = f"{desc}{bar.step:g}{total}{rate}{eta}"
        if record.state == "finished":
            self.bar.bar_style = "success"
            if bar is None or not bar.total:
                self.bar.max, self.bar.value = 1, 1
        elif record.state == "failed":
            self.bar.bar_style = "danger"
        colour = _STATE_COLOURS.get(record.state, "#888")
        self.state.value = f'<span style="color:{colour}">{record.state}</span>'
        self.line.value = f"<code>{html.escape(record.last_line[-200:])}</code>"


class Dashboard:
    def __init__(self, record: RunRecord):
        self.record = record
        self._drawn_version = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.header = widgets.HTML()
        self.rows = [_RankRow(r) for r in range(record.np)]
        self.charts = widgets.HTML()
        self.table = widgets.HTML()
        self.panes = [widgets.HTML() for _ in range(record.np + 1)]  # "all ranks" first
        self.logs = widgets.Tab(children=self.panes)
        for i, title in enumerate(["all ranks"] + [f"rank {r}" for r in range(record.np)]):
            self.logs.set_title(i, title)
        self.error = widgets.HTML(layout=widgets.Layout(display="none"))
        self.notes = widgets.HTML()
        self.box = widgets.VBox([
            self.header, *[row.box for row in self.rows],
            widgets.HBox([self.charts, self.table]), self.error, self.notes,
            widgets.Accordion(children=[self.logs], titles=("logs",)),
        ])
        self.box.add_class("hvdmagic-dashboard")

    def start(self) -> None:
        self._draw()
        display(self.box)
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._loop,), name="hvdmagic-dashboard", daemon=True)
        self._thread.start()

    def on_event(self, event: dict) -> None:
        pass  # everything is in the record; the helper thread redraws from it

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._draw()

    def _draw_notes(self) -> None:
        record = self.record
        notes = [html.escape(note) for note in record.notes]
        if record.timeline and record.ended is not None:
            notes.append(html.escape(describe(record.timeline)))
        self.notes.value = "".join(f"<pre style='margin:2px 0'>{note}</pre>" for note in notes)

    def _loop(self) -> None:
        while not self._stop.wait(1 / MAX_FPS):
            self._draw()

    def _draw(self) -> None:
        record = self.record
        version = record.version
        header_only = version == self._drawn_version
        with self.box.hold_sync(), self.header.hold_sync():
            self._draw_header()
            if header_only:
                return  # only the clock moved
            self._drawn_version = version
            for row, rank in zip(self.rows, record.ranks):
                with row.bar.hold_sync():
                    row.draw(rank)
            self._draw_metrics()
            self._draw_logs()
            self._draw_error()
            self._draw_notes()

    def _draw_header(self) -> None:
        record = self.record
        colour = _STATE_COLOURS.get(record.state, "#888")
        job = f" · Spark job group <code>{html.escape(record.job_group)}</code>" if record.job_group else ""
        self.header.value = (
            f'<b>%%horovod</b> · <span class="hvdmagic-state" style="color:{colour}">{record.state}</span>'
            f" · {_duration(record.elapsed)} · np={record.np} ({record.mode}){job}"
        )

    def _draw_metrics(self) -> None:
        series = {name: xy for name, xy in self.record.rank0_series.items() if len(xy[0])}
        if not series:
            return
        self.charts.value = "<div style='display:flex;flex-wrap:wrap;gap:6px'>" + "".join(
            svg_chart(name, xs, ys) for name, (xs, ys) in sorted(series.items())) + "</div>"
        rows = "".join(f"<tr><td>{html.escape(name)}</td><td>{step}</td><td>{value:.5g}</td></tr>"
                       for name, (step, value) in sorted(self.record.latest_metrics().items()))
        self.table.value = (f"<table class='hvdmagic-metrics'><tr><th>metric (rank 0)</th><th>step</th>"
                            f"<th>latest</th></tr>{rows}</table>")

    def _draw_logs(self) -> None:
        record = self.record
        merged = [(f"[{rank}] ", line) for rank, _, line in record.all_logs[-LOG_LINES:]]
        panes = [(merged, len(record.all_logs), "hvdmagic.last_run().logs")]
        for rank in record.ranks:
            panes.append(([("", line) for _, line in rank.logs[-LOG_LINES:]], len(rank.logs),
                          f"hvdmagic.last_run().logs[{rank.rank}]"))
        for widget, (lines, count, where) in zip(self.panes, panes):
            dropped = count - len(lines)
            note = (f"<i>{dropped} older line(s) not shown here; the full log is in <code>{where}</code></i>\n"
                    if dropped > 0 else "")
            body = "".join(html.escape(prefix + line) + "\n" for prefix, line in lines)
            widget.value = f"<pre style='max-height:300px;overflow:auto;margin:0'>{note}{body}</pre>"

    def _draw_error(self) -> None:
        error = self.record.error
        if error is None:
            return
        render = getattr(error, "_render_traceback_", None)
        text = "\n".join(render()) if render else f"{type(error).__name__}: {error}"
        self.error.value = f"<pre style='color:#b00;white-space:pre-wrap'>{html.escape(text)}</pre>"
        self.error.layout.display = None
