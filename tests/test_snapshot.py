"""The inline SVG charts and the static snapshot a run leaves in the notebook when it ends."""

from __future__ import annotations

import html
import itertools
import math
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
from test_dashboard import metric_batch

from hvdmagic.errors import JobFailed, RankFailure
from hvdmagic.kernel.record import RunRecord
from hvdmagic.kernel.ui import charts
from hvdmagic.kernel.ui.charts import CHART_POINTS, chart_html, debiased_ema, is_constant, metrics_html
from hvdmagic.kernel.ui.snapshot import Snapshot
from hvdmagic.launch.placement import Placement

pytestmark = [pytest.mark.unit, pytest.mark.profile]

# -- helpers -----------------------------------------------------------------


def parse(chart: str) -> ET.Element:
    """A chart is well-formed XML: parse it to look at its parts."""
    return ET.fromstring(chart)


def polylines(root: ET.Element, kind: str | None = None) -> list[list[tuple[float, float]]]:
    lines = [line for line in root.iter("polyline") if kind is None or line.get("class") == f"hvdmagic-line-{kind}"]
    return [[tuple(map(float, point.split(","))) for point in line.get("points").split()] for line in lines]


def titles(root: ET.Element) -> list[str]:
    return [rect.find("title").text for rect in root.iter("rect") if rect.find("title") is not None]


def header_value(root: ET.Element) -> str:
    latest = next(t for t in root.iter("text") if t.get("class") == "hvdmagic-latest")
    return "".join(latest.itertext())


def tick_labels(root: ET.Element, axis: str) -> list[str]:
    return [t.text for t in root.iter("text") if t.get("class") == f"hvdmagic-{axis}tick"]


class _Text(HTMLParser):
    def __init__(self):
        super().__init__()
        self.chunks: list[str] = []
        self.hidden: str | None = None  # the tag of the hidden element we are in (one without hidden elements in it)

    def handle_starttag(self, tag, attrs):
        if self.hidden is None and "hidden" in dict(attrs):
            self.hidden = tag

    def handle_endtag(self, tag):
        if tag == self.hidden:
            self.hidden = None

    def handle_data(self, data):
        if self.hidden is None:
            self.chunks.append(data)


def visible_text(markup: str) -> str:
    """The text of some HTML as a browser shows it: without its tags and its hidden elements."""
    parser = _Text()
    parser.feed(markup)
    return "".join(parser.chunks).replace("\xa0", " ")


# -- charts ------------------------------------------------------------------


def test_auto_scale_is_log_for_values_spanning_decades_and_linear_otherwise():
    steps = list(range(50))
    decades = [10.0 ** (-s / 10) for s in steps]  # 1 down to 1.3e-5
    chart = chart_html("loss", [("rank 0", steps, decades)])
    assert 'data-scale="log"' in chart
    labels = tick_labels(parse(chart), "y")
    assert labels and all(re.fullmatch(r"1e-\d+|0\.0*1|1", label) for label in labels), labels
    assert "0.01" in labels and "1" in labels  # powers of ten, printed as such
    narrow = [2.0 + math.sin(s) for s in steps]  # 1 to 3: not even one decade
    assert 'data-scale="linear"' in chart_html("loss", [("rank 0", steps, narrow)])
    # Two decades, but a value at or below zero: never log on its own.
    assert 'data-scale="linear"' in chart_html("x", [("rank 0", steps, [*decades[:-1], 0.0])])
    assert 'data-scale="linear"' in chart_html("x", [("rank 0", steps, [-v for v in decades])])


def test_explicit_scale_is_honoured_and_log_leaves_out_what_it_cannot_show():
    steps = list(range(50))
    decades = [10.0 ** (s / 10) for s in steps]
    assert 'data-scale="linear"' in chart_html("x", [("r", steps, decades)], scale="linear")
    narrow = [5.0 + math.sin(s) for s in steps]
    chart = chart_html("x", [("r", steps, narrow)], scale="log")
    assert 'data-scale="log"' in chart
    assert len(tick_labels(parse(chart), "y")) >= 2, "a log axis under one decade still needs ticks"
    mixed = [-1.0, 0.0, 1.0, 10.0, 100.0]
    chart = chart_html("x", [("r", list(range(5)), mixed)], scale="log")
    root = parse(chart)
    [line] = polylines(root)
    assert len(line) == 3, "non-positive values have no place on a log axis"
    note = next(div for div in root.iter("div") if div.get("class") == "hvdmagic-chart-note")
    assert note.text == "2 value(s) ≤ 0 not shown on the log scale"
    assert header_value(root) == "100"
    with pytest.raises(ValueError, match="scale"):
        chart_html("x", [("r", steps, narrow)], scale="logarithmic")


