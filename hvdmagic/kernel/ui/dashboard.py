"""The live ipywidgets dashboard of one run, replaced by a static snapshot when the run ends.

Layout, top to bottom: a one-line header (state, the start-up stage and its time while the
ranks start, elapsed time, np, the Spark job group); the run's overall bar with its ETA,
when the ranks' bars say how far the run is; a row per rank (``progress_text.row_parts``: epoch,
bar, steps, rate, ETA, state, last line; the rank's own stage until it trains); the newest
lines of every rank; rank 0's metric charts with their controls (scale, smoothing, every
rank overlaid); notes; and the full per-rank logs, collapsed. A run of more than eight ranks
(``grouping.is_grouped``) has a row per group of ranks that read the same instead, drawn from
a pool of rows that grows to the number of groups, every rank's row as text in a folded
section, and three log panes (every line, each line once, one rank's picked) for a tab per rank.

The job loop only updates the RunRecord. A helper thread redraws from it at most
``MAX_FPS`` times a second; a change of a chart control makes its next redraw redraw the
charts. The thread runs in a copy of the cell's context, so its updates land in the
launching cell under ipykernel 6 and 7 alike. No user code ever runs inside an output
widget: ranks run in other processes and their output is only ever text we render.

The widgets are displayed with a display id. When the run ends, the thread stops, the
output is updated to a ``Snapshot`` (HTML and a text/plain without timings) and the widgets
are closed: a saved notebook, nbviewer and GitHub show the final figures rather than
"model not found", and a notebook executed by nbclient stores the snapshot. The error, if
any, is the cell's error output; the dashboard only says "failed: see the error below".

A front end without widgets (JupyterLab without the widgets extension, nbclient while it
runs) shows each display's text/plain instead. The rows as text
(``fallback_text``) go in a second display, beside the widgets, updated at most once a
second (``FALLBACK_INTERVAL``) while the run is live. Its widget view is one hidden,
childless box: a front end with widgets renders each update of a display anew, which for
the dashboard's own display would rebuild (in JupyterLab: add) a view of every widget each
second. When the run ends that display becomes empty (``ENDED_TEXT_BUNDLE``).
"""

from __future__ import annotations

import contextvars
import html
import itertools
import re
import threading
import time
from array import array
from collections.abc import Iterator

import ipywidgets as widgets
from IPython.display import display

from hvdmagic import stacks
from hvdmagic.kernel.record import RankRecord, RunRecord
from hvdmagic.kernel.timeline import describe
from hvdmagic.kernel.ui import charts, grouping, progress_text, row_fit
from hvdmagic.kernel.ui.snapshot import hang_notices_html
from hvdmagic.kernel.ui.widget_api import titled, view_bundle
from hvdmagic.metric_rows import GAP_BITS

MAX_FPS = 10
FALLBACK_INTERVAL = 1.0  # seconds between updates of the live text/plain
# What the live text's display holds once the run has ended (no message takes a display out of a
# notebook): nothing, in the type each of nbconvert's exports takes first, so that none of them
# makes a block of it (an empty text/plain is an empty code block, and reST's empty directive an error).
ENDED_TEXT_BUNDLE = {"text/plain": "", "text/html": "", "text/x-rst": ""}
CHART_POINTS = charts.CHART_POINTS  # per series on screen; the record keeps the full history
LOG_LINES = 200  # per pane of the collapsed logs
RECENT_LINES = 10  # the newest lines of every rank, always visible
GROUPED_TAIL = 20  # per rank, grouped in a many-rank run's "each line once" pane: 200 of 256 ranks cost 50 ms
_STATE_COLOURS = progress_text.STATE_COLOURS
_DASHBOARDS = itertools.count(1)  # numbers each dashboard's scope for its own row style
# Said in the first dashboard of a kernel without subshells (ipykernel 6: Databricks, Colab), which has
# neither the chart controls nor the where button: why they are missing.
CONTROLS_NEED_SUBSHELLS = ("chart controls and the where button need ipykernel >= 7 (subshells): here a click "
                           "would wait for the cell, so they are left out")
_controls_note_said = False
_MONO = "SFMono-Regular,Menlo,Consolas,'DejaVu Sans Mono',monospace"
_ONE_LINE = "white-space:pre;overflow:hidden;text-overflow:ellipsis;line-height:20px"
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")


def _recent_html(lines: str) -> str:
    """The newest lines' pane, at its fixed height from the dashboard's first frame: what lies below
    it (the controls, the charts) neither jumps when the first line arrives nor moves as lines do."""
    body = lines or '<span style="color:#999">the ranks\' newest output lines appear here</span>'
    return (f'<pre class="hvdmagic-recent" style="margin:4px 0;padding:2px 6px;'
            f'background-color:#f7f7f7;font-family:{_MONO};font-size:12px;line-height:17px;'
            f'height:{RECENT_LINES * 17}px;box-sizing:content-box;white-space:pre;'
            f'overflow:hidden">{body}</pre>')


def _columns_html(columns, colour: str = "") -> str:
    """``_mono``'s line, its (name, text) columns each in a span of class ``hvdmagic-{name}``."""
    style = f"font-family:{_MONO};font-size:12px;{_ONE_LINE}" + (f";color:{colour}" if colour else "")
    spans = "".join(f'<span class="hvdmagic-{name}">{html.escape(text)}</span>' for name, text in columns if text)
    return f'<div style="{style}">{spans}</div>'


def _mono(text: str, colour: str = "") -> str:
    style = f"font-family:{_MONO};font-size:12px;{_ONE_LINE}" + (f";color:{colour}" if colour else "")
    return f'<div style="{style}">{html.escape(text)}</div>'


def _clean(line: str) -> str:
    return _ANSI.sub("", line)


