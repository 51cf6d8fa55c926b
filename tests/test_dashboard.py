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

import hvdmagic
from hvdmagic.errors import JobFailed, RankFailure
from hvdmagic.kernel.record import RunRecord
from hvdmagic.kernel.ui import text as text_ui
from hvdmagic.metric_rows import GAP_ROW, MetricRows, decode
from hvdmagic.rank import report


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
    pytest.importorskip("ipywidgets")
    from hvdmagic.kernel.ui.dashboard import svg_chart

    chart = svg_chart("loss", steps, values)
    assert ">nan<" in chart and "nan" not in chart.split('points="')[1], "the NaN must be labelled, not plotted"


@pytest.fixture
def live_report(monkeypatch):
    """report as inside a rank; yields what it sends."""
    sent = io.StringIO()
    monkeypatch.setattr(report, "_events", sent)
    monkeypatch.setattr(report, "_rows", MetricRows())
    monkeypatch.setattr(report, "_metric_steps", 0)
    monkeypatch.setattr(report, "_progress_sent", {})
    yield sent


def test_rows_taken_while_a_rank_logs_are_neither_lost_nor_repeated(live_report):
    sent = live_report
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads interleave as often as the interpreter allows
    stop = threading.Event()

    def flusher():
        while not stop.is_set():
            report.flush()

    thread = threading.Thread(target=flusher)
    thread.start()
    try:
        for i in range(30000):
            report.log_metrics(step=i, **({"loss": i} if i % 3 else {"acc": -i}))
    finally:
        stop.set()
        sys.setswitchinterval(switch)
        thread.join(timeout=30)
    assert not thread.is_alive(), "the flushing thread did not stop"
    report.flush()
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


def test_log_metrics_counts_steps_converts_values_at_once_and_marks_gaps(live_report):
    import weakref

    import numpy as np
    import torch

    sent = live_report
    loss = torch.tensor(0.5)
    tensor = weakref.ref(loss)
    report.log_metrics(a=1.0, b=2)  # no step: 0
    report.log_metrics(b=True, a=loss)  # the other order of names; a tensor and a bool
    del loss
    assert tensor() is None, "log_metrics kept the tensor alive until the flush"
    report.flush()
    report.log_metrics(step=10, epoch=3)  # an int becomes a float
    report.log_metrics(a=np.float32(4.5))  # a numpy scalar, no step: one after the previous call's
    with pytest.raises(TypeError, match=r"^log_metrics\(step=...\) needs a number, not str$"):
        report.log_metrics(step="x", a=1.0)
    with pytest.raises(OverflowError, match=r"^log_metrics\(a=...\) is too large for a float$"):
        report.log_metrics(a=10**400, b=1.0)
    report.flush()
    batches = [decode(json.loads(line)["metrics"]) for line in sent.getvalue().splitlines()]
    assert [list(steps) for steps, _, _ in batches] == [[0, 1], [10, 11]], "refused calls left rows behind"
    first, second = batches[0][2], batches[1][2]
    assert list(first) == ["a", "b"] and list(first["a"]) == [1.0, 0.5] and list(first["b"]) == [2.0, 1.0]
    assert list(second) == ["epoch", "a"] and second["epoch"][0] == 3.0 and second["a"][1] == 4.5
    assert math.isnan(second["epoch"][1]) and math.isnan(second["a"][0]), "a metric a call skipped needs a gap"


