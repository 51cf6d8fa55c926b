"""The in-rank reporting API, the metrics path to the driver, the dashboard and its text twin."""

from __future__ import annotations

import io
import json
import math
import os
import sys
import threading
import time
from array import array

import pytest
from conftest import run
from helpers import wait_until

import hvdmagic
from hvdmagic.errors import JobFailed, RankFailure
from hvdmagic.kernel.record import RankRecord, RunRecord
from hvdmagic.kernel.ui import text as text_ui
from hvdmagic.launch.placement import Placement
from hvdmagic.metric_rows import GAP_ROW, MetricRows, decode
from hvdmagic.rank import telemetry

pytestmark = pytest.mark.profile  # ipywidgets 7 and 8 alike (make test-profiles)


@pytest.mark.unit
def test_api_is_a_harmless_noop_outside_a_run():
    assert "HVDMAGIC_EVENT_FD" not in os.environ
    hvdmagic.progress(1, total=10, desc="x")
    hvdmagic.log_metrics(step=1, loss=0.5)
    assert list(hvdmagic.track(range(3), desc="y")) == [0, 1, 2]


def test_every_rank0_metric_reaches_the_driver_in_order(ip):
    result, error = run(ip, """%%horovod --np -2 --metrics history
import numpy as np, hvdmagic
for i in range(20000):
    hvdmagic.log_metrics(step=i, loss=np.float32(1.0) / (i + 1), twice=2 * i)
"done"
""")
    assert error is None and result == "done"
    history = ip.user_ns["history"]
    rank0 = history[history["rank"] == 0]
    assert rank0["step"].tolist() == list(range(20000)), "rank 0's metrics history has gaps or is out of order"
    assert (rank0["twice"] == 2 * rank0["step"]).all()
    assert len(history[history["rank"] == 1]) == 20000
    record = hvdmagic.last_run()
    assert record.latest_metrics()["twice"] == (19999, 39998)


def test_log_metrics_rejects_what_is_not_a_number(ip):
    _, error = run(ip, "%%horovod --np -1\nimport hvdmagic\nhvdmagic.log_metrics(loss='low')")
    assert isinstance(error, JobFailed)
    assert "log_metrics(loss=...) needs a number, not str" in str(error)


def test_sparse_metrics_a_logged_nan_and_a_refused_call_keep_the_history_exact(ip):
    result, error = run(ip, """%%horovod --np -1 --metrics history
import hvdmagic
hvdmagic.log_metrics(step=0, loss=3.0)
hvdmagic.log_metrics(step=1, val=0.5)
try:
    hvdmagic.log_metrics(step=2, loss=1.0, extra="high")
except TypeError as e:
    refused = str(e)
hvdmagic.log_metrics(step=2, loss=float("nan"))
refused
""")
    assert error is None and result == "log_metrics(extra=...) needs a number, not str"
    history = ip.user_ns["history"]
    assert history["step"].tolist() == [0, 1, 2] and "extra" not in history, "the refused call left a row behind"
    assert history["loss"][0] == 3.0 and math.isnan(history["loss"][1]) and math.isnan(history["loss"][2])
    assert math.isnan(history["val"][0]) and history["val"][1] == 0.5
    record = hvdmagic.last_run()
    steps, values = record.rank0_series["loss"]
    assert list(steps) == [0, 2] and values[0] == 3.0 and math.isnan(values[1])  # the row without loss is skipped
    step, latest = record.latest_metrics()["loss"]
    assert step == 2 and math.isnan(latest), "a NaN the user logged must show as the latest value"
    from hvdmagic.kernel.ui.charts import chart_html

    chart = chart_html("loss", [("rank 0", steps, values)])
    assert ">nan<" in chart and all("nan" not in points.split('"')[0] for points in chart.split('points="')[1:]), \
        "the NaN must be labelled, not plotted"


@pytest.fixture
def live_report(monkeypatch):
    """telemetry as inside a rank; yields what it sends."""
    sent = io.StringIO()
    monkeypatch.setattr(telemetry, "_events", sent)
    monkeypatch.setattr(telemetry, "_rows", MetricRows())
    monkeypatch.setattr(telemetry, "_metric_steps", 0)
    monkeypatch.setattr(telemetry, "_progress_sent", {})
    yield sent


@pytest.mark.unit
def test_rows_taken_while_a_rank_logs_are_neither_lost_nor_repeated(live_report):
    sent = live_report
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads interleave as often as the interpreter allows
    stop = threading.Event()

    def flusher():
        while not stop.is_set():
            telemetry.flush()

    thread = threading.Thread(target=flusher)
    thread.start()
    try:
        for i in range(30000):
            telemetry.log_metrics(step=i, **({"loss": i} if i % 3 else {"acc": -i}))
    finally:
        stop.set()
        sys.setswitchinterval(switch)
        thread.join(timeout=30)
    assert not thread.is_alive(), "the flushing thread did not stop"
    telemetry.flush()
    steps, loss, acc, batches = array("d"), array("d"), array("d"), 0
    for line in sent.getvalue().splitlines():
        event = json.loads(line)
        if "metrics" in event:
            batch_steps, _, columns = decode(event["metrics"])
            steps.extend(batch_steps)
            loss.extend(columns.get("loss", GAP_ROW * len(batch_steps)))
            acc.extend(columns.get("acc", GAP_ROW * len(batch_steps)))
            batches += 1
    assert batches > 1, "the flusher never took rows while the loop logged"
    assert list(steps) == list(range(30000))
    assert all((loss[i] == i and math.isnan(acc[i])) if i % 3 else (acc[i] == -i and math.isnan(loss[i]))
               for i in range(30000)), "a value landed in the wrong row"