LINE_CHARS = 300  # of a rank's last line in its row (the rest is in the logs): the widget row's, whole in its title
TEXT_LINE_CHARS = 80  # in the text rows


def _last_line(rank: RankRecord, chars: int) -> str:
    """A row's last column: why a lost task was lost, or the rank's last output line, its start
    kept (where a line says what it is) and cut after ``chars`` with an ellipsis."""
    if rank.state == "lost":
        return rank.lost
    line = _clean(rank.last_line)
    return line if len(line) <= chars else line[:chars - 1] + "…"


def _step_range(group: grouping.Group) -> tuple[str | None, str]:
    """Where a group's row shows its members' step range: in the steps column, "  5–6/20  ", where
    a reader looks for steps and nothing cuts it; or, too long for that column ("12345–12400/99999"),
    before the last line, "steps 12345–12400/99999". ``(column, "")``, ``(None, "steps …")`` or
    ``(None, "")`` when the members are at the same step."""
    column = group.count_column()
    if column is not None:
        return column, ""
    steps = group.steps()
    return None, f"steps {steps}" if steps else ""


# A row's last column shrinks with the row and ends in an ellipsis, with the whole line as its title. The
# widget's own content box (.widget-html-content, a flex item) would otherwise be as wide as its text
# and be clipped mid-way with no ellipsis: a width of 0 that grows to the column's (min-width) gives
# the text no say in the column's width.
_SHRINKS = "width:0;min-width:100%;box-sizing:border-box"
_ELLIPSIS = "min-width:0;white-space:pre;overflow:hidden;text-overflow:ellipsis"
# A group's step range gives way only once its last line has none left: the line shrinks first (the
# weights are flex-shrink times width), then the range, each with an ellipsis. A weight below 1 would
# leave part of the overflow unshrunk (flexbox's rule for factors that add up to less than 1), hence 1000.
_STEPS_FLEX = "flex:0 1 auto"
_LINE_FLEX = "flex:1 1000 auto"
# Between the rank's figures (CPU, memory, GPUs) and its last line: a rule, as the text's " │ ".
_RULE = "border-left:1px solid #ccc;padding-left:6px"


def _last_line_html(line: str, colour: str, *, rule: bool, steps: str = "") -> str:
    """A row's last column: a group's step range ("steps 5–6/20"), then the last output line, cut
    with an ellipsis where the row ends (the range only once the line has no room left), each whole
    in its title; after a rule when ``rule``."""
    style = f"font-family:{_MONO};font-size:12px;line-height:20px;display:flex;{_SHRINKS};color:{colour}"
    if rule and (line or steps):
        style += f";{_RULE}"
    parts = []
    if steps:
        parts.append(f'<span class="hvdmagic-steps" style="{_STEPS_FLEX};{_ELLIPSIS}" title="{html.escape(steps)}">'
                     f'{html.escape(steps)}{" · " if line else ""}</span>')
    if line:
        parts.append(f'<span style="{_LINE_FLEX};{_ELLIPSIS}" title="{html.escape(line)}">{html.escape(line)}</span>')
    return f'<div class="hvdmagic-line" style="{style}">{"".join(parts)}</div>'


# A rank that has not trained yet has no bar: its stage ("importing tensorflow") runs over the bar's
# room, hidden meanwhile, from a box as wide as the left column, so the columns after it stay put.
STAGE_OVER_BAR = 24  # characters of the bar's 180 px at 12 px monospace


def _stage_html(stage: str, width: int, colour: str) -> str:
    text = progress_text.fit(stage, width + STAGE_OVER_BAR).rstrip()
    return (f'<div class="hvdmagic-stage" style="font-family:{_MONO};font-size:12px;line-height:20px;'
            f'white-space:pre;width:{width}ch;overflow:visible{";color:" + colour if colour else ""}">'
            f"{html.escape(text)}</div>")


