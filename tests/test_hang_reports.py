"""Hang reports in the user's terms: Horovod's stall inspector as a notice (--stall-check), and
torch.distributed's DETAIL checks of mismatched collectives (%%torchrun --debug)."""

from __future__ import annotations

import io
import re
import threading
import time

import pytest
from conftest import run
from helpers import wait_until
from IPython.core.error import UsageError

import hvdmagic
from hvdmagic.errors import JobFailed
from hvdmagic.kernel.hang_notices import HangNotices, StallReader, stall_check_env
from hvdmagic.kernel.record import RunRecord
from hvdmagic.kernel.ui.snapshot import Snapshot
from hvdmagic.kernel.ui.text import TextView
from hvdmagic.launch import Placement
from hvdmagic.protocol import Event

# horovod 0.28.1's report as a rank's stderr lines (stall_inspector.cc, LOG(WARNING) with its time).
HEADER = ("[2026-11-26 00:14:03.512977: W /tmp/hvd-build-x/src/horovod-0.28.1/horovod/common/stall_inspector.cc:107] "
          "One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and are "
          "waiting for remainder of ranks for more than 2 seconds. This may indicate that different ranks are "
          "trying to submit different tensors or that only subset of ranks is submitting tensors, which will "
          "cause deadlock. ")
REPORT = [HEADER, "Missing ranks:", "1: [allreduce.grad.fc1.weight]"]


def _output(rank: int, lines: list[str], stream: str = "stderr") -> dict:
    return {"type": Event.OUTPUT, "rank": rank, "stream": stream, "lines": lines}


def _record(np: int = 3) -> RunRecord:
    return RunRecord(Placement.of(-np), "%%horovod")


@pytest.mark.unit
def test_a_report_is_read_across_its_lines_and_only_its_lines():
    reader = StallReader()
    kept = [line for line in ["before", *REPORT, "after"] if not reader.feed(line)]
    assert kept == ["before", "after"]
    assert reader.report.seconds == 2 and reader.report.missing == {1: ("allreduce.grad.fc1.weight",)}
    # "Missing ranks:" and "1: [...]" are a report's only right after its header.
    assert not reader.feed("Missing ranks:") and not reader.feed("1: [allreduce.x]")


@pytest.mark.unit
def test_a_notice_says_who_has_not_submitted_what_and_who_waits():
    notices = HangNotices()
    notices.read(0, REPORT, size=3, now=100.0)
    (notice,) = notices.notices
    assert notice.text() == "rank 1 has not submitted `allreduce.grad.fc1.weight` for 2 s; ranks 0, 2 are waiting"
    assert notice.waiting == [0, 2] and notice.reporter == 0

    notices = HangNotices()
    notices.read(0, [HEADER, "Missing ranks:", "1: [allreduce.a, allreduce.b]", "3: [allreduce.a, allreduce.b]",
                     "2!: [b.1, b.2, b.3, b.4, b.5, b.6 ...]",
                     'One or more rank (marked by "!") is stalled for longer than 9 seconds. Will shutdown.'],
                 size=4, now=1.0)
    assert notices.notices[0].text() == (
        "ranks 1, 3 have not submitted `allreduce.a`, `allreduce.b` and rank 2 has not submitted `b.1`, `b.2`, "
        "`b.3` and more for 2 s; rank 0 is waiting; Horovod shuts the job down after 9 s stalled")

    notices = HangNotices()  # every rank misses a tensor: they called different collectives
    notices.read(0, [HEADER, "Missing ranks:", "0: [broadcast.x]", "1: [allreduce.y]"], size=2, now=1.0)
    assert "every rank waits for a tensor another has not submitted" in notices.notices[0].text()


@pytest.mark.unit
def test_horovods_repeats_update_one_notice_and_another_stall_adds_one():
    notices = HangNotices()
    assert notices.read(0, REPORT[:2], size=3, now=10.0) == [] and notices.notices == []  # its ranks are to come
    notices.read(0, REPORT[2:] + ["a line of the cell"], size=3, now=10.5)
    notices.read(0, REPORT, size=3, now=12.5)  # Horovod's next check, the same stall
    (notice,) = notices.notices
    assert (notice.reports, notice.first_seen, notice.last_seen) == (2, 10.5, 12.5)
    notices.read(0, [HEADER, "Missing ranks:", "2: [allreduce.grad.fc2.weight]"], size=3, now=20.0)
    assert [n.missing for n in notices.notices] == [{1: ("allreduce.grad.fc1.weight",)},
                                                    {2: ("allreduce.grad.fc2.weight",)}]