@pytest.mark.unit
def test_log_metrics_counts_steps_converts_values_at_once_and_marks_gaps(live_report):
    import weakref

    import numpy as np
    import torch

    sent = live_report
    loss = torch.tensor(0.5)
    tensor = weakref.ref(loss)
    telemetry.log_metrics(a=1.0, b=2)  # no step: 0
    telemetry.log_metrics(b=True, a=loss)  # the other order of names; a tensor and a bool
    del loss
    assert tensor() is None, "log_metrics kept the tensor alive until the flush"
    telemetry.flush()
    telemetry.log_metrics(step=10, epoch=3)  # an int becomes a float
    telemetry.log_metrics(a=np.float32(4.5))  # a numpy scalar, no step: one after the previous call's
    with pytest.raises(TypeError, match=r"^log_metrics\(step=...\) needs a number, not str$"):
        telemetry.log_metrics(step="x", a=1.0)
    with pytest.raises(OverflowError, match=r"^log_metrics\(a=...\) is too large for a float$"):
        telemetry.log_metrics(a=10**400, b=1.0)
    telemetry.flush()
    batches = [decode(json.loads(line)["metrics"]) for line in sent.getvalue().splitlines()]
    assert [list(steps) for steps, _, _ in batches] == [[0, 1], [10, 11]], "refused calls left rows behind"
    first, second = batches[0][2], batches[1][2]
    assert list(first) == ["a", "b"] and list(first["a"]) == [1.0, 0.5] and list(first["b"]) == [2.0, 1.0]
    assert list(second) == ["epoch", "a"] and second["epoch"][0] == 3.0 and second["a"][1] == 4.5
    assert math.isnan(second["epoch"][1]) and math.isnan(second["a"][0]), "a metric a call skipped needs a gap"


@pytest.mark.unit
def test_a_malformed_metrics_batch_is_dropped_whole_and_noted():
    record = RunRecord(Placement.of(1))
    batch = metric_batch([0, 1], [1.0, 2.0], {"loss": [1.0, 2.0]})
    batch["rows"] = 3  # every column is one row short
    record.apply({"type": "report", "rank": 0, "metrics": batch})
    assert len(record.history) == 0 and not record.history.columns, "part of a bad batch reached the history"
    assert record.notes == ["rank 0 sent a malformed metrics batch, which was dropped: "
                            "metric column of 16 bytes for 3 rows"]


def test_track_reports_progress_and_the_text_twin_is_deterministic(ip, capfd):
    cell = """%%horovod --np -2
import hvdmagic, horovod.torch as hvd
hvd.init()
for batch in hvdmagic.track(range(40), desc="epoch 1"):
    hvdmagic.log_metrics(loss=1.0 / (batch + 1))
"""
    summaries = []
    for _ in range(2):
        _, error = run(ip, cell)
        assert error is None
        out = capfd.readouterr().out
        summaries.append([line for line in out.splitlines() if line.startswith(("rank ", "%%horovod"))])
    assert summaries[0] == summaries[1]
    assert summaries[0] == [
        "%%horovod np=2 (local): finished",
        "rank 0: epoch 1 40/40 [finished]",
        "rank 1: epoch 1 40/40 [finished]",
        "rank 0 metrics at step 39: loss=0.025",
    ]


def test_last_run_holds_logs_timings_and_result(ip):
    _, error = run(ip, "%%horovod --np -2\nimport os\nprint('rank says', os.environ['HOROVOD_RANK'])\n41 + 1")
    assert error is None
    record = hvdmagic.last_run()
    assert record.state == "finished" and record.result == 42 and record.results == [42, 42]
    assert record.logs == {0: "rank says 0\n", 1: "rank says 1\n"}
    assert record.timings["elapsed"] > 0


@pytest.mark.unit
def test_text_twin_caps_live_output_but_keeps_every_line(capsys):
    record = RunRecord(Placement.of(1))
    view = text_ui.TextView(record, out=sys.stdout, max_lines=5)
    for i in range(3):
        event = {"type": "output", "rank": 0, "stream": "stdout", "lines": [f"l{i}a", f"l{i}b", f"l{i}c"]}
        record.apply(event)
        view.on_event(event)
    out = capsys.readouterr().out
    assert out.count("[rank 0] l") == 5
    assert "capped at 5 lines" in out and "hvdmagic.last_run().logs[0]" in out
    assert record.logs[0].count("\n") == 9


def metric_batch(steps: list, times: list, values: dict[str, list]) -> dict:
    """A metrics batch as a rank sends it; None marks a row that did not log the metric."""
    rows = MetricRows()
    rows.steps.extend(steps)
    rows.times.extend(times)
    for name, column in values.items():
        rows.columns[name] = packed = array("d")
        for value in column:
            packed.extend(GAP_ROW if value is None else array("d", [value]))
    return json.loads(rows.to_json())