class _RankRow:
    def __init__(self, rank: int, label_width: str = "120px"):
        # Never shrunk by a narrow output area: the last line (flex 1 1 0) gives way first, and "ranks 0–23"
        # stays whole.
        self.label = widgets.HTML(f"<b>rank {rank}</b>",
                                  layout=widgets.Layout(width=label_width, overflow="hidden", flex="0 0 auto"))
        # Its overflow is visible: a starting rank's stage runs over the bar's room (_stage_html).
        self.left = widgets.HTML(layout=widgets.Layout(flex="0 0 auto", overflow="visible", margin="0 4px 0 0"))
        # The bar gives way (down to 40 px) where the output area is narrow (a group's longer label, a side
        # panel open), so that the state and the figures after it stay in view.
        self.bar = widgets.FloatProgress(value=0, min=0, max=1,
                                         layout=widgets.Layout(width="180px", flex="0 1 auto", min_width="40px"))
        self.right = widgets.HTML(layout=widgets.Layout(flex="0 0 auto", overflow="hidden", margin="0 4px"))
        self.state = widgets.HTML(layout=widgets.Layout(width="70px", flex="0 0 auto", overflow="hidden"))
        # The straggler marker, then CPU, memory and GPUs (progress_text.usage_text); empty, it takes no room.
        self.usage = widgets.HTML(layout=widgets.Layout(flex="0 0 auto", overflow="hidden", margin="0 4px 0 0"))
        self.line = widgets.HTML(layout=widgets.Layout(flex="1 1 0", min_width="0", overflow="hidden"))
        self.box = widgets.HBox([self.label, self.left, self.bar, self.right, self.state, self.usage, self.line],
                                layout=widgets.Layout(height="30px", flex_flow="row nowrap", align_items="center",
                                                      overflow="hidden"),
                                _dom_classes=["hvdmagic-rank"])
        self.meter = progress_text.Meter()
        self._bar_key: tuple | None = None

    def draw(self, run: RunRecord, record: RankRecord, epochs: bool, now: float, counted: bool = True, *,
             label: str | None = None, line: str | None = None, count_column: str | None = None,
             steps: str = "") -> None:
        """``counted``: some rank of the run has a progress bar; when none has, the blank step,
        rate and time columns give their width to the last line (a cell that only prints).
        ``label`` (HTML), ``line``: the row's name and last line, in place of the rank's own, and
        its members' step range (a group's row) in the steps column (``count_column``) or, too long
        for it, before the last line (``steps``): each widget is set once a redraw, so no message
        carries a value it replaces."""
        host = f" <small>@ {html.escape(record.host)}</small>" if record.host else ""
        name = progress_text.row_name(run, record.rank)
        if run.elastic and record.world_rank is not None:
            name += f" · rank {record.world_rank}"
        grey = ";color:#999" if record.state in ("lost", "unused", "idle") else ""
        self.label.value = label if label is not None else (
            f'<div style="{_ONE_LINE};{_SHRINKS}{grey}"><b>{name}</b>{host}</div>')
        _, inner = progress_text.pick_bars(dict(record.bars))
        rate = None
        if inner is not None:
            desc, bar = inner
            key = (desc, bar.restarts)
            if key != self._bar_key:  # another bar, or the next epoch's: keep the rate, count from here
                self._bar_key = key
                self.meter.anchor(bar.step, bar.time)
            rate = self.meter.update(bar.step, bar.time)
        left, _, right = progress_text.row_parts(record, rate=rate, epochs=epochs, now=now, steps=count_column)
        stage = progress_text.starting_stage(record) if inner is None else None
        if stage is not None:
            self.left.value = _stage_html(stage, len(left), grey[7:])
        elif inner is not None:  # in columns, that give way in a narrow output area (kernel/ui/row_fit.py)
            self.left.value = _columns_html(zip(("epoch", "desc", "percent"),
                                                progress_text.left_columns(left, epochs)), grey[7:])
        else:
            self.left.value = _mono(left, grey[7:])
        self.bar.layout.visibility = "hidden" if stage is not None else None
        timed = inner is not None and len(right) >= progress_text.right_width(True)
        self.right.value = (_columns_html(zip(("count", "rate", "times"), progress_text.right_columns(right)),
                                          grey[7:]) if timed else _mono(right, grey[7:]))
        for part, text in ((self.left, left), (self.right, right)):
            part.layout.display = "none" if not counted and not text.strip() else ""
        with self.bar.hold_sync():
            if inner is not None:
                bar = inner[1]
                self.bar.max = bar.total if bar.total else max(bar.step, 1)
                self.bar.value = min(bar.step, self.bar.max)
            if record.state == "finished":
                self.bar.bar_style = "success"
                if inner is None or not inner[1].total:
                    self.bar.max, self.bar.value = 1, 1
            elif record.state == "failed":
                self.bar.bar_style = "danger"
            self.bar.style.bar_color = "#bbb" if grey else None  # a lost task's bar stops, greyed out
        colour = _STATE_COLOURS.get(record.state, "#888")
        shown = progress_text.state_or_debugger(record)
        self.state.layout.width = "115px" if shown != record.state else "70px"  # whole, for as long as pdb waits
        self.state.value = f'<div style="{_ONE_LINE};color:{colour}">{shown}</div>'
        marker, usage = progress_text.straggler_text(record), progress_text.usage_text(record)
        if line is None:
            line = _last_line(record, LINE_CHARS)
        self.line.value = _last_line_html(line, "#999" if grey else "#555", rule=bool(marker or usage), steps=steps)
        self.usage.value = ((f'<span class="hvdmagic-straggler" style="color:#d62728;font-weight:600" '
                             f'title="{html.escape(record.straggler.describe())}">{html.escape(marker)}</span> '
                             if marker else "")
                            + (f'<span class="hvdmagic-usage" style="font-family:{_MONO};font-size:12px;'
                               f'color:#555">{html.escape(usage)}</span>' if usage else ""))

    def draw_group(self, run: RunRecord, group: grouping.Group, epochs: bool, now: float, counted: bool) -> None:
        """A many-rank run's row for ``group``: drawn as the rank that stands for it (its slowest),
        named by the rank list, and the last line says the members' step range and whose line it is."""
        record = group.slowest
        if record.rank != getattr(self, "_stands_for", None):  # another rank's steps: its own rate from here
            self._stands_for, self.meter, self._bar_key = record.rank, progress_text.Meter(), None
        name = html.escape(group.name(run))
        hosts = group.hosts()
        where = f" <small>@ {html.escape(hosts[0])}</small>" if len(hosts) == 1 else (
            f" <small>· {len(hosts)} hosts</small>" if hosts else "")
        reason = (f' <span class="hvdmagic-reason" style="color:#b26b00">{html.escape(group.reason)}</span>'
                  if group.reason else "")
        label = (f'<div style="{_ONE_LINE};{_SHRINKS}" title="{name}"><b>{name}</b>{reason}'
                 f"{where if not group.reason else ''}</div>")
        column, steps = _step_range(group)
        last = _last_line(record, LINE_CHARS)
        if last and len(group.members) > 1:
            last = f"[{record.rank}] {last}"  # whose line it is
        self.draw(run, record, epochs, now, counted, label=label, line=last, count_column=column, steps=steps)
        if len(group.members) > 1:
            self.box.add_class("hvdmagic-group")
        else:
            self.box.remove_class("hvdmagic-group")


