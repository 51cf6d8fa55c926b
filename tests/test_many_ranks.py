"""A view for 16 to 256 ranks: grouped rows, each line once with its rank list, every rank one click away."""

from __future__ import annotations

import io
import os
import re

import pytest
from conftest import run

import hvdmagic
from hvdmagic import rank_ranges, stacks
from hvdmagic.errors import JobFailed, RankFailure
from hvdmagic.kernel.record import RunRecord
from hvdmagic.kernel.ui import grouping
from hvdmagic.kernel.ui import text as text_ui
from hvdmagic.kernel.ui.snapshot import Snapshot
from hvdmagic.launch.placement import Placement

# -- unit: the rank lists -------------------------------------------------------------------


@pytest.mark.unit
def test_rank_lists_compress_runs_of_three_or_more():
    assert rank_ranges.compress([]) == ""
    assert rank_ranges.compress([3]) == "3"
    assert rank_ranges.compress([7, 8]) == "7, 8"
    assert rank_ranges.compress([5, 0, 1, 2, 3, 7, 8, 3]) == "0–3, 5, 7, 8"
    assert rank_ranges.compress([*range(11), *range(12, 64)]) == "0–10, 12–63"
    assert rank_ranges.label([4]) == "rank 4" and rank_ranges.label(range(16)) == "ranks 0–15"
    assert rank_ranges.label([0, 2], "task") == "tasks 0, 2"


@pytest.mark.unit
def test_grouped_stacks_name_their_ranks_with_the_same_formatter():
    same = 'Current thread:\n  File "<horovod-cell>", line 7 in <module>'
    lines = stacks.describe({r: same for r in range(12)} | {5: "Current thread:\n  File \"x\", line 1"})
    assert "ranks 0–4, 6–11:" in lines and "rank 5:" in lines, lines


# -- unit: grouped rows -----------------------------------------------------------------------


def _record(np_: int, *, steps=None, total: int = 300, lines=None) -> RunRecord:
    """A live run of ``np_`` local ranks: rank r at ``steps[r]`` of ``total``, having printed ``lines(r)``."""
    record = RunRecord(Placement.of(-np_))
    for rank in range(np_):
        record.apply({"type": "placed", "rank": rank, "host": "vm"})
        step = steps(rank) if steps else total
        record.apply({"type": "report", "rank": rank, "progress": {"train": [step, total, 1.0 + step]}})
        if lines:
            record.apply({"type": "output", "rank": rank, "stream": "stdout", "lines": lines(rank)})
    return record


def _finish(record: RunRecord, failed: int | None = None) -> RunRecord:
    if failed is not None:
        record.apply({"type": "error", "rank": failed})
    for rank in range(record.np):
        code = 0 if failed is None else 1 if rank == failed else -15
        record.apply({"type": "exit", "rank": rank, "code": code, "aborted": failed is not None and rank != failed})
    if failed is None:
        record.finish(results=[None] * record.np)
    else:
        record.finish(error=JobFailed([RankFailure(failed, "ValueError: boom", "ValueError: boom\n")], []))
    return record


def _names(record: RunRecord) -> list[tuple[str, str]]:
    return [(group.name(record), group.reason) for group in grouping.rows(record)]


@pytest.mark.unit
def test_up_to_eight_ranks_keep_a_row_each_and_more_are_grouped():
    for np_, grouped in ((2, False), (8, False), (9, True), (64, True)):
        record = _finish(_record(np_))
        assert grouping.is_grouped(record) is grouped
        summary = Snapshot(record).text()
        rows = [line for line in summary.splitlines() if re.match(r"ranks? \d", line)]
        assert len(rows) == (np_ if not grouped else 1), summary
    assert "ranks 0–63: train 300/300 [finished]" in Snapshot(_finish(_record(64))).text()