def _fed_record() -> RunRecord:
    record = RunRecord(Placement.of(2))
    record.apply({"type": "launching", "description": "test", "job_group": "hvdmagic-abc"})
    for rank in (0, 1):
        record.apply({"type": "placed", "rank": rank, "host": "127.0.0.1"})
        record.apply({"type": "report", "rank": rank, "progress": {"train": [5, 10, 1.0]},
                      "metrics": metric_batch(list(range(1000)), [1.0 + s for s in range(1000)],
                                              {"loss": [1.0 / (s + 1) for s in range(1000)]})})
        record.apply({"type": "output", "rank": rank, "stream": "stdout", "lines": ["hello"] * 300})
    return record


def _widget_text(board) -> str:
    """Every value the dashboard's widgets hold, as one string."""
    from hvdmagic.kernel.ui.dashboard import _descendants

    return "\n".join(str(getattr(widget, "value", "")) for widget in _descendants(board.box))


@pytest.mark.unit
def test_dashboard_draws_rows_overall_bar_recent_lines_charts_and_logs():
    from hvdmagic.kernel.ui.dashboard import CHART_POINTS, RECENT_LINES, Dashboard

    record = _fed_record()
    record.apply({"type": "output", "rank": 0, "stream": "stdout", "lines": ["rank zero's newest"]})
    board = Dashboard(record)
    board._draw()
    assert board.draw_error is None
    assert "hvdmagic-dashboard" in board.box._dom_classes
    assert board.rows[0].bar.value == 5 and board.rows[0].bar.max == 10
    assert "train" in board.rows[0].left.value and "5/10" in board.rows[0].right.value
    # A single bar with a total spans the run: the overall bar shows the slowest rank's fraction.
    assert board.overall.layout.display is None and board.overall_bar.value == 0.5
    assert 'class="hvdmagic-chart" data-metric="loss"' in board.charts.value
    for points in board.charts.value.split('points="')[1:]:
        assert len(points.split('"')[0].split()) <= CHART_POINTS + 1  # downsampled for the screen ...
    assert len(record.rank0_series["loss"][0]) == 1000  # ... while the history stays whole
    assert "101 older line(s) not shown" in board.panes[1].value and "100 older" in board.panes[2].value
    assert "hvdmagic-abc" in board.header.value
    # The newest lines of every rank, always visible, without the collapsed logs.
    recent = board.recent.value
    assert recent.count("\n") == RECENT_LINES
    assert "[0] rank zero&#x27;s newest" in recent and "[1] hello" in recent
    # Rows keep one height: fixed, with every text on one line.
    for row in board.rows:
        assert row.box.layout.height == "30px" and "hvdmagic-rank" in row.box._dom_classes
        for part in (row.left, row.right, row.line, row.state):
            assert "white-space:pre" in part.value and "\n" not in part.value


@pytest.mark.unit
@pytest.mark.parametrize("cancelled", [False, True], ids=["failed", "interrupted"])
def test_an_error_is_shown_once_as_the_cells_error_not_in_the_views(cancelled):
    from hvdmagic.errors import JobInterrupted
    from hvdmagic.kernel.ui.dashboard import Dashboard
    from hvdmagic.kernel.ui.snapshot import Snapshot

    record = _fed_record()
    board = Dashboard(record)
    record.apply({"type": "exit", "rank": 0, "code": 0})
    if cancelled:
        error = JobInterrupted("interrupted: every rank was stopped")
    else:
        record.apply({"type": "error", "rank": 1})
        error = JobFailed([RankFailure(1, "ValueError: bad", "Traceback (most recent call last):\nValueError: bad\n")],
                          [])
    record.finish(error=error, cancelled=cancelled)
    board._draw()
    out = io.StringIO()
    text_ui.TextView(record, out=out).close()
    shown = [_widget_text(board), Snapshot(record)._repr_html_(), Snapshot(record).text(), out.getvalue()]
    for view in shown:
        assert "ValueError: bad" not in view and "Traceback" not in view and "every rank was stopped" not in view
    assert board.rows[0].bar.bar_style == "success"
    if cancelled:
        assert ">interrupted<" in board.header.value
    else:
        assert ">failed<" in board.header.value and "see the error below" in board.header.value
        assert board.rows[1].bar.bar_style == "danger"
        assert "failed (see the error below)" in out.getvalue()