@pytest.mark.unit
def test_a_report_whose_lines_come_apart_counts_as_what_it_turns_out_to_be():
    """Horovod writes a report piece by piece, so its lines may come in several events."""
    two = [HEADER, "Missing ranks:", "0: [allreduce.loss]", "1: [broadcast.weights]"]
    notices = HangNotices()
    notices.read(0, two[:3], size=2, now=1.0)  # rank 0 alone, at first: a stall of its own
    notices.read(0, two[:3], size=2, now=3.0)  # that stall again, so far ...
    notices.read(0, two[3:], size=2, now=3.1)  # ... but rank 1 is missing too: another stall
    assert [(n.text().split(" for ")[0], n.reports) for n in notices.notices] == [
        ("rank 0 has not submitted `allreduce.loss`", 1),
        ("rank 0 has not submitted `allreduce.loss` and rank 1 has not submitted `broadcast.weights`", 1)]
    assert notices.notices[0].last_seen == 1.0
    notices.read(0, two[:3], size=2, now=5.0)  # the second stall repeated, its first line looking like the first
    notices.read(0, two[3:], size=2, now=5.1)
    assert [n.reports for n in notices.notices] == [1, 2] and notices.notices[1].last_seen == 5.1


@pytest.mark.unit
def test_the_record_keeps_the_notice_and_the_live_views_leave_the_report_lines_out():
    record = _record()
    out = io.StringIO()
    view = TextView(record, out=out, err=out)
    for event in (_output(0, ["training"], "stdout"), _output(0, REPORT), _output(0, REPORT)):
        record.apply(event)
        view.on_event(event)
    (notice,) = record.hang_notices
    assert notice.reports == 2
    assert [line for _, _, line in record.all_logs] == ["training"]  # the dashboard's newest lines
    assert record.ranks[0].last_line == "training"
    assert record.logs[0].count("Missing ranks:") == 2  # every line stays in the log
    view.close()  # the notice prints HANG_WINDOW after its report came, or at the end
    printed = out.getvalue()
    line = ("hvdmagic: rank 1 has not submitted `allreduce.grad.fc1.weight` for 2 s; ranks 0, 2 are waiting "
            "(Horovod's stall check)")
    assert printed.count(line) == 1 and "Missing ranks" not in printed, printed
    text = Snapshot(record).text()
    assert notice.line() in text, text
    assert "hvdmagic-hang" in Snapshot(record)._repr_html_()


@pytest.mark.unit
def test_the_dashboard_shows_the_notice_under_its_header_and_in_its_text():
    from hvdmagic.kernel.ui.dashboard import Dashboard

    record = _record()
    board = Dashboard(record)
    board._draw()
    assert board.hangs.layout.display == "none"  # no notice, no room taken
    record.apply(_output(0, REPORT))
    board._draw()
    assert board.draw_error is None
    children = list(board.box.children)
    assert children.index(board.hangs) == children.index(board.header) + 1
    assert board.hangs.layout.display is None and "<code>allreduce.grad.fc1.weight</code>" in board.hangs.value
    record.apply(_output(0, REPORT))  # Horovod's repeat: the same notice, counted
    board._draw()
    assert board.hangs.value.count("hvdmagic-hang") == 1 and "reported 2 times" in board.hangs.value
    assert record.hang_notices[0].line() in board.fallback_text()
    assert "Missing ranks" not in board.recent.value


@pytest.mark.unit
@pytest.mark.parametrize("seconds", [0, -1, 2.5, "2", float("nan"), True])
def test_stall_check_takes_whole_seconds_only(seconds):
    with pytest.raises(ValueError, match=r"--stall-check must be a whole number of seconds, 1 or more"):
        stall_check_env(seconds)
    assert stall_check_env(2) == stall_check_env(2.0) == {"HOROVOD_STALL_CHECK_TIME_SECONDS": "2"}
    assert stall_check_env(None) == {}


@pytest.mark.unit
def test_the_python_api_takes_stall_check_for_new_horovod_ranks_only():
    with pytest.raises(ValueError, match="stall_check must be a whole number of seconds"):
        hvdmagic.run(print, -2, stall_check=0.5)
    with pytest.raises(ValueError, match="needs backend='horovod' and np"):
        hvdmagic.run(print, -2, backend="torch", stall_check=5)


@pytest.mark.parametrize("line, expected", [
    ("%%horovod --np -2 --stall-check 0", "--stall-check must be a whole number of seconds"),
    ("%%horovod --np -2 --stall-check 1.5", "--stall-check must be a whole number of seconds"),
    ("%%horovod --stall-check 5", "--stall-check needs ranks of its own"),
    ("%%torchrun --debug", "--debug needs ranks of its own"),
])
def test_bad_hang_options_are_one_line_usage_errors(ip, line, expected):
    _, error = run(ip, line + "\nprint(1)")
    assert isinstance(error, UsageError) and expected in str(error), error
    assert "\n" not in str(error)


