"""A transform's progress in the notebook: the rows the executors have predicted, one line under the cell.

Runs in the kernel. ``transform`` is lazy: the predictions run when a later action (``collect``,
``write``, an evaluator) runs the plan, in whichever cell that is, while the kernel's main
thread waits inside Spark. So the executors' Python workers report each task's start, rows
and end (``task.transform_reports``) to this server, and its thread keeps one line per cell:
the rows predicted, the tasks running and done, the rate. The line appears once predictions
have run for ``SHOW_AFTER`` seconds in a cell (a quick transform, such as a small
CrossValidator fold, stays silent), is updated at most every ``REFRESH`` seconds, and ends
with the totals once no task of the cell runs. It is a display updated in place (text and
HTML, not a widget), so every front end and a saved notebook show it.

A task belongs to the cell that was running when the task started. Its line goes to that
cell's output, whichever request the kernel handles meanwhile (``_addressed_to``).
"""

from __future__ import annotations

import contextlib
import html
import queue
import threading
import time
from dataclasses import dataclass, field

from hvdmagic import channel
from hvdmagic.protocol import Event
from hvdmagic.task.transform_reports import ReportTo

SHOW_AFTER = 2.0
REFRESH = 0.5
# Outside a Jupyter kernel every task belongs to the one cell "", which is never shown and never ends
# for good: the most of its ended tasks kept, so that a long-running script does not keep them all.
KEPT_UNSHOWN = 10_000


@dataclass
class CellProgress:
    """One cell's predictions: each task's rows and state ("running", "done", "failed", "lost"), and the
    seconds during which any of them ran (a second action in the same cell adds its own)."""

    parent: dict
    resumed: float  # when a task last started with none running
    tasks: dict[tuple[int, str], tuple[int, str]] = field(default_factory=dict)  # by (worker's link, task)
    spent: float = 0.0  # the seconds of the earlier spells with tasks running
    ended: float | None = None
    handle: object = None  # the display, once shown
    shown: str = ""

    @property
    def running(self) -> int:
        return sum(state == "running" for _, state in self.tasks.values())

    def note(self, task: tuple[int, str], rows: int | None, state: str) -> None:
        now = time.monotonic()
        known = self.tasks.get(task)
        if known is not None and known[1] != "running" and state == "lost":
            return  # it had ended before its worker went
        if self.ended is not None and state == "running":
            self.resumed, self.ended = now, None
        self.tasks[task] = ((known or (0, ""))[0] if rows is None else rows, state)
        if self.running == 0 and self.ended is None:
            self.spent += now - self.resumed
            self.ended = now

    def seconds(self, now: float) -> float:
        return self.spent + (now - self.resumed if self.ended is None else 0.0)

    def line(self, now: float) -> str:
        rows = sum(rows for rows, _ in self.tasks.values())
        states = [state for _, state in self.tasks.values()]
        seconds = self.seconds(now)
        rate = f"{rows / seconds:,.0f} rows/s" if seconds > 0 else "…"
        failed = states.count("failed") + states.count("lost")
        retried = f"; {failed} task(s) failed or lost (Spark runs them again)" if failed else ""
        if self.ended is not None:
            return (f"transform: {rows:,} rows predicted by {states.count('done')} task(s) in {seconds:.1f} s "
                    f"({rate}){retried}")
        return (f"transform: {rows:,} rows predicted · {self.running} task(s) running, {states.count('done')} "
                f"done · {rate} · {seconds:.1f} s{retried}")