@pytest.mark.unit
def test_the_header_and_rows_show_each_start_up_stage():
    from hvdmagic.kernel.ui.dashboard import Dashboard
    from hvdmagic.protocol import Stage

    record = RunRecord(Placement.of(2))
    board = Dashboard(record)
    board._draw()
    assert ">launching<" in board.header.value and "hvdmagic-stage" not in board.header.value
    record.apply({"type": "stage", "stage": Stage.SPARK_STARTING})
    record.stage_reached[Stage.SPARK_STARTING] -= 2  # reached 2 s ago
    board._draw()
    # Once per kernel, it says; and after a few seconds, that local mode needs no Spark (issue 48, point 5).
    assert "starting the embedded Spark, once per kernel, for 0:02" in board.header.value, board.header.value
    assert "without Spark" not in board.header.value
    record.stage_reached[Stage.SPARK_STARTING] -= 5
    board._draw()
    assert ("starting the embedded Spark, once per kernel, for 0:07 (--np -2 runs on this machine without Spark)"
            in board.header.value), board.header.value
    for stage in (Stage.PREPARING_DATA, Stage.WAITING_FOR_SLOTS, Stage.SUBMITTED, Stage.RANKS_STARTING):
        record.apply({"type": "stage", "stage": stage})
        board._draw()
        assert f'<span class="hvdmagic-stage">{stage} for 0:00</span>' in board.header.value
    for rank in (0, 1):
        record.apply({"type": "placed", "rank": rank, "host": "127.0.0.1"})
    record.apply({"type": "stage", "rank": 0, "stage": Stage.HVD_INIT})
    record.apply({"type": "stage", "rank": 1, "stage": Stage.TEMPLATE})  # its task starts the host's template
    board._draw()
    assert "importing into the template" in board.rows[1].left.value
    record.apply({"type": "stage", "rank": 1, "stage": Stage.FORKING})
    record.apply({"type": "stage", "rank": 1, "stage": Stage.IMPORTING})
    record.ranks[1].stage_since -= 3
    board._draw()
    assert "importing for 0:0" in board.header.value  # the slowest rank's stage
    assert "hvd.init" in board.rows[0].left.value and "importing" in board.rows[1].left.value
    assert "0:03" in board.rows[1].right.value  # the time the rank has spent in its stage
    record.apply({"type": "stage", "rank": 1, "stage": Stage.FIRST_STEP})
    record.apply({"type": "report", "rank": 0, "progress": {"train": [1, 10, 5.0]}})
    board._draw()
    assert "first step for 0:0" in board.header.value  # rank 0 trains: rank 1 is the slowest
    assert "train" in board.rows[0].left.value and "first step" in board.rows[1].left.value
    record.apply({"type": "report", "rank": 1, "progress": {"train": [1, 10, 5.0]}})
    board._draw()
    assert "hvdmagic-stage" not in board.header.value and ">running<" in board.header.value
    assert list(record.timings["stages"]) == [str(s) for s in Stage]


@pytest.mark.unit
def test_a_frameworks_import_is_named_on_its_row_and_counts_as_importing():
    """Issue 37: TensorFlow's import (seconds) read "running" with no stage, and its start-up notices,
    printed meanwhile, counted as the rank's first output: the stage list called it training."""
    from hvdmagic import protocol
    from hvdmagic.kernel.record import Bar
    from hvdmagic.kernel.ui import progress_text
    from hvdmagic.kernel.ui.dashboard import Dashboard
    from hvdmagic.protocol import Stage

    def said(rank: int, message: dict) -> None:
        record.apply({**message, "rank": rank})

    record = RunRecord(Placement.of(2))
    board = Dashboard(record)
    for rank in (0, 1):
        record.apply({"type": "placed", "rank": rank, "host": "127.0.0.1"})
        said(rank, protocol.stage_reached(Stage.IMPORTING))
        said(rank, protocol.stage_reached(Stage.IMPORTING, importing="tensorflow"))
    record.ranks[1].importing_since -= 7  # it began importing 7 s ago
    notice = ("I0000 00:00:1795806984.130133   31497 cpu_feature_guard.cc:227] This TensorFlow binary is "
              "optimized to use available CPU instructions in performance-critical operations.")
    said(0, protocol.output(0, "stderr", [notice]))
    assert record.ranks[0].stage is Stage.IMPORTING, "TensorFlow's notice is not the cell's first output"
    board._draw()
    assert "importing tensorflow" in board.rows[0].left.value and "importing tensorflow" in board.rows[1].left.value
    assert board.rows[0].bar.layout.visibility == "hidden"  # the stage runs over the empty bar's room
    assert "0:07" in board.rows[1].right.value  # the time spent importing it
    assert "importing tensorflow for 0:0" in board.header.value
    assert "importing tensorflow" in board.fallback_text()
    training = RankRecord(0, state="running", bars={"train": Bar(5, 10, 0, 0.0, 2.0)})
    assert len(progress_text.row(record.ranks[0])) == len(progress_text.row(training)), "the text row keeps its width"
    # The import is done: the rank is back to its stage, and its cell's first line ends it.
    said(0, protocol.stage_reached(Stage.IMPORTING, importing=""))
    assert progress_text.starting_stage(record.ranks[0]) == "importing"
    said(0, protocol.output(0, "stdout", ["loading the data"]))
    assert record.ranks[0].stage is Stage.TRAINING
    said(0, protocol.stage_reached(Stage.IMPORTING, importing="tf_keras"))  # imported while it trains
    assert progress_text.starting_stage(record.ranks[0]) is None, "a rank that trains shows no stage"
    said(0, protocol.output(0, "stdout", ["step 1"]))
    record.apply({"type": "report", "rank": 0, "progress": {"train": [1, 10, 5.0]}})
    board._draw()
    assert board.rows[0].bar.layout.visibility is None and "train" in board.rows[0].left.value
    assert "importing for 0:0" not in board.header.value and "importing tensorflow for" in board.header.value
    assert list(record.timings["stages"]) == ["importing"]  # rank 1 still imports: the run's stage