def test_help_lists_the_hang_options(ip, capsys):
    ip.run_cell("%%horovod?")
    ip.run_cell("%%torchrun?")
    out = capsys.readouterr().out
    assert "--stall-check SECONDS" in out and "--debug " in out and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in out


def test_horovods_stall_report_becomes_a_notice_within_stall_check_plus_5_s(ip, tmp_path, capfd):
    """Rank 1 stays out of an allreduce that ranks 0 and 2 enter; it joins once the test saw the notice
    (or after 60 s, so the run ends whatever happens; --timeout is the last resort)."""
    stall_check = 2
    release = tmp_path / "release"
    seen: dict = {}
    before = hvdmagic.last_run()

    def watch() -> None:
        def entered():
            record = hvdmagic.last_run()
            if record is None or record is before:  # the cell's record is not there yet
                return None
            if record.ended is not None:
                raise AssertionError(f"the run ended ({record.state}) before ranks 0 and 2 reached the allreduce")
            logs = record.logs
            return record if all("entering" in logs[rank] for rank in (0, 2)) else None

        record = wait_until(entered, 120, "ranks 0 and 2 never reached the allreduce")
        start = time.monotonic()
        try:
            seen["notices"] = wait_until(lambda: record.hang_notices, stall_check + 5,
                                         lambda: f"no hang notice {stall_check + 5} s after ranks 0 and 2 entered "
                                                 f"the allreduce; rank 0's log:\n{record.logs[0]}")
            seen["after"] = time.monotonic() - start
            # The notice asks where the ranks are: it says so once they answer (a second here).
            seen["where"] = wait_until(lambda: len(record.where) == 3 and record.hang_notices[0].where, 30,
                                       lambda: f"the notice never said where all 3 were: {record.hang_notices}")
        except BaseException as exc:
            seen["error"] = exc
        finally:
            release.touch()

    thread = threading.Thread(target=watch, name="test-hang-notice")
    thread.start()
    try:
        _, error = run(ip, f"%%horovod --np -3 --stall-check {stall_check} --timeout 150\n"
                           "import os, time, torch, horovod.torch as hvd\nhvd.init()\n"
                           "if hvd.rank() == 1:\n"
                           f"    deadline = time.monotonic() + 60\n"
                           f"    while not os.path.exists({str(release)!r}) and time.monotonic() < deadline:\n"
                           "        time.sleep(0.05)\n"
                           "else:\n    print('entering', flush=True)\n"
                           "hvd.allreduce(torch.ones(1), name='grad.fc1.weight')\n")
    finally:
        thread.join(timeout=150)
    assert "error" not in seen, seen.get("error")
    assert error is None, error
    expected = "rank 1 has not submitted `allreduce.grad.fc1.weight` for 2 s; ranks 0, 2 are waiting"
    assert seen["notices"][0].text() == expected, seen
    record = hvdmagic.last_run()
    assert record.hang_notices[0].text() == expected and record.hang_notices[0].reporter == 0
    assert re.fullmatch(r"rank 1 is at Cell In\[\d+\], line [67]; ranks 0, 2 wait in `allreduce` "
                        r"\(Cell In\[\d+\], line 10\)", seen["where"]), seen["where"]
    assert record.hang_notices[0].line().endswith(f". {seen['where'][0].upper()}{seen['where'][1:]}.")
    out = capfd.readouterr().out
    assert f"hvdmagic: {expected} (Horovod's stall check)" in out, out  # the text view, as it came
    summary = out.rsplit("%%horovod np=3 (local):", 1)[1]
    assert f"{expected} (Horovod's stall check)" in summary, summary  # and its closing snapshot


def test_torchrun_debug_names_a_mismatched_collective(ip):
    """Rank 0 calls all_reduce while rank 1 calls broadcast: with --debug (DETAIL) the cell fails,
    naming both calls, instead of hanging or mixing up the tensors."""
    _, error = run(ip, "%%torchrun --np -2 --debug --timeout 60\nimport torch, torch.distributed as dist\n"
                       "dist.init_process_group('gloo')\nt = torch.ones(3)\n"
                       "if dist.get_rank() == 0:\n    dist.all_reduce(t)\nelse:\n    dist.broadcast(t, src=0)\n")
    assert isinstance(error, JobFailed), error
    rendered = "\n".join(error._render_traceback_())
    paragraph = next((p for p in rendered.split("\n\n") if "Detected mismatch between collectives" in p), None)
    assert paragraph is not None, rendered
    assert "ALLREDUCE" in paragraph and "BROADCAST" in paragraph, paragraph