@pytest.mark.unit
def test_a_failed_rank_keeps_its_own_row_and_the_stopped_ones_share_one_with_their_step_range():
    record = _finish(_record(16, steps=lambda r: 40 if r == 11 else 100 + r % 3, total=300), failed=11)
    assert _names(record) == [("ranks 0–10, 12–15", ""), ("rank 11", "")]
    summary = Snapshot(record).text()
    assert "ranks 0–10, 12–15: train 100–102/300 [stopped]" in summary, summary
    assert "rank 11: train 40/300 [failed]" in summary, summary


@pytest.mark.unit
def test_while_live_the_slowest_rank_is_kept_apart_and_equal_ranks_keep_none():
    record = _record(32, steps=lambda r: 150 - (r % 4) if r != 21 else 90)
    assert _names(record) == [("ranks 0–20, 22–31", ""), ("rank 21", grouping.SLOWEST)]
    group = grouping.rows(record)[0]
    assert group.steps() == "147–150/300" and group.slowest.rank == 3  # the lowest step, the lowest rank
    assert _names(_record(32, steps=lambda r: 150)) == [("ranks 0–31", "")]
    # Ranks still starting share a row by their stage, apart from those that train.
    record = RunRecord(Placement.of(-12))
    for rank in range(12):
        record.apply({"type": "placed", "rank": rank, "host": "vm"})
        record.apply({"type": "stage", "rank": rank, "stage": "hvd.init" if rank < 10 else "first step"})
    assert _names(record) == [("ranks 0–9", ""), ("ranks 10, 11", "")]
    # And by what they import: "importing tensorflow" is not "importing".
    record = RunRecord(Placement.of(-12))
    for rank in range(12):
        record.apply({"type": "placed", "rank": rank, "host": "vm"})
        record.apply({"type": "stage", "rank": rank, "stage": "importing"})
        if rank != 4:
            record.apply({"type": "stage", "rank": rank, "stage": "importing", "importing": "tensorflow"})
    assert _names(record) == [("ranks 0–3, 5–11", ""), ("rank 4", "")]


def _paced(np_: int, steps, total: int = 20, rate: float = 10 / 3) -> RunRecord:
    """A live run of ``np_`` ranks that all made their steps at ``rate`` a second: rank r at ``steps(r)``."""
    record = RunRecord(Placement.of(-np_))
    for rank in range(np_):
        record.apply({"type": "placed", "rank": rank, "host": "vm"})
        record.apply({"type": "report", "rank": rank, "progress": {"train": [0, total, 100.0]}})
        step = steps(rank)
        record.apply({"type": "report", "rank": rank, "progress": {"train": [step, total, 100.0 + step / rate]}})
    return record


@pytest.mark.unit
def test_a_tie_is_not_a_slowest_row():
    # Issue 37: 24 ranks in step at 3.3 steps a second, read at step 5 or 6 of 20. Rank 0 is the
    # lowest, by one step: a tie, so one row, drawn as rank 0, with the step range.
    record = _paced(24, lambda r: 5 if r % 3 == 0 else 6)
    assert _names(record) == [("ranks 0–23", "")]
    assert grouping.rows(record)[0].steps() == "5–6/20"
    # Further behind than reporting explains (a step, and half a second's worth: 1.7 steps here): rank 0 is
    # news, the others share a row.
    assert _names(_paced(24, lambda r: 4 if r == 0 else 6)) == [("rank 0", grouping.SLOWEST), ("ranks 1–23", "")]
    # Many steps a second: a lag of less than half a second is a tie, whatever its steps.
    fast = _paced(24, lambda r: 130 if r == 7 else 170 + r % 5, total=1000, rate=100.0)
    assert _names(fast) == [("ranks 0–23", "")]
    assert grouping.really_behind(fast.ranks[7], fast.ranks[:7]) is False
    # Without a rate yet (one report each), more than a whole step behind is behind.
    assert _names(_record(12, steps=lambda r: 99 if r == 4 else 100)) == [("ranks 0–11", "")]
    assert ("rank 4", grouping.SLOWEST) in _names(_record(12, steps=lambda r: 98 if r == 4 else 100))