def test_a_malformed_metrics_batch_is_dropped_whole_and_noted():
    record = RunRecord(1)
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
        summaries.append([line for line in out.splitlines() if line.startswith("rank ")])
    assert summaries[0] == summaries[1]
    assert summaries[0] == [
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


def test_text_twin_caps_live_output_but_keeps_every_line(capsys):
    record = RunRecord(1)
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
    record = RunRecord(2)
    record.apply({"type": "launching", "description": "test", "job_group": "hvdmagic-abc"})
    for rank in (0, 1):
        record.apply({"type": "placed", "rank": rank, "host": "127.0.0.1"})
        record.apply({"type": "report", "rank": rank, "progress": {"train": [5, 10, 1.0]},
                      "metrics": metric_batch(list(range(1000)), [1.0 + s for s in range(1000)],
                                              {"loss": [1.0 / (s + 1) for s in range(1000)]})})
        record.apply({"type": "output", "rank": rank, "stream": "stdout", "lines": ["hello"] * 300})
    return record


def test_dashboard_draws_rows_charts_logs_and_the_error_panel():
    pytest.importorskip("ipywidgets")
    from hvdmagic.kernel.ui.dashboard import CHART_POINTS, Dashboard

    record = _fed_record()
    board = Dashboard(record)
    board._draw()
    assert "hvdmagic-dashboard" in board.box._dom_classes
    assert board.rows[0].bar.value == 5 and board.rows[0].bar.max == 10
    assert 'class="hvdmagic-chart" data-metric="loss"' in board.charts.value
    points = board.charts.value.split('points="')[1].split('"')[0].split()
    assert len(points) <= CHART_POINTS + 1  # downsampled for the screen ...
    assert len(record.rank0_series["loss"][0]) == 1000  # ... while the history stays whole
    assert "100 older line(s) not shown" in board.panes[1].value
    assert "hvdmagic-abc" in board.header.value

    record.apply({"type": "exit", "rank": 0, "code": 0})
    record.apply({"type": "error", "rank": 1})
    record.finish(error=JobFailed([RankFailure(1, "ValueError: bad", "Traceback...\nValueError: bad\n")], []))
    board._draw()
    assert board.rows[0].bar.bar_style == "success"
    assert board.rows[1].bar.bar_style == "danger"
    assert "ValueError: bad" in board.error.value and board.error.layout.display is None
    assert ">failed<" in board.header.value


def test_dashboard_redraws_at_most_ten_times_a_second():
    from hvdmagic.kernel.ui.dashboard import MAX_FPS, Dashboard

    record = _fed_record()
    board = Dashboard(record)
    draws = []
    original = board._draw
    board._draw = lambda: (draws.append(1), original())
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
    deadline = started + 10
    while len(draws) - initial < 8 and time.monotonic() < deadline:  # a flood of changes: the loop must redraw
        time.sleep(0.01)
    elapsed = time.monotonic() - started
    loop_draws = len(draws) - initial
    stop.set()
    feeder.join()
    board.close()
    assert loop_draws >= 8, f"the redraw loop drew {loop_draws} time(s) in {elapsed:.1f} s while the record changed"
    # The helper thread waits 1/MAX_FPS between draws, however fast the record changes.
    assert loop_draws <= MAX_FPS * elapsed + 2, f"{loop_draws} draws in {elapsed:.2f} s"


def test_dashboard_in_a_real_kernel_reaches_its_final_state(tmp_path, monkeypatch):
    """A real ipykernel via nbclient: the widget state the kernel sent says finished, bars full."""
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("HVDMAGIC_NONINTERACTIVE", "0")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext hvdmagic"),
        nbformat.v4.new_code_cell(
            "%%horovod --np -2\n"
            "import hvdmagic\n"
            "for i in hvdmagic.track(range(30), desc='train'):\n"
            "    hvdmagic.log_metrics(step=i, loss=1.0 / (i + 1))\n"
            "print('trained')\n"
        ),
    ]
    client = NotebookClient(nb, timeout=300, kernel_name="python3", store_widget_state=True,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = nb.cells[1].outputs
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
    assert not any("[rank 0] trained" in o.get("text", "") for o in outputs), "text twin used in a widget kernel"
    models = [m["state"] for m in nb.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"].values()]
    assert any("hvdmagic-dashboard" in m.get("_dom_classes", []) for m in models)
    headers = [m["value"] for m in models if "hvdmagic-state" in str(m.get("value", ""))]
    assert headers and ">finished<" in headers[0]
    bars = [m for m in models if m.get("_model_name") == "FloatProgressModel"]
    assert len(bars) == 2 and all(b["value"] == b["max"] == 30 and b["bar_style"] == "success" for b in bars)
    assert any('data-metric="loss"' in str(m.get("value", "")) for m in models)


def test_history_keeps_columns_with_gaps_and_no_python_object_per_row():
    import gc
    import math

    record = RunRecord(2)
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
