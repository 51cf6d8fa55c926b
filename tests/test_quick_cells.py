"""Quick cells stay quick: a run shows its live widgets only once it has gone on for a moment.

In a real Jupyter kernel with widgets on, on a session's warm ranks (``%horovod start --np -2``):

- a 0.1 s cell opens no widget model and leaves one compact record, its output lines in it;
- a 3 s cell gets the dashboard, built from the record, so it shows the lines printed before
  the dashboard existed; the final snapshot's text/plain holds the run's last output lines;
- while a 5 s cell runs, the text/plain a front end without widgets shows is updated about
  once a second, in a display of its own;
- a quick failure, and an interrupt before the delay, leave the full record, with no widget.

The kernel's delay is 1 s (``HVDMAGIC_DASHBOARD_DELAY``), so that a loaded machine cannot
make the 0.1 s cell outlive it; the unit tests here check the default and the view itself.
"""

from __future__ import annotations

import time

import pytest
from helpers import execute, iopub_messages, shell_reply, start_kernel, stop_kernel, wait_until

from hvdmagic.kernel.record import RunRecord
from hvdmagic.launch.placement import Placement

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
KERNEL_DELAY = 1.0


def _cell(client, code: str, timeout: float = 120) -> tuple[dict, list[tuple[float, dict]]]:
    """Run code; return its execute_reply content and every iopub message of the cell (comm
    messages included), each with the seconds since the request when it arrived."""
    sent = time.monotonic()
    msg_id = client.execute(code)
    messages = [(time.monotonic() - sent, msg) for msg in iopub_messages(client, msg_id, timeout, comms=True)]
    return shell_reply(client, msg_id), messages


def _widget_opens(messages) -> list[tuple[float, dict]]:
    return [(t, m) for t, m in messages
            if m["msg_type"] == "comm_open" and m["content"].get("target_name") == "jupyter.widget"]


def _of_type(messages, kind: str) -> list[dict]:
    return [m["content"] for _, m in messages if m["msg_type"] == kind]


@pytest.fixture(scope="module")
def widget_kernel():
    """A widget kernel (no HVDMAGIC_NONINTERACTIVE) with a local session of two warm ranks: (manager, client)."""
    manager, client = start_kernel(interactive=True, HVDMAGIC_DASHBOARD_DELAY=str(KERNEL_DELAY))
    try:
        for code in ("%load_ext hvdmagic", "%horovod start --np -2"):
            reply, texts = execute(client, code, timeout=180)
            assert reply["status"] == "ok", texts
        yield manager, client
    finally:
        stop_kernel(manager, client)


@pytest.fixture
def session_kernel(widget_kernel):
    return widget_kernel[1]


def test_a_quick_cell_opens_no_widget_and_leaves_a_compact_record(session_kernel):
    cell = ("%%horovod\nimport os, time\nrank = int(os.environ['HOROVOD_RANK'])\n"
            "print(f'hello from rank {rank}')\ntime.sleep(0.1)\nrank + 40\n")
    reply, messages = _cell(session_kernel, cell)
    assert reply["status"] == "ok", messages
    opened = _widget_opens(messages)
    assert not opened, f"a {messages[-1][0]:.2f} s cell opened {len(opened)} widget model(s)"
    assert not _of_type(messages, "update_display_data")
    [shown] = _of_type(messages, "display_data")
    assert WIDGET_VIEW not in shown["data"]
    assert shown["data"]["text/plain"] == ("%%horovod np=2 (local): finished\n"
                                           "[rank 0] hello from rank 0\n[rank 1] hello from rank 1\n")
    page = shown["data"]["text/html"]
    assert 'class="hvdmagic-snapshot hvdmagic-compact" data-state="finished"' in page, page
    assert "hello from rank 1" in page and 'class="hvdmagic-ranks"' not in page
    [result] = _of_type(messages, "execute_result")
    assert result["data"]["text/plain"] == "40"