@pytest.mark.unit
def test_chart_controls_redraw_the_charts_at_the_next_frame():
    from hvdmagic.kernel.ui.dashboard import Dashboard

    record = _fed_record()
    record.apply({"type": "report", "rank": 1, "metrics": metric_batch([0, 1], [1.0, 2.0], {"acc": [0.5, 0.75]})})
    board = Dashboard(record)
    board._draw()
    assert 'data-scale="log"' in board.charts.value  # auto: the loss spans three decades
    assert 'data-metric="acc"' not in board.charts.value  # only rank 0 is charted by default
    board.charts.value = "stale"
    board._draw()
    assert board.charts.value == "stale", "the charts were redrawn although nothing changed"
    board.scale.value = "linear"
    board._draw()
    assert 'data-scale="linear"' in board.charts.value and 'data-scale="log"' not in board.charts.value
    board.smoothing.value = 0.6
    board._draw()
    assert "hvdmagic-line-smoothed" in board.charts.value
    board.overlay.value = True
    board._draw()
    assert 'data-metric="acc"' in board.charts.value and "rank 1" in board.charts.value
    loss = board.charts.value.split('data-metric="loss"')[1].split('data-metric="')[0]
    assert "rank 0" in loss and "rank 1" in loss, "every rank's loss should be overlaid"
    assert board.draw_error is None


@pytest.mark.unit
def test_the_first_frame_keeps_room_for_what_training_will_show():
    """While the run launches, the parts training fills later already take their room (laid out,
    not shown: ``visibility: hidden``, never ``display: none``), so the cell does not jump."""
    from hvdmagic.kernel.ui.dashboard import RECENT_LINES, Dashboard

    record = RunRecord(Placement.of(2))
    record.charts_expected = True  # the magic saw log_metrics in the cell
    record.bars_expected = True  # and hvdmagic.track
    board = Dashboard(record)
    board._draw()
    # The overall bar's row, empty, says what it will show: a row that stays, not a blank gap.
    assert board.overall.layout.display is None and "progress shows here" in board.overall_text.value
    assert f"height:{RECENT_LINES * 17}px" in board.recent.value and board.recent.layout.display is None
    assert "height:130px" in board.charts.value  # a chart's own height (charts.chart_html)
    assert board.controls.layout.display is None and board.controls.layout.visibility == "hidden"
    fed = _fed_record()
    fed.charts_expected = True
    board = Dashboard(fed)
    board._controls_work = True
    board._draw()
    assert board.overall.layout.display is None and "progress shows here" not in board.overall_text.value
    assert 'data-metric="loss"' in board.charts.value and board.controls.layout.visibility == "visible"
    # A cell that logs nothing and drives no bar keeps no room for charts, nor a blank band for the overall
    # bar between the header and the rows (issue 48: 35 px); the row comes if a rank steps after all.
    board = Dashboard(RunRecord(Placement.of(2)))
    board._draw()
    assert board.charts.value == "" and board.controls.layout.display == "none"
    assert board.overall.layout.display == "none"


@pytest.mark.unit
def test_the_snapshot_keeps_the_scale_the_live_chart_had():
    from hvdmagic.kernel.ui.dashboard import Dashboard
    from hvdmagic.kernel.ui.snapshot import Snapshot

    def chart_scale(html_text: str) -> str:
        return html_text.split('data-metric="loss"')[1].split('data-scale="')[1].split('"')[0]

    record = _fed_record()  # rank 0's loss spans three decades: "auto" draws it on a log scale
    board = Dashboard(record)
    board._draw()
    assert chart_scale(board.charts.value) == "log"
    board.scale.value = "linear"  # the user's choice, live
    board._draw()
    record.finish(results=[1, 1])
    assert chart_scale(Snapshot(record)._repr_html_()) == "linear"

    # "auto" saw two points within a decade (linear); the end adds one that would make auto pick log.
    record = RunRecord(Placement.of(2))
    record.apply({"type": "report", "rank": 0, "metrics": metric_batch([0, 1], [1.0, 2.0], {"loss": [2.0, 1.0]})})
    board = Dashboard(record)
    board._draw()
    assert chart_scale(board.charts.value) == "linear"
    record.apply({"type": "report", "rank": 0, "metrics": metric_batch([2], [3.0], {"loss": [0.001]})})
    record.finish(results=[1, 1])
    assert chart_scale(Snapshot(record)._repr_html_()) == "linear"
    # A run nobody watched (the text view, a quick cell) keeps "auto"'s choice for the whole series.
    record.chart_scales = {}
    assert chart_scale(Snapshot(record)._repr_html_()) == "log"


@pytest.mark.unit
def test_close_replaces_the_dashboard_with_the_snapshot_and_closes_every_widget():
    from ipywidgets.widgets import widget as widget_module

    from hvdmagic.kernel.ui.dashboard import Dashboard, _descendants
    from hvdmagic.kernel.ui.snapshot import Snapshot

    class Handle:
        def __init__(self):
            self.updates = []

        def update(self, obj):
            self.updates.append(obj)

    record = _fed_record()
    board = Dashboard(record)
    board.handle = Handle()
    record.finish(results=[1, 1])
    every = list(_descendants(board.box))
    assert len(every) > 30  # rows, their layouts and styles, the controls, the logs
    models = {widget.model_id for widget in every}
    board.close()
    (snapshot,) = board.handle.updates
    assert isinstance(snapshot, Snapshot) and snapshot.record is record
    assert set(snapshot._repr_mimebundle_()) == {"text/plain", "text/html"}
    assert all(widget.comm is None for widget in every), "a widget was left open"
    registry = getattr(widget_module, "_instances", None)  # ipywidgets 8; 7 keeps them on the class
    registry = widget_module.Widget.widgets if registry is None else registry
    assert not models & set(registry), "a closed widget is still registered (it would leak with its record)"