class ProgressServer:
    """Where one kernel address's transforms report; ``report_to`` goes into their UDFs."""

    def __init__(self, host: str):
        secret = channel.new_secret()
        self._server = channel.ChannelServer(host, secret)
        self.report_to = ReportTo(self._server.address, secret)
        self.cells: dict[str, CellProgress] = {}  # by the msg_id of the cell's request
        # (worker's link, task) -> the msg_id its lines go to; Spark's task names repeat across applications
        self._task_cell: dict[tuple[int, str], str] = {}
        self._shown_at = 0.0
        threading.Thread(target=self._follow, name="hvdmagic-transform-progress", daemon=True).start()

    def _follow(self) -> None:
        while True:
            try:
                link, event = self._server.events.get(timeout=REFRESH)
            except queue.Empty:
                self._show()
                continue
            if event.get("type") == Event.GONE:  # a worker went (its executor lost): its tasks with it
                for key, cell_id in list(self._task_cell.items()):
                    if key[0] == id(link) and cell_id in self.cells:
                        self.cells[cell_id].note(key, None, "lost")
            elif event.get("type") == Event.PREDICTED:
                self._noted(link, str(event.get("task")), int(event.get("rows", 0)), str(event.get("state")))
            self._show(throttled=True)

    def _noted(self, link, task: str, rows: int, state: str) -> None:
        key = (id(link), task)
        cell_id = self._task_cell.get(key)
        if cell_id is None:
            parent = _current_request()
            cell_id = self._task_cell[key] = parent.get("header", {}).get("msg_id", "")
            if cell_id not in self.cells:
                self.cells[cell_id] = CellProgress(parent, time.monotonic())
            self._forget_ended(keep=cell_id)
        self.cells[cell_id].note(key, rows, state)
        if not cell_id:
            self._trim_unshown(self.cells[cell_id])

    def _trim_unshown(self, cell: CellProgress) -> None:
        excess = len(cell.tasks) - KEPT_UNSHOWN
        if excess > 0:
            for key in [key for key, (_, state) in cell.tasks.items() if state != "running"][:excess]:
                del cell.tasks[key]
                self._task_cell.pop(key, None)

    def _forget_ended(self, keep: str) -> None:
        for cell_id in [c for c, cell in self.cells.items() if c != keep and cell.ended is not None]:
            del self.cells[cell_id]
            self._task_cell = {key: c for key, c in self._task_cell.items() if c != cell_id}

    def _show(self, throttled: bool = False) -> None:
        now = time.monotonic()
        if throttled and now - self._shown_at < REFRESH:
            return
        self._shown_at = now
        for cell in self.cells.values():
            if cell.handle is None and cell.seconds(now) < SHOW_AFTER:
                continue
            line = cell.line(now)
            if line != cell.shown:
                _display(cell, line)


def _current_request() -> dict:
    """The request the kernel is handling now: the cell whose action runs the plan."""
    shell = _kernel_shell()
    return dict(getattr(shell, "parent_header", None) or {}) if shell is not None else {}


def _kernel_shell():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return shell if getattr(shell, "kernel", None) is not None else None


def _display(cell: CellProgress, line: str) -> None:
    """Show or update the cell's line, in that cell's output."""
    shell = _kernel_shell()
    if shell is None:
        return
    data = {"text/plain": line, "text/html": f'<div class="hvdmagic-transform"><code>{html.escape(line)}</code></div>'}
    with _addressed_to(shell.display_pub, cell.parent):
        if cell.handle is None:
            from IPython.display import display

            cell.handle = display(data, raw=True, display_id=True)
        else:
            cell.handle.update(data, raw=True)
        cell.shown = line


@contextlib.contextmanager
def _addressed_to(publisher, parent: dict):
    """What this thread displays meanwhile goes to ``parent``'s cell, not to the cell running now.
    ipykernel 7 keeps a parent per thread (``set_thread_parent``). An older one (Databricks' and
    Colab's ipykernel 6) keeps one per publisher, but runs the publishing thread's own hooks on each
    message before it is sent, so a hook of this thread's re-addresses it."""
    if hasattr(publisher, "set_thread_parent"):
        token = publisher.set_thread_parent(parent)
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):
                publisher.reset_thread_parent(token)
        return
    header = dict(parent.get("header", {}))

    def readdress(msg: dict) -> dict:
        msg["parent_header"] = header
        return msg

    publisher.register_hook(readdress)
    try:
        yield
    finally:
        publisher.unregister_hook(readdress)


_servers: dict[str, ProgressServer] = {}
_lock = threading.Lock()


def report_to(kernel_host: str) -> ReportTo:
    """Where a transform's tasks report, at ``kernel_host`` (outside a Jupyter kernel the reports are
    kept, in ``server_at(kernel_host).cells``, and nothing is shown)."""
    return server_at(kernel_host).report_to


def server_at(kernel_host: str) -> ProgressServer:
    with _lock:
        server = _servers.get(kernel_host)
        if server is None:
            server = _servers[kernel_host] = ProgressServer(kernel_host)
    return server