class _AllRanks:
    """Every rank's series of each metric, built incrementally from the record's history.

    Only rows added since the last call are read, as copies (a buffer held on the record's
    arrays would stop the job thread from extending them).
    """

    def __init__(self):
        self.done = 0
        self.series: dict[str, dict[int, tuple[array, array]]] = {}

    def update(self, history) -> dict[str, list[charts.Series]]:
        import numpy as np

        columns = list(history.columns.items())
        rows = min([len(history.ranks), len(history.steps)] + [len(column) for _, column in columns])
        if rows > self.done:
            start, self.done = self.done, rows
            ranks = np.frombuffer(history.ranks[start:rows], dtype=np.int32)
            steps = np.frombuffer(history.steps[start:rows], dtype=np.float64)
            present_ranks = np.unique(ranks)
            for name, column in columns:
                raw = column[start:rows].tobytes()
                values = np.frombuffer(raw, dtype=np.float64)
                logged = np.frombuffer(raw, dtype=np.uint64) != GAP_BITS
                by_rank = self.series.setdefault(name, {})
                for rank in present_ranks:
                    mask = logged & (ranks == rank)
                    if not mask.any():
                        continue
                    xs, ys = by_rank.setdefault(int(rank), (array("d"), array("d")))
                    xs.frombytes(steps[mask].tobytes())
                    ys.frombytes(values[mask].tobytes())
        return {name: [(f"rank {rank}", xs, ys) for rank, (xs, ys) in sorted(by_rank.items())]
                for name, by_rank in self.series.items()}


class _ControlRoute:
    """Lets the chart controls work while the cell runs.

    A running cell holds the kernel's main shell, and the front end's messages for widgets
    wait behind it until the cell ends. ipykernel 7 can route a comm's messages to a
    subshell (its own thread) instead: this creates one and routes the controls' comms to
    it, so a click reaches the dashboard at once. Without subshells (ipykernel 6) a click
    would wait for the run to end, so the dashboard leaves the controls out.
    """

    def __init__(self, controls: list[widgets.Widget]):
        self.subshell: str | None = None
        self._comms = []
        try:
            from IPython import get_ipython

            kernel = getattr(get_ipython(), "kernel", None)
            if kernel is None or not getattr(kernel, "_supports_kernel_subshells", False):
                return
            thread = kernel.shell_channel_thread
            manager = thread.manager
            created: list = []
            ready = threading.Event()

            def create():
                try:
                    created.append(manager._create_subshell())
                finally:
                    ready.set()

            thread.io_loop.add_callback(create)
            if not ready.wait(5) or not created:
                return
            self.subshell, self._thread, self._manager = created[0], thread, manager
        except Exception:  # an ipykernel without these internals: the controls wait for the cell
            return
        subshell = self.subshell
        for control in controls:
            comm = getattr(control, "comm", None)
            if comm is not None and hasattr(comm, "_reply_subshell_for"):
                comm._reply_subshell_for = lambda data, default, _id=subshell: _id  # read by the shell channel
                self._comms.append(comm)

    def close(self) -> None:
        for comm in self._comms:
            comm.__dict__.pop("_reply_subshell_for", None)
        self._comms = []
        if self.subshell is not None:
            subshell, manager, self.subshell = self.subshell, self._manager, None
            try:
                self._thread.io_loop.add_callback(lambda: manager._delete_subshell(subshell))
            except Exception:
                pass


def _descendants(widget: widgets.Widget) -> Iterator[widgets.Widget]:
    """A widget and every widget it holds: children, layouts, styles."""
    seen: set[int] = set()
    stack = [widget]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        for name in current.keys:
            value = getattr(current, name, None)
            if isinstance(value, widgets.Widget):
                stack.append(value)
            elif isinstance(value, (tuple, list)):
                stack.extend(v for v in value if isinstance(v, widgets.Widget))