@pytest.mark.unit
def test_a_kernel_without_subshells_is_told_once_why_the_controls_are_missing(monkeypatch):
    """Outside a kernel with subshells (here: no kernel at all; on Databricks and Colab: ipykernel 6)
    the controls are left out, and the first dashboard says why; the second says nothing more."""
    from hvdmagic.kernel.ui import dashboard

    monkeypatch.setattr(dashboard, "_controls_note_said", False)
    boards = [dashboard.Dashboard(_fed_record()) for _ in range(2)]
    try:
        for board in boards:
            board.start()
    finally:
        for board in boards:
            board.close()
    first, second = (board.notes.value for board in boards)
    assert "ipykernel &gt;= 7" in first and "ipykernel" not in second, (first, second)
    assert boards[0].controls.layout.display == "none" and boards[0].where_button.layout.display == "none"


@pytest.mark.unit
def test_dashboard_redraws_at_most_ten_times_a_second():
    from hvdmagic.kernel.ui.dashboard import MAX_FPS, Dashboard

    record = _fed_record()
    board = Dashboard(record)
    draws = []
    original = board._draw
    board._draw = lambda force=False: (draws.append(1), original(force))
    stop = threading.Event()

    def flood():
        step = 0
        while not stop.is_set():
            step += 1
            record.apply({"type": "report", "rank": 0, "progress": {"train": [step, None, 2.0]}})

    feeder = threading.Thread(target=flood)
    board.start()
    started, initial = time.monotonic(), len(draws)  # start() draws once itself
    feeder.start()
    try:  # a flood of changes: the loop must redraw
        wait_until(lambda: len(draws) - initial >= 8, 10,
                   lambda: f"the redraw loop drew {len(draws) - initial} time(s) while the record changed",
                   interval=0.01)
        elapsed = time.monotonic() - started
        loop_draws = len(draws) - initial
    finally:
        stop.set()
        feeder.join()
        board.close()
    # The helper thread waits 1/MAX_FPS between draws, however fast the record changes.
    assert loop_draws <= MAX_FPS * elapsed + 2, f"{loop_draws} draws in {elapsed:.2f} s"
    assert board.draw_error is None


@pytest.mark.unit
def test_text_view_prints_a_line_per_epoch_and_ends_with_the_snapshot_text():
    record = RunRecord(Placement.of(-1))
    out = io.StringIO()
    view = text_ui.TextView(record, out=out)

    def feed(event):
        record.apply(event)
        view.on_event(event)

    feed({"type": "placed", "rank": 0, "host": "127.0.0.1"})
    t = 100.0
    for epoch in range(3):
        # The epoch loop's step and the next epoch's first batch arrive in one report ...
        feed({"type": "report", "rank": 0, "progress": {"epoch": [epoch, 3, t], "train": [0, 4, t + 0.01]}})
        for step in (2, 4):
            t += 1
            feed({"type": "report", "rank": 0, "progress": {"train": [step, 4, t]},
                  "metrics": metric_batch([4 * epoch + step], [t], {"loss": [1.0 / (epoch + 1)]})})
        t += 0.5
    feed({"type": "report", "rank": 0, "progress": {"epoch": [3, 3, t]}})  # ... or in one of their own
    feed({"type": "exit", "rank": 0, "code": 0})
    record.finish(results=[None])
    view.close()
    lines = out.getvalue().splitlines()
    epochs = [line for line in lines if line.startswith("rank 0 · ")]
    assert [line.split(" · ")[1] for line in epochs] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"], lines
    assert all(" · train 4/4 · " in line for line in epochs), epochs
    assert epochs[-1].endswith("loss=0.3333")
    assert lines[-3:] == ["%%horovod np=1 (local): finished", "rank 0: epoch 3/3 · train 4/4 [finished]",
                          "rank 0 metrics at step 12: loss=0.3333"]


@pytest.mark.unit
def test_widgets_in_any_jupyter_kernel_and_text_elsewhere(monkeypatch):
    import IPython

    from hvdmagic.kernel import ui

    class Shell:
        kernel = None

    shell = Shell()
    monkeypatch.delenv("HVDMAGIC_NONINTERACTIVE", raising=False)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    assert not ui.interactive(), "terminal IPython has no kernel: text"
    shell.kernel = object()
    assert ui.interactive(), "a Jupyter kernel gets widgets, whichever front end started it"
    monkeypatch.setenv("HVDMAGIC_NONINTERACTIVE", "1")
    assert not ui.interactive()
    monkeypatch.setenv("HVDMAGIC_NONINTERACTIVE", "0")
    shell.kernel = None
    assert ui.interactive()
    monkeypatch.delenv("HVDMAGIC_NONINTERACTIVE")
    monkeypatch.setattr(IPython, "get_ipython", lambda: None)
    assert not ui.interactive(), "plain Python: text"


# -- progress_text.py: the progress text every view shares ------------------------------------------------

def _rank(bars: dict, state: str = "running") -> RankRecord:
    from hvdmagic.protocol import Stage

    return RankRecord(0, state=state, bars=dict(bars), stage=Stage.TRAINING)