def test_smoothing_is_tensorboards_debiased_moving_average_drawn_over_the_faint_raw_line():
    # By hand, weight 0.5: (0.5*1)/0.5 = 1; (0.25+1)/0.75 = 5/3; (0.625+1.5)/0.875 = 17/7.
    assert debiased_ema([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 5 / 3, 17 / 7])
    assert debiased_ema([1.0, math.nan, 3.0], 0.5)[2] == pytest.approx((0.25 + 1.5) / 0.75)  # NaN skipped
    assert debiased_ema([2.0] * 5, 0.9) == [2.0] * 5
    root = parse(chart_html("loss", [("rank 0", [0, 1, 2], [1.0, 2.0, 3.0])], smoothing=0.5))
    [raw], [smoothed] = polylines(root, "raw"), polylines(root, "smoothed")
    assert raw[0] == smoothed[0] and raw[1:] != smoothed[1:], "the smoothed line must differ from the raw one"
    assert smoothed[2][1] > raw[2][1], "17/7 < 3 must be drawn lower"
    raw_line = next(line for line in root.iter("polyline") if line.get("class") == "hvdmagic-line-raw")
    assert float(raw_line.get("stroke-opacity")) < 0.5, "the raw line is drawn faint"
    assert header_value(root) == "2.429 raw 3"
    assert titles(root)[-1] == "step 2: value 3 (smoothed 2.42857)"
    # Without smoothing, one line and no "smoothed".
    plain = parse(chart_html("loss", [("rank 0", [0, 1, 2], [1.0, 2.0, 3.0])]))
    assert len(polylines(plain)) == 1 and header_value(plain) == "3"
    with pytest.raises(ValueError, match="smoothing"):
        chart_html("loss", [("rank 0", [0], [1.0])], smoothing=1.0)


def test_one_point_is_a_dot_with_its_value():
    root = parse(chart_html("val_acc", [("rank 0", [7], [0.25])]))
    dots = [c for c in root.iter("circle") if c.get("class") == "hvdmagic-dot"]
    assert len(dots) == 1 and not polylines(root)
    assert "0.25" in [t.text for t in root.iter("text")]
    assert titles(root) == ["step 7: value 0.25"]
    assert tick_labels(root, "x") == ["7"]


def test_a_logged_nan_is_labelled_as_the_latest_value_but_not_plotted():
    for bad in (math.nan, math.inf):
        chart = chart_html("loss", [("rank 0", [0, 1, 2], [3.0, 2.0, bad])])
        root = parse(chart)
        assert header_value(root) == f"{bad}"
        [line] = polylines(root)
        assert len(line) == 2 and all(math.isfinite(v) for point in line for v in point)
        assert "nan" not in chart.split('points="')[1] and "inf" not in chart.split('points="')[1]
        assert titles(root)[-1] == f"step 2: value {bad}"
    only_nan = parse(chart_html("loss", [("rank 0", [0], [math.nan])]))
    assert header_value(only_nan) == "nan" and not polylines(only_nan)
    assert not list(only_nan.iter("circle"))


def test_hover_titles_give_each_points_step_and_value_and_long_series_are_downsampled():
    root = parse(chart_html("loss", [("rank 0", [10, 20, 30], [0.5, 0.25, 0.125])]))
    assert titles(root) == ["step 10: value 0.5", "step 20: value 0.25", "step 30: value 0.125"]
    rects = [r for r in root.iter("rect") if r.find("title") is not None]
    spans = [(float(r.get("x")), float(r.get("x")) + float(r.get("width"))) for r in rects]
    assert all(a[1] == pytest.approx(b[0], abs=0.2) for a, b in itertools.pairwise(spans)), "bands must tile the plot"
    steps = list(range(10_000))
    root = parse(chart_html("loss", [("rank 0", steps, [1.0 / (s + 1) for s in steps])]))
    [line] = polylines(root)
    assert len(line) <= CHART_POINTS and len(titles(root)) == len(line)
    assert titles(root)[-1] == "step 9999: value 0.0001", "the last point must be kept"
    assert titles(root)[0] == "step 0: value 1"