def test_a_longer_cell_gets_the_dashboard_with_what_it_printed_before(session_kernel):
    # Rank 0 prints, then both ranks work on: the lines are in well before the cell ends.
    cell = ("%%horovod\nimport os, time\nif os.environ['HOROVOD_RANK'] == '0':\n"
            "    for i in range(30):\n        print(f'early line {i}')\n"
            "time.sleep(3)\n")
    reply, messages = _cell(session_kernel, cell)
    assert reply["status"] == "ok", messages
    opened = _widget_opens(messages)
    assert opened, "a 3 s cell opened no widget model"
    assert opened[0][0] >= KERNEL_DELAY * 0.9, f"the first widget opened {opened[0][0]:.2f} s in, before the delay"
    # The dashboard, built after the lines were printed, shows them: the newest lines' pane has the early ones.
    states = [m["content"]["data"]["state"] for _, m in messages if m["msg_type"] in ("comm_open", "comm_msg")]
    recent = [str(s.get("value", "")) for s in states if "hvdmagic-recent" in str(s.get("value", ""))]
    assert recent and "[0] early line 29" in recent[0], f"the dashboard's first newest lines: {recent[:1]}"
    [live, text] = _of_type(messages, "display_data")
    assert WIDGET_VIEW in live["data"] and WIDGET_VIEW in text["data"]
    final = [u for u in _of_type(messages, "update_display_data")
             if u["transient"]["display_id"] == live["transient"]["display_id"]]
    assert len(final) == 1, final
    data = final[0]["data"]
    assert 'class="hvdmagic-snapshot" data-state="finished"' in data["text/html"]
    # The text/plain keeps the run's last 20 lines as the text view prints them, and says where the others are.
    assert data["text/plain"] == ("%%horovod np=2 (local): finished\n"
                                  "[rank 0] ... 10 earlier lines in hvdmagic.last_run().logs[0]\n"
                                  + "".join(f"[rank 0] early line {i}\n" for i in range(10, 30))), data["text/plain"]
    closed = {m["content"]["comm_id"] for _, m in messages if m["msg_type"] == "comm_close"}
    assert {m["content"]["comm_id"] for _, m in opened} <= closed, "a widget was left open"


def test_a_long_cells_text_fallback_is_updated_about_once_a_second(session_kernel):
    cell = ("%%horovod\nimport time, hvdmagic\nfor i in range(10):\n"
            "    hvdmagic.progress(i + 1, total=10, desc='train')\n    time.sleep(0.5)\n")
    reply, messages = _cell(session_kernel, cell)
    assert reply["status"] == "ok", messages
    live, text = _of_type(messages, "display_data")
    assert live["data"]["text/plain"].startswith("%%horovod np=2 (local): live dashboard (widgets)")
    updates = [(t, m["content"]["data"]["text/plain"]) for t, m in messages if m["msg_type"] == "update_display_data"
               and m["content"]["transient"]["display_id"] == text["transient"]["display_id"]]
    assert updates and updates[-1][1] == "", "the live text was not emptied when the run ended"
    texts = [text["data"]["text/plain"]] + [t for _, t in updates[:-1]]
    assert len(set(texts)) >= 3, f"the live text/plain changed {len(set(texts)) - 1} time(s) in 5 s: {texts}"
    assert all(t.startswith("%%horovod np=2 (local): running") for t in texts), texts
    assert any("train" in t and "/10" in t for t in texts), texts
    # At most one update a second (the kernel sends them at least FALLBACK_INTERVAL apart; arrival times jitter).
    live_s = updates[-1][0] - messages[0][0]
    assert len(updates) - 1 <= live_s + 1, f"{len(updates) - 1} updates in {live_s:.1f} s: {updates}"