@pytest.mark.unit
def test_rows_keep_their_width_whatever_the_numbers():
    from hvdmagic.kernel.record import Bar
    from hvdmagic.kernel.ui import progress_text
    from hvdmagic.protocol import Stage

    cases = [(0, 10, None), (5, 10, 0.004), (999, 1000, 1.5), (12345, 99999, 15234.0),
             (2_000_000, 5_000_000, 3e6), (7, None, 12.0), (3, 7, 1e-5), (7, 7, 2.0)]
    for epochs in (False, True):
        widths = set()
        for step, total, rate in cases:
            bars = {"train": Bar(step, total, 0, 0.0, 4000.0)}
            if epochs:
                bars = {"epoch": Bar(3, 120, 0, -1.0, -1.0), **bars}
            row = progress_text.row(_rank(bars), rate=rate)
            assert "\n" not in row
            widths.add(len(row))
            left, _, right = progress_text.row_parts(_rank(bars), rate=rate)
            assert (len(left), len(right)) == (progress_text.left_width(epochs), progress_text.right_width())
        starting = RankRecord(0, state="running", stage=Stage.IMPORTING, stage_since=time.time() - 5)
        widths.add(len(progress_text.row(starting, epochs=epochs)))
        assert len(widths) == 1, f"rows of {sorted(widths)} characters (epochs={epochs})"
    assert "importing" in progress_text.row(starting) and "0:05" in progress_text.row(starting)


@pytest.mark.unit
def test_epoch_counter_and_overall_fraction_of_nested_bars():
    from hvdmagic.kernel.record import Bar
    from hvdmagic.kernel.ui import progress_text

    # Two epochs done; this epoch's bar restarted after the epoch loop moved, 30 of 100 done.
    bars = {"epoch": Bar(2, 5, 0, 0.0, 20.0), "train": Bar(30, 100, 0, 20.5, 25.0, restarts=2)}
    outer, inner = progress_text.pick_bars(bars)
    assert outer[0] == "epoch" and inner[0] == "train"
    assert progress_text.fraction(outer, inner) == pytest.approx((2 + 30 / 100) / 5)
    assert progress_text.rank_fraction(bars) == pytest.approx(0.46)
    row = progress_text.row(_rank(bars))
    assert row.startswith("epoch 3/5 ") and " train " in row and " 30% " in row and " 30/100 " in row
    assert progress_text.progress_summary(_rank(bars)) == "epoch 3/5 · train 30/100"
    # At the epoch's end the loop moves before the next epoch's bar restarts: nothing counts twice.
    moved = {"epoch": Bar(3, 5, 0, 0.0, 30.0), "train": Bar(100, 100, 0, 20.5, 29.9, restarts=2)}
    assert progress_text.rank_fraction(moved) == pytest.approx(3 / 5)
    done = {"epoch": Bar(5, 5, 0, 0.0, 50.0), "train": Bar(100, 100, 0, 40.5, 49.9, restarts=4)}
    assert progress_text.rank_fraction(done) == 1.0
    assert progress_text.epoch_text(progress_text.pick_bars(done)[0]) == "epoch 5/5"
    assert progress_text.progress_summary(_rank(done, "finished")) == "epoch 5/5 · train 100/100"
    # Bars one after the other are not nested, and only a lone bar spans the run.
    one_by_one = {"epoch 0": Bar(10, 10, 0, 0.0, 5.0), "epoch 1": Bar(4, 10, 0, 5.1, 7.0)}
    assert progress_text.pick_bars(one_by_one)[0] is None and progress_text.rank_fraction(one_by_one) is None
    phases = {"train": Bar(10, 10, 0, 8.0, 9.0, restarts=1), "val": Bar(2, 4, 0, 9.1, 9.5, restarts=1)}
    assert progress_text.pick_bars(phases)[0] is None and progress_text.rank_fraction(phases) is None
    assert progress_text.rank_fraction({"train": Bar(25, 100, 0, 0.0, 9.0)}) == 0.25
    assert progress_text.rank_fraction({"train": Bar(25, 100, 20, 9.0, 10.0, restarts=1)}) is None
    # The run's overall progress is its slowest rank's.
    record = RunRecord(Placement.of(2))
    record.ranks[0].bars = dict(bars)
    record.ranks[1].bars = dict(moved)
    value, outer = progress_text.run_fraction(record)
    assert value == pytest.approx(0.46) and outer[0] == "epoch"
    assert progress_text.overall_text(value, outer, None) == "epoch 3/5 ·  46%"
    assert progress_text.overall_text(value, outer, 61.2) == "epoch 3/5 ·  46% · ETA 1:02"


@pytest.mark.unit
def test_the_rate_is_smoothed_and_carried_over_and_no_eta_without_it():
    from hvdmagic.kernel.record import Bar
    from hvdmagic.kernel.ui import progress_text

    meter = progress_text.Meter()
    assert meter.rate is None
    meter.update(0, 100.0)
    assert meter.rate is None, "one sample is no rate"
    meter.update(10, 101.0)
    assert meter.rate == pytest.approx(10.0)
    meter.update(10, 101.0)  # a redraw with no news changes nothing
    assert meter.rate == pytest.approx(10.0)
    meter.update(30, 102.0)  # 20 it/s now: the smoothed rate moves towards it, not onto it
    smoothed = meter.rate
    assert 10 < smoothed < 20
    meter.update(0, 102.5)  # the next epoch restarts the bar: the rate stays, no flicker
    assert meter.rate == smoothed
    meter.update(15, 103.5)
    assert 10 < meter.rate < 20

    fresh = _rank({"train": Bar(0, 100, 0, 5.0, 5.0)})
    assert "<" not in progress_text.row(fresh), "an ETA without a rate"
    assert "0:00<0:10" in progress_text.row(fresh, rate=10.0)
    full = _rank({"train": Bar(100, 100, 0, 5.0, 15.0)})
    assert "<" not in progress_text.row(full, rate=10.0), "an ETA of a full bar"
    almost = _rank({"train": Bar(99, 100, 0, 5.0, 15.0)})
    assert "<0:01" in progress_text.row(almost, rate=10.0), "ETA rounds up, never 0:00"
    assert progress_text.rate_text(15234) == "15.2k it/s" and progress_text.rate_text(0.5) == "2 s/it"
    assert progress_text.count(123456) == "123k" and progress_text.count(99999) == "99999"
    assert progress_text.count(2.5) == "2.5"