@pytest.mark.unit
def test_a_flagged_rank_keeps_its_own_row_through_the_marker_hook(monkeypatch):
    record = _record(16, steps=lambda r: 150)
    monkeypatch.setattr(grouping, "OWN_ROW", [lambda run, rank: "watch me" if rank.rank in (3, 9) else ""])
    assert _names(record) == [("ranks 0–2, 4–8, 10–15", ""), ("rank 3", "watch me"), ("rank 9", "watch me")]
    assert "rank 3: train 150/300 [running, watch me]" in Snapshot(record).text()

    def broken(run, rank):
        raise RuntimeError("a marker's bug")

    monkeypatch.setattr(grouping, "OWN_ROW", [broken])
    assert _names(record) == [("ranks 0–15", "")], "a marker that raises must not cost the view its rows"


@pytest.mark.unit
def test_the_straggler_flag_on_a_ranks_record_keeps_it_apart():
    record = _record(12, steps=lambda r: 150)

    class Flag:  # what kernel/stragglers.py's Straggler carries that the marker reads
        slower = 0.35

    record.ranks[7].straggler = Flag()
    assert ("rank 7", "straggler, 35 % slower") in _names(record)


# -- unit: each line once ---------------------------------------------------------------------


@pytest.mark.unit
def test_identical_lines_are_shown_once_with_their_rank_list_whatever_the_arrival_order():
    def lines(rank):
        own = [f"rank {rank} done"] if rank != 12 else ["rank 12 done", "a warning only rank 12 gives"]
        return ["epoch 1 loss 0.5", "epoch 2 loss 0.25", *own, "bye"]

    forward = _record(16, lines=lines)
    backward = RunRecord(Placement.of(-16))
    for rank in reversed(range(16)):
        backward.apply({"type": "output", "rank": rank, "stream": "stdout", "lines": lines(rank)})
    blocks, left_out = grouping.grouped_lines(forward, per_rank=20, limit=100)
    assert left_out == 0
    assert blocks == grouping.grouped_lines(backward, per_rank=20, limit=100)[0]
    flat = [(block.name(), line) for block in blocks for _, line in block.lines]
    assert flat[:2] == [("ranks 0–15", "epoch 1 loss 0.5"), ("ranks 0–15", "epoch 2 loss 0.25")]
    assert ("rank 12", "a warning only rank 12 gives") in flat and flat[-1] == ("ranks 0–15", "bye")
    # Lines that differ only by each rank's own number are one line, which reads back exactly.
    assert ("ranks 0–15", "rank {rank} done") in flat
    assert len(flat) == 2 + 1 + 1 + 1, flat
    # The latest lines are kept when there are more distinct lines than room.
    blocks, left_out = grouping.grouped_lines(forward, per_rank=20, limit=2)
    assert left_out == 3 and [line for block in blocks for _, line in block.lines] == [
        "a warning only rank 12 gives", "bye"]


@pytest.mark.unit
def test_only_a_ranks_own_number_is_a_field_and_a_failed_ranks_lines_are_never_left_out():
    def lines(rank):
        return [f"loss 0.{rank}7", f"epoch {rank % 2}", f"step 170 of rank {rank}", "done"]

    record = _record(12, lines=lines)
    flat = [(block.name(), line) for block in grouping.grouped_lines(record, per_rank=20, limit=100)[0]
            for _, line in block.lines]
    assert ("rank 1", "loss 0.17") in flat and ("rank 3", "loss 0.37") in flat, "a decimal is not a rank number"
    assert ("ranks 0, 1", "epoch {rank}") not in flat and ("rank 1", "epoch 1") not in flat
    assert ("ranks 0, 2, 4, 6, 8, 10", "epoch 0") in flat, "a line others printed as it is stays as it is"
    assert ("ranks 0–11", "step 170 of rank {rank}") in flat
    record.apply({"type": "error", "rank": 4})
    blocks, left_out = grouping.grouped_lines(record, per_rank=20, limit=4)
    kept = [(block.name(), line) for block in blocks for _, line in block.lines]
    assert kept == [("rank 4", "loss 0.47"), ("ranks 0, 2, 4, 6, 8, 10", "epoch 0"),
                    ("ranks 0–11", "step 170 of rank {rank}"), ("ranks 0–11", "done")], kept
    assert left_out == 12, "the other ranks' loss lines and the odd ranks' epoch line"