def test_overlay_draws_a_line_per_series_in_its_own_colour_with_a_legend():
    steps = list(range(20))
    series = [(f"rank {r}", steps, [1.0 / (s + 1 + r) for s in steps]) for r in range(3)]
    chart = chart_html("loss", series)
    root = parse(chart)
    lines = list(root.iter("polyline"))
    assert len(lines) == 3 and len({line.get("stroke") for line in lines}) == 3
    legend = next(div for div in root.iter("div") if div.get("class") == "hvdmagic-legend")
    assert [t for t in "".join(legend.itertext()).split() if t.isdigit()] == ["0", "1", "2"]
    assert titles(root)[0] == "step 0\nrank 0: 1\nrank 1: 0.5\nrank 2: 0.333333"
    single = parse(chart_html("loss", series[:1]))
    assert not [div for div in single.iter("div") if div.get("class") == "hvdmagic-legend"]


def test_names_and_labels_are_escaped():
    chart = chart_html("<b>&loss", [("<rank>", [0, 1], [1.0, 2.0]), ("r'1", [0, 1], [1.0, 3.0])])
    parse(chart)  # still well-formed
    assert "<b>" not in chart and "&lt;b&gt;&amp;loss" in chart and "&lt;rank&gt;" in chart


def test_a_constant_metric_is_a_compact_row_not_a_chart():
    assert is_constant([0.01] * 200) and not is_constant([0.01]) and not is_constant([1.0, 2.0])
    assert not is_constant([math.nan, math.nan])
    from array import array

    assert is_constant(array("d", [0.1] * 5)) and not is_constant(array("d", [0.1] * 4 + [0.2]))
    steps = list(range(200))
    markup = metrics_html({"lr": [("rank 0", steps, [0.01] * 200)],
                           "loss": [("rank 0", steps, [1.0 / (s + 1) for s in steps])]})
    assert 'class="hvdmagic-chart" data-metric="loss"' in markup
    assert 'class="hvdmagic-chart" data-metric="lr"' not in markup
    row = re.search(r'<div class="hvdmagic-constant" data-metric="lr".*?</div>', markup).group(0)
    assert re.sub(r"\s+", " ", visible_text(row)) == "lr 0.01 (constant over 200 steps)"
    table = re.search(r'<table class="hvdmagic-metrics".*?</table>', markup).group(0)
    assert "<th" in table and all("white-space:nowrap" in th for th in re.findall(r"<th\b[^>]*>", table))
    cells = [[visible_text(cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]
             for row in re.findall(r"<tr>.*?</tr>", table)]
    assert cells == [["loss", "199", "0.005"], ["lr", "199", "0.01"]]
    # Overlaid ranks with different constants are still charted.
    assert 'data-metric="lr"' in chart_html("lr", [("rank 0", steps, [0.1] * 200), ("rank 1", steps, [0.2] * 200)])
    split = metrics_html({"lr": [("rank 0", steps, [0.1] * 200), ("rank 1", steps, [0.2] * 200)]})
    assert 'class="hvdmagic-chart" data-metric="lr"' in split
    assert metrics_html({}) == "" and metrics_html({"x": [("rank 0", [], [])]}) == ""


# -- the snapshot ------------------------------------------------------------


def _record(failed: bool = False) -> RunRecord:
    record = RunRecord(Placement.of(2))
    record.apply({"type": "launching", "description": "test", "job_group": "hvdmagic-abc"})
    for rank in (0, 1):
        record.apply({"type": "placed", "rank": rank, "host": f"10.0.0.{rank + 1}"})
        done = 10 if rank == 0 or not failed else 4
        record.apply({"type": "report", "rank": rank, "progress": {"train": [done, 10, 1.0]},
                      "metrics": metric_batch(list(range(done)), [1.0 + s for s in range(done)],
                                              {"loss": [1.0 / (s + 1) for s in range(done)],
                                               "lr": [0.01] * done})})
        lines = [f"rank {rank} line {i}" for i in range(250 if rank == 0 else 5)]
        record.apply({"type": "output", "rank": rank, "stream": "stdout", "lines": lines})
    record.apply({"type": "note", "rank": 0, "text": "scale_lr: lr 0.01 x 2 ranks = 0.02"})
    record.apply({"type": "exit", "rank": 0, "code": 0})
    if failed:
        record.apply({"type": "error", "rank": 1})
        record.apply({"type": "exit", "rank": 1, "code": 1})
        trace = "Traceback (most recent call last):\n  File \"<cell>\", line 3\nValueError: bad batch\n"
        record.finish(error=JobFailed([RankFailure(1, "ValueError: bad batch", trace)], []))
    else:
        record.apply({"type": "exit", "rank": 1, "code": 0})
        record.finish(results=[None, None])
    return record


SUMMARY = ("rank 0: train 10/10 [finished]\n"
           "rank 1: train 10/10 [finished]\n"
           "scale_lr: lr 0.01 x 2 ranks = 0.02\n"
           "rank 0 metrics at step 9: loss=0.1  lr=0.01\n")


def test_snapshot_text_holds_the_last_output_lines_and_the_text_views_summary():
    # Rank 0 printed 250 lines, rank 1 five: rank 1's five and rank 0's last fifteen make the 20.
    text = Snapshot(_record()).text()
    assert text == ("%%horovod np=2 (spark): finished\n"
                    "[rank 0] ... 235 earlier lines in hvdmagic.last_run().logs[0]\n"
                    + "".join(f"[rank 0] rank 0 line {i}\n" for i in range(235, 250))
                    + "".join(f"[rank 1] rank 1 line {i}\n" for i in range(5))
                    + SUMMARY)
    assert Snapshot(_record())._repr_mimebundle_()["text/plain"] == text, "the text/plain is not the text"
    # The text view printed the lines as they came: its closing text is the headline and the summary.
    assert Snapshot(_record()).text(output=False) == "%%horovod np=2 (spark): finished\n" + SUMMARY
    failed = Snapshot(_record(failed=True)).text()
    assert failed.startswith("%%horovod np=2 (spark): failed (see the error below)\n[rank 0] ... 235 earlier")
    assert failed.endswith("[rank 1] rank 1 line 4\nrank 0: train 10/10 [finished]\nrank 1: train 4/10 [failed]\n"
                           "scale_lr: lr 0.01 x 2 ranks = 0.02\nrank 0 metrics at step 9: loss=0.1  lr=0.01\n")
    local = RunRecord(Placement.of(-1))
    local.finish()
    assert Snapshot(local).text() == "%%horovod np=1 (local): finished\n"


def test_snapshot_text_is_the_same_whatever_order_the_ranks_lines_arrived_in():
    def record(order):
        run = RunRecord(Placement.of(-2))
        for rank, line in order:
            run.apply({"type": "output", "rank": rank, "stream": "stdout", "lines": [line]})
        run.finish(results=[None, None])
        return Snapshot(run).text()

    interleaved = [(rank, f"step {i} of rank {rank}") for i in range(30) for rank in (0, 1)]
    one_after_the_other = sorted(interleaved, key=lambda line: line[0])  # stable: each rank's order kept
    text = record(interleaved)
    assert record(one_after_the_other) == text
    assert text.count("\n[rank 0] step") == 10 and text.count("\n[rank 1] step") == 10, text
    assert "[rank 0] step 29 of rank 0\n[rank 1] ... 20 earlier lines" in text, text


def test_snapshot_text_gives_a_talkative_rank_the_room_others_leave_and_drops_noise_and_colours():
    run = RunRecord(Placement.of(-4))
    run.apply({"type": "output", "rank": 2, "stream": "stdout", "lines": ["only line of rank 2"]})
    noise = ("2024-01-01 12:00:00.000000: I tensorflow/core/platform/cpu_feature_guard.cc:182] "
             "oneDNN custom operations are on")
    run.apply({"type": "output", "rank": 0, "stream": "stderr", "lines": [noise]})
    run.apply({"type": "output", "rank": 0, "stream": "stdout",
               "lines": [f"\x1b[32mepoch {i}\x1b[0m" for i in range(40)]})
    run.finish(results=[None] * 4)
    lines = Snapshot(run).text().splitlines()
    assert lines[1] == "[rank 0] ... 21 earlier lines in hvdmagic.last_run().logs[0]", lines
    assert lines[2:21] == [f"[rank 0] epoch {i}" for i in range(21, 40)], lines
    assert lines[21:] == ["[rank 2] only line of rank 2"], lines
    assert "oneDNN" not in "\n".join(lines)


def _quick_run(*outputs: tuple[int, str, list[str]], seconds: float = 0.012) -> RunRecord:
    """A session cell's record: two local ranks, some output, finished in ``seconds``."""
    run = RunRecord(Placement.of(-2))
    for rank in (0, 1):
        run.apply({"type": "placed", "rank": rank, "host": "127.0.0.1"})
    for rank, stream, lines in outputs:
        run.apply({"type": "output", "rank": rank, "stream": stream, "lines": lines})
    for rank in (0, 1):
        run.apply({"type": "exit", "rank": rank, "code": 0})
    run.finish(results=[2.0, 2.0])
    run.started = run.ended - seconds
    return run


def test_a_quick_run_with_no_output_and_no_metrics_leaves_one_line():
    snapshot = Snapshot(_quick_run(), compact=True)
    assert snapshot.compact
    assert snapshot.text() == "%%horovod np=2 (local): finished\n"
    markup = snapshot._repr_html_()
    assert markup.startswith('<div class="hvdmagic-snapshot hvdmagic-compact" data-state="finished"'), markup
    assert visible_text(markup) == "%%horovod np=2 (local): finished in 12 ms"
    assert "<pre" not in markup and "<table" not in markup and "white-space:nowrap" in markup
    assert "hvdmagic.last_run()" in markup, "the compact record should say where the full one is"
    assert visible_text(Snapshot(_quick_run(seconds=2.25), compact=True)._repr_html_()).endswith("finished in 2.2 s")
    full = Snapshot(_quick_run())._repr_html_()  # not asked for compact: the full record
    assert 'class="hvdmagic-ranks"' in full and "no output" in visible_text(full)


def test_a_quick_runs_output_is_shown_compactly_and_a_failure_or_metrics_keep_the_full_record():
    run = _quick_run((0, "stdout", ["loss 0.25", "\x1b[1mdone\x1b[0m"]), (1, "stderr", ["a <warning>"]))
    markup = Snapshot(run, compact=True)._repr_html_()
    assert visible_text(markup) == ("%%horovod np=2 (local): finished in 12 ms"
                                    "[rank 0] loss 0.25\n[rank 0] done\n[rank 1] a <warning>")
    assert '<span style="color:#b22">[rank 1] a &lt;warning&gt;</span>' in markup, "stderr is red, and escaped"
    assert "<table" not in markup
    assert Snapshot(run, compact=True).text() == ("%%horovod np=2 (local): finished\n[rank 0] loss 0.25\n"
                                                  "[rank 0] done\n[rank 1] a <warning>\n")
    for kept in (_record(failed=True), _record()):  # a failure; metrics (charts need room)
        snapshot = Snapshot(kept, compact=True)
        assert not snapshot.compact and 'class="hvdmagic-ranks"' in snapshot._repr_html_()
    cancelled = _quick_run()
    cancelled.state = "cancelled"
    assert 'class="hvdmagic-ranks"' in Snapshot(cancelled, compact=True)._repr_html_()


def test_snapshot_html_holds_the_final_figures_and_not_the_traceback():
    snapshot = Snapshot(_record(failed=True))
    markup = snapshot._repr_html_()
    text = visible_text(markup)
    assert markup.startswith('<div class="hvdmagic-snapshot"')
    assert not re.search(r"<(script|style|link|iframe)\b", markup) and " on" + "load=" not in markup
    header = re.search(r'<div class="hvdmagic-snapshot-header".*?</div>', markup).group(0)
    assert "failed: see the error below" in visible_text(header)
    assert "np=2 (spark)" in visible_text(header) and "hvdmagic-abc" in header
    assert "Traceback" not in markup and "bad batch" not in markup and 'File "' not in markup
    rows = {int(r): [visible_text(cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]
            for r, row in re.findall(r'<tr class="hvdmagic-rank" data-rank="(\d)">(.*?)</tr>', markup)}
    assert rows[0] == ["rank 0", "10.0.0.1", "train 10/10", "", "finished", "0"]
    assert rows[1] == ["rank 1", "10.0.0.2", "train 4/10", "", "failed", "1"]
    assert 'class="hvdmagic-chart" data-metric="loss"' in markup  # the loss chart ...
    assert re.search(r'class="hvdmagic-latest"[^>]*>0\.1<', markup)  # ... with its latest value
    assert "lr 0.01 (constant over 10 steps)" in re.sub(r"\s+", " ", text)
    assert "scale_lr: lr 0.01 x 2 ranks = 0.02" in text
    # Logs: the last 20 lines of each rank in view, up to 200 in a collapsed section, and where the rest is.
    logs = markup[markup.index('class="hvdmagic-log"'):]
    visible = logs.split("<details")[0]
    assert "rank 0 line 249" in visible and "rank 0 line 230" in visible and "rank 0 line 229" not in visible
    details = re.findall(r"<details.*?</details>", markup, re.S)
    assert len(details) == 1, "rank 1's 5 lines are all in view already"
    assert "<summary" in details[0] and "rank 0: 250 lines" in visible_text(details[0])
    assert "rank 0 line 50" in details[0] and "rank 0 line 49\n" not in details[0]
    assert "hvdmagic.last_run().logs[0]" in text
    assert "rank 1 line 4" in text


def test_a_rank_that_failed_before_any_framework_import_failed_in_the_cell():
    """A rank's first stage, "importing", lasts until the cell imports horovod: a cell that fails in its
    first line did not fail "at importing". Later stages keep their names."""
    run = RunRecord(Placement.of(-3))
    for rank, stage in ((0, "importing"), (1, "hvd.init"), (2, "importing")):
        run.apply({"type": "placed", "rank": rank, "host": "127.0.0.1"})
        run.apply({"type": "stage", "rank": rank, "stage": stage})
    run.apply({"type": "error", "rank": 0})
    run.apply({"type": "exit", "rank": 0, "code": 1})
    for rank in (1, 2):
        run.apply({"type": "exit", "rank": rank, "code": -15, "aborted": True})
    run.finish(error=JobFailed([RankFailure(0, "ZeroDivisionError: division by zero", "")], [1, 2]))
    snapshot = Snapshot(run)
    assert snapshot.text() == ("%%horovod np=3 (local): failed (see the error below)\n"
                               "rank 0: [failed in the cell]\nrank 1: [stopped at hvd.init]\n"
                               "rank 2: [stopped in the cell]\n")
    markup = snapshot._repr_html_()
    rows = {int(r): [visible_text(cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row)]
            for r, row in re.findall(r'<tr class="hvdmagic-rank" data-rank="(\d)">(.*?)</tr>', markup)}
    assert [rows[r][4:] for r in range(3)] == [["failed in the cell", "1"], ["stopped at hvd.init", "-15"],
                                                ["stopped in the cell", "-15"]], rows


def test_a_session_start_leaves_its_ranks_ready_not_finished():
    """%horovod start ends with its ranks up: its record and each rank read "ready"."""
    run = RunRecord(Placement.of(-2), "%horovod start")
    for rank in (0, 1):
        run.apply({"type": "placed", "rank": rank, "host": "127.0.0.1"})
        run.apply({"type": "stage", "rank": rank, "stage": "importing"})
    run.finish(results=[None, None], ready=True)
    assert run.state == "ready" and [rank.state for rank in run.ranks] == ["ready", "ready"]
    assert Snapshot(run).text() == "%horovod start np=2 (local): ready\n"
    full = visible_text(Snapshot(run)._repr_html_())
    assert "ready" in full and "finished" not in full, full
    rows = re.findall(r'<tr class="hvdmagic-rank".*?</tr>', Snapshot(run)._repr_html_())
    assert [visible_text(row) for row in rows] == ["rank 0127.0.0.1ready", "rank 1127.0.0.1ready"], rows
    run.started = run.ended - 0.25
    assert visible_text(Snapshot(run, compact=True)._repr_html_()) == "%horovod start np=2 (local): ready in 250 ms"


def test_snapshot_survives_a_saved_notebook(tmp_path):
    import nbformat

    bundle = Snapshot(_record())._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert Snapshot(_record())._repr_mimebundle_(include={"text/plain"}).keys() == {"text/plain"}
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("%%horovod --np 2\ntrain()")
    cell.outputs = [nbformat.v4.new_output("display_data", data=bundle)]
    nb.cells = [cell]
    path = tmp_path / "run.ipynb"
    nbformat.write(nb, str(path))
    saved = nbformat.read(str(path), as_version=4)
    nbformat.validate(saved)
    [output] = saved.cells[0].outputs
    assert output.output_type == "display_data"
    text, markup = output.data["text/plain"], output.data["text/html"]
    assert text.splitlines()[0] == "%%horovod np=2 (spark): finished"
    assert "rank 1: train 10/10 [finished]" in text and "loss=0.1" in text
    assert markup == bundle["text/html"]
    assert 'class="hvdmagic-snapshot"' in markup and 'data-metric="loss"' in markup
    assert "10/10" in markup and ">finished<" in markup and html.escape("scale_lr: lr 0.01") in markup


def test_the_html_carries_the_text_hidden_and_no_blank_line():
    """nbconvert's Markdown and AsciiDoc exports take the HTML over the text/plain: the text is in it,
    first and hidden. A Markdown renderer ends an HTML block at a blank line: an empty line a rank
    printed leaves none, and still shows as an empty line."""
    run = _quick_run((0, "stdout", ["epoch 1", "", "epoch 2"]), (1, "stdout", ["  "]))
    snapshot = Snapshot(run)
    markup = snapshot._repr_html_()
    twin = re.search(r'<pre class="hvdmagic-text" hidden style="display:none">(.*?)</pre>', markup, re.S)
    assert twin and html.unescape(twin.group(1)) == snapshot.text(), markup[:800]
    assert markup.index('class="hvdmagic-text"') < markup.index('class="hvdmagic-snapshot-header"'), "not first"
    assert "[rank 0] epoch 2" in snapshot.text() and "[rank 0]" not in visible_text(markup)
    assert not re.search(r"^[ \t]*$", markup, re.MULTILINE), "a blank line in the HTML"
    log = re.search(r'<div class="hvdmagic-log" data-rank="0".*?<pre[^>]*>(.*?)</pre>', markup, re.S).group(1)
    assert log == "epoch 1\n<span></span>\nepoch 2", log
    assert visible_text(log) == "epoch 1\n\nepoch 2"
    compact = Snapshot(_quick_run((0, "stdout", ["a", "", "b"])), compact=True)._repr_html_()
    assert not re.search(r"^[ \t]*$", compact, re.MULTILINE) and "[rank 0] b" in visible_text(compact)


def test_charts_never_import_widgets():
    import ast
    import inspect

    imported = {alias.name.split(".")[0] for node in ast.walk(ast.parse(inspect.getsource(charts)))
                if isinstance(node, ast.Import | ast.ImportFrom)
                for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
    assert imported <= {"__future__", "html", "math", "bisect", "collections"}, imported


def test_framework_notices_fold_into_one_line_unless_the_rank_failed():
    """TensorFlow's start-up chatter stays in last_run().logs but not among a finished rank's lines."""
    record = RunRecord(Placement.of(-2))
    notices = ["WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
               "I0000 00:00:1732560000.000000   123 cpu_feature_guard.cc:182] This TensorFlow binary is "
               "optimized to use available CPU instructions"]
    for rank in (0, 1):
        record.apply({"type": "placed", "rank": rank, "host": "vm"})
        record.apply({"type": "output", "rank": rank, "stream": "stderr", "lines": notices})
        record.apply({"type": "output", "rank": rank, "stream": "stdout", "lines": [f"epoch 1 on rank {rank}"]})
    record.apply({"type": "exit", "rank": 0, "code": 0, "aborted": False})
    record.apply({"type": "error", "rank": 1, "exc_type": "ValueError", "message": "x", "traceback": ""})
    record.apply({"type": "exit", "rank": 1, "code": 1, "aborted": False})
    record.finish(error=JobFailed([RankFailure(1, "ValueError: x", "", "vm")], []))
    markup = Snapshot(record)._repr_html_()
    logs = markup[markup.index('class="hvdmagic-log"'):]
    finished, failed = logs.split('class="hvdmagic-log" data-rank="1"')
    assert "framework notices (2)" in finished and "1 line<" in finished, finished
    assert "epoch 1 on rank 0" in finished and finished.count("cpu_feature_guard") == 1  # in the fold only
    assert "framework notices" not in failed and "cpu_feature_guard" in failed  # a failed rank shows them all
    assert len(record.ranks[0].logs) == 3  # nothing lost from the record


def test_a_many_rank_run_that_failed_before_any_rank_started_says_so_in_one_line_not_one_per_rank():
    """A cell or fit whose 64 ranks never started (too few slots) lists no "rank N no output" 64 times."""
    from hvdmagic.errors import LaunchError
    from hvdmagic.protocol import Event, Stage

    run = RunRecord(Placement.of(64, name="num_proc"), "TorchEstimator.fit")
    run.apply({"type": Event.STAGE, "stage": Stage.WAITING_FOR_SLOTS})
    run.finish(error=LaunchError("num_proc=64 needs 64 barrier task slots at once"))
    text = visible_text(Snapshot(run)._repr_html_())
    assert "no rank printed anything" in text, text
    assert "no output" not in text, text