def test_a_quick_failure_keeps_the_full_record_and_shows_the_error_once(session_kernel):
    reply, messages = _cell(session_kernel, "%%horovod\nraise ValueError('quick boom')\n")
    assert reply["status"] == "error" and reply["ename"] == "JobFailed", reply
    assert not _widget_opens(messages), "a quick failing cell opened widgets"
    [shown] = _of_type(messages, "display_data")
    assert 'class="hvdmagic-snapshot" data-state="failed"' in shown["data"]["text/html"]
    assert 'class="hvdmagic-ranks"' in shown["data"]["text/html"], "a failure keeps the full record"
    assert shown["data"]["text/plain"].startswith("%%horovod np=2 (local): failed (see the error below)\n")
    assert "quick boom" not in shown["data"]["text/plain"] + shown["data"]["text/html"]
    [error] = _of_type(messages, "error")
    assert "quick boom" in "\n".join(error["traceback"])


def test_an_interrupt_before_the_delay_ends_the_cell_with_the_full_record(widget_kernel):
    """Last in the module: it may cost the session its ranks."""
    manager, client = widget_kernel
    sent = time.monotonic()
    msg_id = client.execute("%%horovod\nimport time\ntime.sleep(60)\n")
    messages = []
    for msg in iopub_messages(client, msg_id, 60, comms=True):
        messages.append((time.monotonic() - sent, msg))
        if msg["msg_type"] == "execute_input":
            time.sleep(0.3)  # within the delay: no dashboard yet
            manager.interrupt_kernel()
    reply = shell_reply(client, msg_id)
    assert reply["status"] == "error" and reply["ename"] == "JobInterrupted", reply
    assert messages[-1][0] < 30, "the interrupt did not end the cell"
    assert not _widget_opens(messages), "the interrupted cell opened widgets before its delay"
    [shown] = _of_type(messages, "display_data")
    assert 'class="hvdmagic-snapshot" data-state="cancelled"' in shown["data"]["text/html"]
    assert shown["data"]["text/plain"].startswith("%%horovod np=2 (local): interrupted\n")


# -- the view itself, without a kernel --------------------------------------------------------------

@pytest.mark.unit
def test_the_delay_defaults_to_a_fraction_of_a_second_and_the_environment_overrides_it(monkeypatch):
    from hvdmagic.kernel.ui import live

    assert 0.3 <= live.DELAY <= 0.5
    monkeypatch.delenv("HVDMAGIC_DASHBOARD_DELAY", raising=False)
    assert live.delay() == live.DELAY
    for given, seconds in (("0", 0.0), ("2.5", 2.5), (" 1 ", 1.0), ("soon", live.DELAY), ("-1", live.DELAY),
                           ("nan", live.DELAY), ("", live.DELAY)):
        monkeypatch.setenv("HVDMAGIC_DASHBOARD_DELAY", given)
        assert live.delay() == seconds, given


@pytest.fixture
def displayed(monkeypatch):
    """What LiveView displays at its end, and the dashboards it builds, without a kernel."""
    import IPython.display

    from hvdmagic.kernel.ui import dashboard

    shown, boards = [], []
    monkeypatch.setattr(IPython.display, "display", lambda obj, **kwargs: shown.append(obj))

    class Recorded(dashboard.Dashboard):
        def __init__(self, record):
            super().__init__(record)
            boards.append(self)

    monkeypatch.setattr(dashboard, "Dashboard", Recorded)
    return shown, boards


@pytest.mark.unit
def test_a_run_that_ends_before_the_delay_builds_no_widget(displayed):
    from ipywidgets.widgets.widget import _instances

    from hvdmagic.kernel.ui.live import LiveView
    from hvdmagic.kernel.ui.snapshot import Snapshot

    shown, boards = displayed
    before = set(_instances)
    record = RunRecord(Placement.of(-2))
    view = LiveView(record, delay_s=30)
    view.start()
    record.finish(results=[1, 1])
    view.close()
    assert not boards and set(_instances) == before, "widgets were built for a quick run"
    [snapshot] = shown
    assert isinstance(snapshot, Snapshot) and snapshot.compact and snapshot.record is record
    view._timer.join(5)
    assert not view._timer.is_alive() and not boards, "the cancelled delay still built a dashboard"