def test_history_keeps_columns_with_gaps_and_no_python_object_per_row():
    import gc
    import math

    record = RunRecord(Placement.of(2))
    record.apply({"type": "report", "rank": 0,
                  "metrics": metric_batch([0, 1, 2], [100.0, 100.01, 100.02], {"loss": [3.0, None, 1.0]})})
    record.apply({"type": "report", "rank": 1, "metrics": metric_batch([0], [100.005], {"acc": [0.5]})})
    frame = record.metrics
    assert frame["step"].tolist() == [0, 1, 2, 0] and frame["rank"].tolist() == [0, 0, 0, 1]
    assert str(frame["time"].dt.tz) == "UTC"  # timezone-aware, not bare epoch seconds
    assert [t.timestamp() for t in frame["time"]] == pytest.approx([100.0, 100.01, 100.02, 100.005])
    assert math.isnan(frame["loss"][1]) and math.isnan(frame["acc"][0]) and frame["acc"][3] == 0.5
    steps, values = record.rank0_series["loss"]
    assert list(steps) == [0, 2] and list(values) == [3.0, 1.0]  # rank 0's chart skips the gap
    assert "acc" not in record.rank0_series  # only rank 0 is charted
    assert record.latest_metrics() == {"loss": (2, 1.0)}

    # A long history must not give the kernel's garbage collector more to walk.
    gc.collect()
    before = len(gc.get_objects())
    batch = metric_batch(list(range(1000)), [s / 1000 for s in range(1000)], {"loss": [0.5] * 1000, "lr": [0.1] * 1000})
    for _ in range(100):
        record.apply({"type": "report", "rank": 0, "metrics": batch})
    gc.collect()
    assert len(record.history) == 100_004
    assert len(gc.get_objects()) - before < 1000, "the record keeps Python objects per metric row"


@pytest.mark.unit
def test_a_run_without_progress_bars_gives_the_blank_columns_width_to_the_last_line():
    from hvdmagic.kernel.ui.dashboard import Dashboard

    record = RunRecord(Placement.of(-2))
    board = Dashboard(record)
    for rank in (0, 1):
        record.apply({"type": "placed", "rank": rank, "host": "vm"})
        record.apply({"type": "output", "rank": rank, "stream": "stdout", "lines": [f"rank {rank} started"]})
    board._draw()
    assert [(row.left.layout.display, row.right.layout.display) for row in board.rows] == [("none", "none")] * 2
    assert "rank 1 started" in board.rows[1].line.value
    record.apply({"type": "report", "rank": 0, "progress": {"train": [1, 10, 5.0]}})
    board._draw()  # a bar on one rank: every row keeps its columns, so the rows stay aligned
    assert [(row.left.layout.display, row.right.layout.display) for row in board.rows] == [("", "")] * 2


@pytest.mark.unit
def test_the_where_pane_names_an_elastic_runs_rows_by_task():
    """An elastic run's rows are tasks, and its Horovod ranks change at a reset: the answers say "task"."""
    from hvdmagic.kernel.ui.dashboard import Dashboard
    from hvdmagic.launch.placement import Elastic

    record = RunRecord(Placement.of(2, elastic=Elastic(1, 2)))
    record.where_asked = 1.0
    record.where = {0: '  File "<horovod-cell>", line 3 in <module>', 1: '  File "<horovod-cell>", line 5 in <module>'}
    board = Dashboard(record)
    board._draw_where()
    assert "2 of 2 tasks answered" in board.where.value and "task 0:" in board.where.value, board.where.value
    assert "rank 0:" not in board.where.value


@pytest.mark.unit
def test_a_connection_that_breaks_after_its_ranks_exit_leaves_the_row_as_it_ended():
    """Beside a second ``make test``, a stopped rank's row of sixteen read "no contact for 0 s": its task's
    connection broke as the task ended, after the rank's exit was in. A row is final once its exit is:
    the contact of a task that is ending is no news. While the rank runs, the loss still shows."""
    from hvdmagic import protocol
    from hvdmagic.kernel.ui.progress_text import row_state

    record = RunRecord(Placement.of(2))
    record.apply({"type": "exit", "rank": 0, "code": -15, "aborted": True})
    record.apply({**protocol.contact(lost=True, since=time.time()), "rank": 0})
    assert row_state(record.ranks[0]) == "stopped"
    record.apply({"type": "stage", "rank": 1, "stage": "training"})
    record.apply({**protocol.contact(lost=True, since=time.time() - 3), "rank": 1})
    assert row_state(record.ranks[1]) == "no contact for 3 s"