@pytest.mark.unit
def test_the_snapshot_of_64_ranks_is_a_few_rows_with_every_rank_one_click_away():
    record = _finish(_record(64, lines=lambda r: ["loading shard", f"rank {r} done after 300 steps"] if r != 40
                             else ["loading shard", "Traceback (most recent call last):", "ValueError: boom"]),
                     failed=40)
    text = Snapshot(record).text()
    assert "[ranks 0–63] loading shard" in text and "[rank 40] ValueError: boom" in text, text
    assert len(text.splitlines()) < 35, f"the text/plain of 64 ranks should fit a screen:\n{text}"
    markup = Snapshot(record)._repr_html_()
    grouped = re.search(r'<table class="hvdmagic-ranks hvdmagic-grouped".*?</table>', markup, re.S).group(0)
    assert grouped.count("<tr class=\"hvdmagic-rank\"") == 2
    assert 'data-ranks="40"' in grouped and "ranks 0–39, 41–63" in grouped
    every = re.search(r'<details class="hvdmagic-every-rank".*?</details>', markup, re.S).group(0)
    assert every.count('<tr class="hvdmagic-rank" data-rank=') == 64
    assert '<details class="hvdmagic-every-log"' in markup
    # The failed rank's own log block sits outside the fold, and again inside it with every rank's.
    before_fold = markup.split('<details class="hvdmagic-every-log"')[0]
    assert '<div class="hvdmagic-log" data-rank="40"' in before_fold
    assert markup.count('<div class="hvdmagic-log" data-rank=') == 65
    # A quick run's compact record of 64 ranks is as short.
    quick = _finish(_record(64, lines=lambda r: ["loading shard", f"rank {r} done"]))
    compact = Snapshot(quick, compact=True)._repr_html_()
    assert 'hvdmagic-compact' in compact and "[ranks 0–63] rank {rank} done" in compact
    assert "ranks 0–63: train 300/300 [finished]" in compact and compact.count("\n") < 10, compact


# -- unit: the live views -------------------------------------------------------------------


@pytest.mark.unit
def test_the_text_view_prints_a_line_several_ranks_gave_once():
    record = RunRecord(Placement.of(-16))
    out = io.StringIO()
    view = text_ui.TextView(record, out=out, err=out)
    for rank in range(16):
        event = {"type": "output", "rank": rank, "stream": "stdout",
                 "lines": ["epoch 1 done", f"rank {rank} says hi"] if rank != 3 else ["epoch 1 done"]}
        record.apply(event)
        view.on_event(event)
    record.finish(results=[None] * 16)
    view.close()  # prints what it still held, before the summary
    printed = out.getvalue()
    assert printed.count("epoch 1 done") == 1 and "[ranks 0–15] epoch 1 done" in printed, printed
    assert "[rank 7] rank 7 says hi" in printed and "rank 3 says hi" not in printed
    assert printed.index("epoch 1 done") < printed.index("%%horovod np=16 (local): finished")