@pytest.mark.unit
def test_a_run_that_outlives_the_delay_gets_the_dashboard_drawn_from_the_whole_record(displayed):
    from hvdmagic.kernel.ui.live import LiveView

    shown, boards = displayed
    record = RunRecord(Placement.of(-2))
    record.apply({"type": "placed", "rank": 0, "host": "127.0.0.1"})
    record.apply({"type": "output", "rank": 0, "stream": "stdout", "lines": ["said before the dashboard"]})
    view = LiveView(record, delay_s=0.2)
    view.start()
    wait_until(lambda: view.dashboard is not None, 10, "the dashboard was not built after the delay")
    assert "said before the dashboard" in view.dashboard.recent.value
    record.finish(results=[1, 1])
    view.close()
    [board] = boards
    assert board._stop.is_set() and not board._thread.is_alive(), "the dashboard still redraws"
    assert not shown, "the dashboard replaces its own output; nothing else is displayed"


@pytest.mark.unit
def test_a_breakpoint_before_the_delay_shows_the_dashboard_above_pdbs_prompt(displayed):
    """A rank that stops at breakpoint() asks in the cell's output: the dashboard is built at that event,
    on the thread that asks next, so it comes above pdb's lines (on a loaded machine the delay's thread
    once built it after the prompt, between the typed line and its answer), and only once."""
    from hvdmagic.kernel.ui.live import LiveView

    shown, boards = displayed
    record = RunRecord(Placement.of(-2))
    view = LiveView(record, delay_s=30)
    view.start()
    view.on_event({"type": "debug_prompt", "rank": 1, "prompt": "(Pdb rank 1) ", "text": ""})
    assert view.dashboard is not None and len(boards) == 1, "the breakpoint's event did not show the dashboard"
    view._timer.join(5)
    assert not view._timer.is_alive() and len(boards) == 1, "the delay built a second dashboard"
    record.finish(results=[1, 1])
    view.close()
    assert not shown


@pytest.mark.unit
def test_the_live_text_is_the_rows_and_goes_out_at_most_once_a_second():
    from hvdmagic.kernel.ui import dashboard

    record = RunRecord(Placement.of(-2))
    for rank in (0, 1):
        record.apply({"type": "placed", "rank": rank, "host": "127.0.0.1"})
    record.apply({"type": "report", "rank": 0, "progress": {"train": [3, 10, time.time()]}})
    record.apply({"type": "output", "rank": 1, "stream": "stdout", "lines": ["\x1b[1mrank one's line\x1b[0m"]})
    board = dashboard.Dashboard(record)
    text = board.fallback_text(now=record.started + 65)
    head, first, second = text.splitlines()
    assert head == "%%horovod np=2 (local): running · elapsed 1:05"
    assert first.startswith("rank 0 train") and " 30% " in first and "3/10" in first and "running" in first
    assert second.startswith("rank 1 ") and second.endswith("running   rank one's line"), second

    class Handle:
        def __init__(self):
            self.updates = []

        def update(self, obj, **kwargs):
            self.updates.append(obj["text/plain"])

    board.text_handle = handle = Handle()
    record.ended = record.started + 5  # the header's clock stands still: only the rows change
    clock = 1000.0
    for _ in range(10):  # ten frames within 0.9 s: one update at most
        board._update_text(clock)
        record.apply({"type": "report", "rank": 0, "progress": {"train": [4, 10, time.time()]}})
        clock += 0.09
    assert len(handle.updates) == 1 and "3/10" in handle.updates[0]
    board._update_text(clock + 0.2)
    assert len(handle.updates) == 2 and "4/10" in handle.updates[-1]
    board._update_text(clock + 1.5)  # nothing changed since: nothing sent
    assert len(handle.updates) == 2
    board.discard()