class Dashboard:
    def __init__(self, record: RunRecord):
        self.record = record
        self.handle = None  # the DisplayHandle of the displayed dashboard
        self.text_handle = None  # the DisplayHandle of the live text/plain, beside it
        self.draw_error: BaseException | None = None  # the first exception a redraw raised, if any
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drawn_version = -1
        self._drawn_metrics: tuple | None = None
        self._drawn_logs: tuple | None = None
        self._drawn_recent = -1  # the first frame draws the pane, with or without lines
        self._last_done: float | None = None
        self._controls_version = 0
        self._route: _ControlRoute | None = None
        self._controls_work = True  # False in a kernel whose busy shell would hold the controls' messages
        self._own_notes: list[str] = []  # the dashboard's own, not the run's: shown live, not in the snapshot
        self._overall = progress_text.Meter(smoothing=0.1)
        self._all_ranks = _AllRanks()
        self._text_shown = ""
        self._text_due = 0.0  # time.monotonic() of the next update of the live text/plain

        self.header = widgets.HTML(layout=widgets.Layout(overflow="hidden"))
        # Horovod's stall reports (record.hang_notices), under the header: a hang is the news of the run.
        self.hangs = widgets.HTML(layout=widgets.Layout(display="none"))
        self._drawn_hangs: tuple | None = None
        self.overall_bar = widgets.FloatProgress(value=0, min=0, max=1, layout=widgets.Layout(width="300px"))
        # The rest of the row, and no more: in a narrow output area its one line ends in an ellipsis.
        self.overall_text = widgets.HTML(layout=widgets.Layout(flex="1 1 auto", min_width="0", overflow="hidden"),
                                         _dom_classes=["hvdmagic-overall-text"])
        # The overall bar's row: from the first frame where the cell looks like it drives bars (kernel.magic),
        # with a line that says what will come, so nothing below it moves when it does; else once a rank steps.
        if record.bars_expected:
            self.overall_text.value = (f'<div style="color:#999;font-size:12px;{_ONE_LINE}">the run\'s progress '
                                       "shows here once the ranks step</div>")
        self.overall = widgets.HBox(
            [widgets.HTML("<b>overall</b>", layout=widgets.Layout(width="120px")), self.overall_bar,
             self.overall_text],
            layout=widgets.Layout(display=None if record.bars_expected else "none", height="30px",
                                  align_items="center", overflow="hidden"))
        # An elastic run's label holds its task and its rank now: "task 2 · rank 1 @ host".
        # A many-rank run (grouping.is_grouped) gets grouped rows instead, from a pool that grows
        # to the number of groups, and every rank's own row as text one click away.
        self.grouped = grouping.is_grouped(record)
        self.rows = [] if self.grouped else [_RankRow(r, "180px" if record.elastic else "120px")
                                             for r in range(record.np)]
        # Made only for a many-rank run: a widget made and not shown would be left open at the end.
        self.group_rows = widgets.VBox(layout=widgets.Layout(overflow="hidden")) if self.grouped else None
        self.every_rank = widgets.HTML() if self.grouped else None
        self._every_rank_shown = ""
        self._group_pool: list[_RankRow] = []
        self._logs_due = 0.0  # time.monotonic() from which a many-rank run's log panes may redraw
        self.recent = widgets.HTML()  # drawn at the first frame, empty or not (_draw_recent)
        self.scale = widgets.ToggleButtons(options=list(charts.SCALES), value="auto",
                                           tooltips=["log when a metric spans two decades", "linear", "log"],
                                           style={"button_width": "64px"})
        self.smoothing = widgets.FloatSlider(value=0.0, min=0.0, max=0.99, step=0.01, description="smoothing",
                                             continuous_update=False, readout_format=".2f",
                                             style={"description_width": "70px"},
                                             layout=widgets.Layout(width="280px"))
        self.overlay = widgets.Checkbox(value=False, description="all ranks", indent=False,
                                        layout=widgets.Layout(width="110px"))
        for control in (self.scale, self.smoothing, self.overlay):
            control.observe(self._control_changed, names="value")
        self.controls = widgets.HBox([widgets.HTML("scale", layout=widgets.Layout(width="40px")), self.scale,
                                      self.smoothing, self.overlay],
                                     layout=widgets.Layout(display="none", align_items="center", flex_flow="row wrap"))
        # "Where are the ranks?": every running rank's Python stacks now, grouped (record.ask_where).
        self.where_button = widgets.Button(description="where are the ranks?", icon="search",
                                           tooltip="show where every rank's code is now (its Python stacks)",
                                           layout=widgets.Layout(width="190px", display="none"))
        self.where_button.on_click(lambda _button: self.record.ask_where())
        self.where = widgets.HTML()
        self._drawn_where: tuple | None = None
        self.charts = widgets.HTML()
        if record.charts_expected:  # room for a row of charts and their controls from the first frame
            self.charts.value = ('<div style="height:130px;box-sizing:border-box;padding:4px;color:#999;'
                                 "font-size:12px\">rank 0's metrics are charted here as it logs them</div>")
            self.controls.layout.display, self.controls.layout.visibility = None, "hidden"
        self.notes = widgets.HTML()
        if self.grouped:  # three panes, not a tab per rank: every line, each line once, one rank's chosen
            self.panes = [widgets.HTML() for _ in range(3)]
            noun = "task" if record.elastic else "rank"
            self.log_rank = widgets.Dropdown(options=[(f"{noun} {r}", r) for r in range(record.np)], value=0,
                                             description=noun, layout=widgets.Layout(width="180px"),
                                             style={"description_width": "40px"})
            # The next redraw draws the chosen rank's log (the helper thread draws; this runs in a subshell's).
            self.log_rank.observe(lambda _change: setattr(self, "_drawn_logs", None), names="value")
            tabs = [self.panes[0], self.panes[1], widgets.VBox([self.log_rank, self.panes[2]])]
            titles = ["all ranks", "each line once", f"one {noun}"]
            rows = [self.group_rows, titled(widgets.Accordion(children=[self.every_rank], selected_index=None,
                                                              _dom_classes=["hvdmagic-every-rank"]),
                                            [f"every {noun} ({record.np})"])]
        else:
            self.panes = [widgets.HTML() for _ in range(record.np + 1)]  # "all ranks" first
            tabs = self.panes
            titles = ["all ranks"] + [progress_text.row_name(record, r) for r in range(record.np)]
            rows = [row.box for row in self.rows]
        self.logs = titled(widgets.Tab(children=tabs), titles)
        # The style that lets the rows' columns give way in a narrow output area (row_fit), this dashboard's only.
        self.fit = widgets.HTML(layout=widgets.Layout(display="none"))
        self._fit_scope = f"hvdmagic-fit-{next(_DASHBOARDS)}"
        self._fit_columns: row_fit.Columns | None = None
        self.box = widgets.VBox([
            self.fit, self.header, self.hangs, self.overall, *rows, self.recent,
            self.where_button, self.where, self.controls, self.charts, self.notes,
            titled(widgets.Accordion(children=[self.logs], selected_index=None), ["logs"]),
        ], _dom_classes=["hvdmagic-dashboard", self._fit_scope])
        self.text_carrier = widgets.Box(layout=widgets.Layout(display="none"))

    # -- the view protocol ----------------------------------------------------
    def start(self) -> None:
        # The route first: a dashboard built late may show its charts, and so its controls, at the first draw.
        self._route = _ControlRoute([self.scale, self.smoothing, self.overlay, self.where_button,
                                     *([self.log_rank] if self.grouped else [])])
        self._controls_work = self._route.subshell is not None
        global _controls_note_said
        if not self._controls_work and not _controls_note_said:
            _controls_note_said = True
            self._own_notes.append(CONTROLS_NEED_SUBSHELLS)
        self._draw()
        bundle = view_bundle(self.box)
        bundle["text/plain"] = self.placeholder_text()
        self.handle = display(bundle, raw=True, display_id=True)
        self._text_shown = self.fallback_text()
        self._text_due = time.monotonic() + FALLBACK_INTERVAL
        self.text_handle = display(self._text_bundle(self._text_shown), raw=True, display_id=True)
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._loop,), name="hvdmagic-dashboard", daemon=True)
        self._thread.start()

    def on_event(self, event: dict) -> None:
        pass  # everything is in the record; the helper thread redraws from it

    def close(self) -> None:
        """Stop redrawing, replace the output with the run's snapshot and close the widgets."""
        self._stop_drawing()
        if self.handle is None:  # never displayed (no IPython): the widgets' final state is all there is
            self._draw(force=True)
            return
        try:
            from hvdmagic.kernel.ui.snapshot import Snapshot

            self.handle.update(Snapshot(self.record))
        except Exception as exc:  # keep the live widgets, drawn in their final state, rather than nothing
            self.draw_error = self.draw_error or exc
            self._draw(force=True)
            return
        if self.text_handle is not None:
            try:  # before its hidden box closes, or a front end would look for the closed model
                self.text_handle.update(ENDED_TEXT_BUNDLE, raw=True)
            except Exception as exc:
                self.draw_error = self.draw_error or exc
        self._close_widgets()

    def discard(self) -> None:
        """Stop redrawing and close every widget, showing nothing in their place."""
        self._stop_drawing()
        self._close_widgets()

    def _stop_drawing(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._route is not None:
            self._route.close()

    def _close_widgets(self) -> None:
        # The group rows a many-rank run no longer shows are in its pool, not in the box: closed too.
        pooled = [widget for row in self._group_pool for widget in _descendants(row.box)]
        for widget in [*_descendants(self.box), *_descendants(self.text_carrier), *pooled]:
            widget.close()

    def placeholder_text(self) -> str:
        """The widgets' own text/plain: what a front end without widgets shows in their place."""
        record = self.record
        return (f"{record.command} {progress_text.size_text(record)}: live dashboard (widgets); "
                "the run's final state replaces this output when it ends")

    def fallback_text(self, now: float | None = None) -> str:
        """The run as text while it is live, for a front end that does not render widgets: the
        header's state, stage and elapsed time, then a row per rank with its state and last line."""
        record = self.record
        now = time.time() if now is None else now
        word = "interrupted" if record.state == "cancelled" else record.state
        head = [f"{record.command} {progress_text.size_text(record)}: {word}"]
        stage = progress_text.run_stage(record, now)
        if stage is not None:
            head.append(stage)
        head.append(progress_text.elapsed_text((record.ended or now) - record.started))
        ranks = list(record.ranks)
        epochs = any(progress_text.pick_bars(dict(rank.bars))[0] is not None for rank in ranks)
        width = max(len(progress_text.row_name(record, rank.rank)) for rank in ranks) if ranks else 0
        lines = [" · ".join(head)]
        lines.extend(notice.line() for notice in record.hang_notices)
        if lagging := progress_text.stragglers_line(record, live=record.ended is None):
            lines.append(lagging)
        if self.grouped:
            return "\n".join(lines + self._group_text(epochs, now))
        for rank in ranks:
            row = progress_text.row(rank, epochs=epochs, now=now, bar_width=10)
            last = _last_line(rank, TEXT_LINE_CHARS)
            usage = " ".join(part for part in (progress_text.straggler_text(rank), progress_text.usage_text(rank))
                             if part)
            lines.append(f"{progress_text.row_name(record, rank.rank):<{width}} {row} "
                         f"{progress_text.row_state(rank):<9} {progress_text.figures_and_line(usage, last)}".rstrip())
        return "\n".join(lines)

    def _group_text(self, epochs: bool, now: float) -> list[str]:
        """A many-rank run's rows as text: a row per group (grouping.rows), as its slowest rank reads."""
        record = self.record
        groups = grouping.rows(record)
        names = [group.name(record) for group in groups]
        width = max(map(len, names), default=0)
        lines = []
        for name, group in zip(names, groups):
            rank = group.slowest
            column, steps = _step_range(group)
            row = progress_text.row(rank, epochs=epochs, now=now, bar_width=10, steps=column)
            state = progress_text.row_state(rank) + (f", {group.reason}" if group.reason else "")
            last = _last_line(rank, TEXT_LINE_CHARS)
            if last and len(group.members) > 1:
                last = f"[{rank.rank}] {last}"
            tail = " · ".join(part for part in (steps, last) if part)
            lines.append(f"{name:<{width}} {row} {state:<9} {tail}".rstrip())
        return lines

    def _text_bundle(self, text: str) -> dict:
        bundle = view_bundle(self.text_carrier)
        bundle["text/plain"] = text
        return bundle

    def _update_text(self, now: float | None = None) -> None:
        """The live text/plain, at most every FALLBACK_INTERVAL (``now``: ``time.monotonic()``)
        and only when it changed."""
        now = time.monotonic() if now is None else now
        if self.text_handle is None or now < self._text_due:
            return
        self._text_due = now + FALLBACK_INTERVAL
        if self.grouped:  # every rank's row, folded away: as often as the text, not at every redraw
            self._draw_every_rank()
        text = self.fallback_text()
        if text != self._text_shown:
            self._text_shown = text
            self.text_handle.update(self._text_bundle(text), raw=True)

    # -- drawing ----------------------------------------------------------------
    def _control_changed(self, change) -> None:
        self._controls_version += 1

    def _loop(self) -> None:
        while not self._stop.wait(1 / MAX_FPS):
            for step in (self._draw, self._update_text):
                try:
                    step()
                except Exception as exc:  # a drawing problem must never end the run
                    self.draw_error = self.draw_error or exc

    def _draw(self, force: bool = False) -> None:
        record = self.record
        now = time.time()
        version = record.version
        self._draw_header(now)
        epochs = False
        if force or version != self._drawn_version or record.state in ("launching", "running"):
            bars = [dict(rank.bars) for rank in record.ranks]
            epochs = any(progress_text.pick_bars(b)[0] is not None for b in bars)
            counted = any(bars)
            for row, rank in zip(self.rows, record.ranks):
                row.draw(record, rank, epochs, now, counted)
            if self.grouped:
                self._draw_groups(epochs, now, counted)
            self._draw_overall(now)
            self._draw_fit(epochs)
        self._draw_recent()
        self._draw_where()
        self._draw_metrics(force)
        if force or version != self._drawn_version:
            self._draw_logs()
            self._draw_notes()
            self._draw_hangs()
        elif self._drawn_logs is None:  # another rank chosen for the "one rank" pane
            self._draw_logs()
        if force and self.grouped:
            self._draw_every_rank(now)
        self._drawn_version = version

    def _draw_fit(self, epochs: bool) -> None:
        label = 170 if self.grouped else 180 if self.record.elastic else 120
        usage = max((len(" ".join(filter(None, (progress_text.straggler_text(rank), progress_text.usage_text(rank)))))
                     for rank in self.record.ranks), default=0)
        columns = row_fit.Columns(label, epochs, usage)
        if columns != self._fit_columns:
            self._fit_columns = columns
            self.fit.value = row_fit.css(self._fit_scope, columns)

    def _draw_groups(self, epochs: bool, now: float, counted: bool) -> None:
        """A many-rank run's rows: a row per group of ranks that read the same (grouping.rows)."""
        groups = grouping.rows(self.record)
        while len(self._group_pool) < len(groups):
            self._group_pool.append(_RankRow(0, "170px"))
        if len(self._group_pool) > len(groups) or len(self.group_rows.children) != len(groups):
            self.group_rows.children = [row.box for row in self._group_pool[:len(groups)]]
        for row, group in zip(self._group_pool, groups):
            row.draw_group(self.record, group, epochs, now, counted)

    def every_rank_text(self, now: float | None = None) -> str:
        """Every rank's own row as text, a line each: a many-rank run's full detail, one click away."""
        record = self.record
        now = time.time() if now is None else now
        ranks = list(record.ranks)
        epochs = any(progress_text.pick_bars(dict(rank.bars))[0] is not None for rank in ranks)
        width = max((len(progress_text.row_name(record, rank.rank)) for rank in ranks), default=0)
        return "\n".join(
            f"{progress_text.row_name(record, rank.rank):<{width}} {progress_text.row(rank, epochs=epochs, now=now)} "
            f"{progress_text.row_state(rank):<9} {_last_line(rank, TEXT_LINE_CHARS)}"
            .rstrip() for rank in ranks)

    def _draw_every_rank(self, now: float | None = None) -> None:
        text = self.every_rank_text(now)
        if text != self._every_rank_shown:
            self._every_rank_shown = text
            self.every_rank.value = (f'<pre class="hvdmagic-every-rank-rows" style="margin:0;font-family:{_MONO};'
                                     f'font-size:12px;line-height:17px;max-height:400px;overflow:auto">'
                                     f"{html.escape(text)}</pre>")

    def _draw_hangs(self) -> None:
        notices = self.record.hang_notices
        drawn = tuple((notice.line(), notice.reports) for notice in notices)
        if drawn == self._drawn_hangs:
            return
        self._drawn_hangs = drawn
        self.hangs.value = hang_notices_html(self.record)
        self.hangs.layout.display = None if notices else "none"

    def _draw_header(self, now: float) -> None:
        record = self.record
        colour = _STATE_COLOURS.get(record.state, "#888")
        word = "interrupted" if record.state == "cancelled" else record.state
        state = f'<span class="hvdmagic-state" style="color:{colour};font-weight:600">{word}</span>'
        if record.state == "failed":
            state += f'<span style="color:{colour}">: see the error below</span>'
        items = [f"<b>{html.escape(record.command)}</b>", state]
        stage = progress_text.run_stage(record, now)
        if stage is not None:
            items.append(f'<span class="hvdmagic-stage">{html.escape(stage)}</span>')
        items.append(progress_text.elapsed_text((record.ended or now) - record.started))
        items.append(progress_text.size_text(record))
        if record.job_group:
            items.append(f"Spark job group <code>{html.escape(record.job_group)}</code>")
        header = f'<div style="{_ONE_LINE}">' + " · ".join(items) + "</div>"
        if lagging := progress_text.stragglers_line(record, live=record.ended is None):
            header += f'<div class="hvdmagic-stragglers" style="{_ONE_LINE};color:#d62728">{html.escape(lagging)}</div>'
        self.header.value = header

    def _draw_overall(self, now: float) -> None:
        found = progress_text.run_fraction(self.record)
        if found is None:
            return
        done, outer = found
        if done != self._last_done:  # only when it moves: the ranks report every 100 ms, this runs every 100 ms
            self._last_done = done
            self._overall.update(done, now)
        rate = self._overall.rate
        eta = (1 - done) / rate if rate and done < 1 and self.record.state == "running" else None
        with self.overall_bar.hold_sync():
            self.overall_bar.value = done
            if self.record.state == "finished":
                self.overall_bar.bar_style = "success"
            elif self.record.state == "failed":
                self.overall_bar.bar_style = "danger"
        self.overall_text.value = _mono(progress_text.overall_text(done, outer, eta))
        self.overall.layout.display = None

    def _draw_where(self) -> None:
        """The button while the run is live (and a click can reach the kernel mid-run); the answers."""
        record = self.record
        live = record.state in ("launching", "running") and self._controls_work
        self.where_button.layout.display = "" if live else "none"
        drawn = (record.where_asked, len(record.where), live)
        if drawn == self._drawn_where:
            return
        self._drawn_where = drawn
        if record.where_asked is None:
            return
        answers = dict(record.where)
        noun = "task" if record.elastic else "rank"  # an elastic run's rows are tasks: its ranks change
        lines = [f"asked at {time.strftime('%H:%M:%S', time.localtime(record.where_asked))}: "
                 f"{len(answers)} of {record.np} {noun}s answered",
                 *(stacks.describe(answers, noun)[1:] if answers else [])]
        self.where.value = (f"<pre class='hvdmagic-where' style='margin:2px 0;max-height:300px;overflow:auto'>"
                            f"{html.escape(chr(10).join(lines))}</pre>")

    def _draw_recent(self) -> None:
        logs = self.record.all_logs
        count = len(logs)
        if count == self._drawn_recent:
            return
        self._drawn_recent = count
        width = len(str(self.record.np - 1))
        if self.grouped:  # each line once, with the ranks that printed it
            blocks, _ = grouping.grouped_lines(self.record, per_rank=RECENT_LINES, limit=RECENT_LINES)
            lines = "".join(html.escape(f"[{block.name()}] {_clean(line)}") + "\n"
                            for block in blocks for _, line in block.lines)
        else:
            cut = self.record.all_logs_at_failure
            before = logs if cut is None else logs[:cut]
            after = [] if cut is None else logs[cut:]
            lines = "".join(html.escape(f"[{rank:>{width}}] {_clean(line)}") + "\n"
                            for rank, _, line in before[-(RECENT_LINES - bool(after)):])
            if after:  # the stop's fallout, folded under the line that says so
                counts = [0] * self.record.np
                for rank, _, _ in after:
                    counts[rank] += 1
                folded = html.escape(progress_text.after_failure_line(counts))
                lines += f'<span style="color:#888">{folded}</span>'
        self.recent.value = _recent_html(lines)

    def series(self) -> dict[str, list[charts.Series]]:
        """What the charts show: rank 0's series of each metric, or every rank's with "all ranks"."""
        if self.overlay.value:
            return self._all_ranks.update(self.record.history)
        return charts.series_by_metric(dict(self.record.rank0_series))

    def _draw_metrics(self, force: bool) -> None:
        rows = len(self.record.history)
        key = (rows, self._controls_version)
        if not rows or (key == self._drawn_metrics and not force):
            return
        self._drawn_metrics = key
        series = self.series()
        html_text = charts.metrics_html(series, scale=self.scale.value, smoothing=self.smoothing.value)
        # The snapshot keeps the scale each chart had here last, chosen or "auto"'s, not auto's pick for the end.
        self.record.chart_scales = charts.scales_shown(series, self.scale.value)
        if html_text:
            self.charts.value = html_text
            if self._controls_work:
                self.controls.layout.display, self.controls.layout.visibility = None, "visible"

    def _draw_logs(self) -> None:
        record = self.record
        counts = (len(record.all_logs), *(len(rank.logs) for rank in record.ranks))
        if counts == self._drawn_logs:
            return
        if self.grouped and self._drawn_logs is not None and time.monotonic() < self._logs_due and record.ended is None:
            return  # grouping every rank's last lines costs a pass over them all: once a second is enough here
        self._logs_due = time.monotonic() + FALLBACK_INTERVAL
        self._drawn_logs = counts
        merged = [(f"[{rank}] ", line) for rank, _, line in record.all_logs[-LOG_LINES:]]
        panes = [(merged, counts[0], "hvdmagic.last_run().logs")]
        if self.grouped:
            blocks, left_out = grouping.grouped_lines(record, per_rank=GROUPED_TAIL, limit=LOG_LINES)
            panes.append(([(f"[{block.name()}] ", line) for block in blocks for _, line in block.lines],
                          sum(len(block.lines) for block in blocks) + left_out,
                          "hvdmagic.last_run().logs"))
            chosen = record.ranks[self.log_rank.value]
            panes.append(([("", line) for _, line in chosen.logs[-LOG_LINES:]], len(chosen.logs),
                          f"hvdmagic.last_run().logs[{chosen.rank}]"))
        for rank in record.ranks if not self.grouped else ():
            panes.append(([("", line) for _, line in rank.logs[-LOG_LINES:]], len(rank.logs),
                          f"hvdmagic.last_run().logs[{rank.rank}]"))
        for widget, (lines, count, where) in zip(self.panes, panes):
            dropped = count - len(lines)
            note = (f"<i>{dropped} older line(s) not shown here; the full log is in <code>{where}</code></i>\n"
                    if dropped > 0 else "")
            body = "".join(html.escape(prefix + _clean(line)) + "\n" for prefix, line in lines)
            widget.value = f"<pre style='max-height:300px;overflow:auto;margin:0'>{note}{body}</pre>"

    def _draw_notes(self) -> None:
        record = self.record
        notes = [html.escape(note) for note in [*record.notes, *self._own_notes]]
        if shipped := record.shipping_note():
            notes.append(html.escape(shipped))
        if record.timeline and record.ended is not None:
            notes.append(html.escape(describe(record.timeline)))
        self.notes.value = "".join(f"<pre style='margin:2px 0'>{note}</pre>" for note in notes)