@pytest.mark.unit
def test_a_group_rows_step_range_is_whole_and_its_last_line_ends_in_an_ellipsis_with_its_title():
    from hvdmagic.kernel.ui import progress_text
    from hvdmagic.kernel.ui.dashboard import Dashboard

    def drawn(record: RunRecord) -> tuple[Dashboard, str, str]:
        for rank in range(record.np):
            record.apply({"type": "output", "rank": rank, "stream": "stdout", "lines": [line]})
        board = Dashboard(record)
        board._draw(force=True)
        assert board.draw_error is None and len(board.group_rows.children) == 1
        return board, board._group_pool[0].right.value, board._group_pool[0].line.value

    line = "epoch 3: loss 2.2154 " + "x" * 200  # longer than any row has room for
    # Issue 37: the range went before the last line, and the row cut it ("steps 5–6/20 ·"). It is in the
    # steps column now, where the rank's own "5/20" would be, and nothing cuts it.
    board, right, cell = drawn(_paced(24, lambda r: 5 if r % 3 == 0 else 6))
    shown_right = re.sub(r"<[^>]+>", "", right)  # the columns' spans (kernel/ui/row_fit.py) read as one line
    assert "  5–6/20      3.33 it/s" in shown_right and "hvdmagic-steps" not in cell and "steps" not in cell
    # The last line shrinks with the row, cut with an ellipsis where the row ends and whole in its title;
    # the column's box takes the room the row leaves it (width 0, growing to it), not its text's width.
    shown = re.search(r'<span style="([^"]*)" title="([^"]*)">', cell)
    assert shown and shown[2] == f"[0] {line}" and "text-overflow:ellipsis" in shown[1] and "min-width:0" in shown[1]
    assert "width:0;min-width:100%" in cell.split(">", 1)[0]
    text = board.fallback_text().splitlines()[1]
    assert "  5–6/20      3.33 it/s" in text and text.endswith(f"running   [0] {line[:79]}…"), text
    rank = grouping.rows(board.record)[0].slowest
    assert len(progress_text.row(rank, steps=progress_text.count_column("145–150", 300))) == len(
        progress_text.row(rank)), "the steps column keeps its width"
    board.discard()
    # A range too long for the steps column goes before the last line, an element of its own that
    # gives way only once the line has no room left (a thousand times the weight), each whole in its title.
    board, right, cell = drawn(_paced(12, lambda r: 12345 if r % 2 else 12399, total=99999, rate=5000.0))
    assert progress_text.count_column("12345–12399", 99999) is None and "12345/" in right
    steps = re.search(r'<span class="hvdmagic-steps" style="([^"]*)" title="([^"]*)">([^<]*)</span>', cell)
    assert steps and steps[2] == "steps 12345–12399/99999" and steps[3] == "steps 12345–12399/99999 · ", cell
    shown = re.search(r'<span style="([^"]*)" title="([^"]*)">', cell.split("</span>", 1)[1])
    for style, shrink in ((steps[1], "1"), (shown[1], "1000")):
        assert "text-overflow:ellipsis" in style and "min-width:0" in style
        assert re.search(rf"flex:\d {shrink} auto", style), style
    assert f"steps 12345–12399/99999 · [1] {line[:79]}…" in board.fallback_text()
    board.discard()


@pytest.mark.unit
def test_the_dashboard_of_64_ranks_draws_a_row_per_group_and_every_rank_folded():
    from hvdmagic.kernel.ui.dashboard import Dashboard

    record = _record(64, steps=lambda r: 200 if r != 17 else 120, lines=lambda r: ["warming up", f"r{r}"])
    board = Dashboard(record)
    board._draw(force=True)
    assert board.draw_error is None and board.rows == []
    shown = [row for row in board.group_rows.children]
    assert len(shown) == 2 and len(board._group_pool) == 2
    labels = [row.label.value for row in board._group_pool]
    assert "ranks 0–16, 18–63" in labels[0] and "rank 17" in labels[1] and "slowest" in labels[1]
    every = board.every_rank.value
    assert every.count("\n") == 63 and "rank 63" in every, "every rank's own row, one click away"
    assert "[ranks 0–63] warming up" in board.recent.value
    assert len(board.panes) == 3 and "[ranks 0–63] warming up" in board.panes[1].value
    board.log_rank.value = 17
    board._draw()
    assert "r17" in board.panes[2].value and "r16" not in board.panes[2].value
    fallback = board.fallback_text()
    assert len(fallback.splitlines()) == 3, fallback  # the header and two rows, not 64
    # The run ends: one row again (and fewer widgets shown), as the pool shrinks to the groups.
    for rank in range(64):
        record.apply({"type": "report", "rank": rank, "progress": {"train": [300, 300, 400.0]}})
    _finish(record)
    board._draw(force=True)
    assert len(board.group_rows.children) == 1 and "ranks 0–63" in board._group_pool[0].label.value
    from hvdmagic.kernel.ui.dashboard import _descendants

    pooled = [widget for row in board._group_pool for widget in _descendants(row.box)]
    assert pooled and all(widget.comm is not None for widget in pooled)
    board.discard()
    assert all(widget.comm is None for widget in pooled), "a group row no longer shown was left open"


# -- real ranks ---------------------------------------------------------------------------------

LOOP = """%%horovod --np -16
import os, time, hvdmagic
rank = int(os.environ["HOROVOD_RANK"])
print("loading shard", flush=True)
for step in hvdmagic.track(range(30), desc="train"):
    time.sleep(0.01)
    {fail}
print(f"rank {{rank}} done after 30 steps", flush=True)
rank
"""


def _expand(ranks: str) -> list[int]:
    """"0–4, 6" -> [0, 1, 2, 3, 4, 6]: a rank list read back."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in ranks.split(","))):
        first, _, last = part.partition("–")
        out.extend(range(int(first), int(last or first) + 1))
    return out


def _rank_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"ranks? \d", line)]


def test_sixteen_real_ranks_collapse_to_one_row_in_the_text_view(ip, capfd):
    result, error = run(ip, LOOP.format(fail=""))
    assert error is None and result == 0, error
    out = capfd.readouterr().out
    assert _rank_rows(out) == ["ranks 0–15: train 30/30 [finished]"], out
    # Printed live, each line waits half a second for the same line from other ranks: ranks that
    # start further apart on a busy machine print it in a few groups, each rank in one of them.
    shard = [re.match(r"\[ranks? ([\d–, ]+)\] loading shard$", line) for line in out.splitlines()
             if line.endswith("] loading shard")]
    assert all(shard) and 1 <= len(shard) <= 8, out
    assert sorted(rank for match in shard for rank in _expand(match.group(1))) == list(range(16)), out
    assert "[rank 9] rank 9 done after 30 steps" in out
    record = hvdmagic.last_run()
    assert all(record.logs[r].startswith("loading shard\n") for r in range(16)), "last_run() keeps every rank's log"


def test_a_failing_rank_among_sixteen_keeps_its_own_row_and_its_log(ip, capfd, tmp_path):
    # Rank 5 fails once every other rank has reached step 20 (each leaves a file there, then
    # waits to be stopped), so that all of them have reported their bars: one row for them.
    fail = (f'if rank != 5 and step == 20:\n'
            f'        open(os.path.join({str(tmp_path)!r}, str(rank)), "w").close()\n'
            f'        time.sleep(120)  # until the failure stops this rank\n'
            f'    if rank == 5 and step == 10:\n'
            f'        deadline = time.monotonic() + 120\n'
            f'        while len(os.listdir({str(tmp_path)!r})) < 15 and time.monotonic() < deadline:\n'
            f'            time.sleep(0.05)\n'
            f'        print("rank 5 is about to fail", flush=True)\n'
            f'        raise ValueError("boom on rank 5")')
    _, error = run(ip, LOOP.format(fail=fail))
    assert isinstance(error, JobFailed) and "boom on rank 5" in str(error), error
    out = capfd.readouterr().out
    rows = _rank_rows(out)
    assert len(os.listdir(tmp_path)) == 15, "rank 5 failed before the others were all waiting"
    # The others, stopped at step 20 (or a report before it), share one row; the failed rank has its own.
    # (Step 20's report may not have left a rank before the stop: under load its flusher runs late.)
    assert len(rows) == 2 and re.fullmatch(r"ranks 0–4, 6–15: train (\d+–)?\d+/30 \[stopped\]", rows[0]), out
    # Its row says where in the cell it failed (issue 48): the raise's line.
    assert re.fullmatch(r"rank 5: train 10/30 \[failed in the cell \(Cell In\[\d+\], line \d+\)\]", rows[1]), out
    assert "[rank 5] rank 5 is about to fail" in out, out
    assert "rank 5 is about to fail" in hvdmagic.last_run().logs[5]
