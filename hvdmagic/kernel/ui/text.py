"""The text twin: a run as plain text, for terminal IPython and plain Python.

While the job runs it prints each rank's output lines, labelled, up to a cap per rank,
and, as Keras does without a progress bar, one line per finished epoch of rank 0's outer
loop (nested ``hvdmagic.track`` calls): the epoch, its inner bar, rate and time, and rank
0's latest metrics. At the end it prints the run's ``Snapshot`` text: a deterministic
headline and summary (no timings, no rates), so a notebook checked by nbval can compare
it: each rank's final progress and state, and rank 0's latest metrics. The error, if
any, is the cell's error output; the text says only "failed (see the error below)".

A run of more than eight ranks (``grouping.is_grouped``) is grouped: its lines wait
``GROUP_WINDOW`` and each distinct one prints once with the ranks that printed it
(``[ranks 0–15] loading shard``), and the summary's rows are the grouped ones.
"""

from __future__ import annotations

import contextvars
import sys
import threading

from hvdmagic import rank_ranges
from hvdmagic.kernel.hang_notices import ReportLines
from hvdmagic.kernel.noise import is_startup_noise
from hvdmagic.kernel.record import RankRecord, RunRecord
from hvdmagic.kernel.timeline import describe
from hvdmagic.kernel.ui import grouping, progress_text
from hvdmagic.kernel.ui.snapshot import Snapshot
from hvdmagic.protocol import Event, Stage

MAX_LIVE_LINES = 1000  # per rank; the record keeps every line
# A many-rank run's lines wait this long (seconds), so that the same line from several ranks
# prints once with their rank list; short enough to read as live, long enough for ranks that
# run in step to have printed the line (they report every 0.1 s).
GROUP_WINDOW = 0.5
# Horovod writes a stall report in pieces: its last line may come an event later. A notice
# prints this long (seconds) after the report's first lines came, whole.
HANG_WINDOW = 0.25


class TextView:
    def __init__(self, record: RunRecord, out=None, err=None, max_lines: int = MAX_LIVE_LINES):
        self.record = record
        self._out = out
        self._err = err
        self._max_lines = max_lines
        self._printed = [0] * record.np
        self._epochs_done = 0
        self._inner: str | None = None  # rank 0's inner bar of the epoch under way, as text
        self._spark_said = False
        self._flags_said = 0  # the record's straggler flags printed so far
        self._report_lines = ReportLines()
        self._hangs_said: list[str] = []  # each hang notice's text as last printed, in the record's order
        self._hang_timer: threading.Timer | None = None
        # A many-rank run's lines wait GROUP_WINDOW in _held, (stderr, line) -> ranks, to print once.
        self._grouped = grouping.is_grouped(record)
        self._held: dict[tuple[bool, str], list[int]] = {}
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        pass

    def on_event(self, event: dict) -> None:
        kind = event.get("type")
        if kind == Event.STAGE and event.get("stage") == Stage.SPARK_STARTING and not self._spark_said:
            self._spark_said = True
            self._write(f"hvdmagic: {progress_text.spark_starting_text(self.record.np, None)}\n")
        elif kind == Event.REPORT and event.get("rank") == 0 and event.get("progress"):
            self._epoch_line(self.record.ranks[0])
        elif kind == Event.LOST:
            self._write(f"hvdmagic: {progress_text.row_name(self.record, event['rank'])}'s rank was lost "
                        f"({event.get('reason')}); the others go on\n")
        elif kind == Event.RESUMED:
            self._write(f"hvdmagic: {event['reset'].describe()}\n")
        if kind == Event.REPORT and self.record.flag_count > self._flags_said:
            self._say_stragglers()
        if kind != Event.OUTPUT:
            return
        rank = event["rank"]
        lines = event.get("lines") or []
        if event.get("stream") == "stderr":  # Horovod's stall reports print as the notice they make
            lines = self._report_lines.drop(rank, lines)
            if self.record.hang_notices:
                with self._lock:
                    if self._hang_timer is None:
                        self._hang_timer = threading.Timer(HANG_WINDOW, contextvars.copy_context().run,
                                                           args=(self._say_hangs,))
                        self._hang_timer.name = "hvdmagic-text-hangs"
                        self._hang_timer.daemon = True
                        self._hang_timer.start()
        lines = [line for line in lines if not is_startup_noise(line)]
        if event.get("transient"):
            lines.append(event["transient"])
        if self.record.all_logs_at_failure is not None:
            return  # once the run failed, the end sorts each rank's lines (_after_the_failure)
        room = self._max_lines - self._printed[rank]
        if room <= 0 or not lines:
            return
        shown = lines[:room]
        self._printed[rank] += len(shown)
        capped = ""
        if self._printed[rank] >= self._max_lines:
            capped = (f"[rank {rank}] ... output capped at {self._max_lines} lines here; "
                      f"the full log is in hvdmagic.last_run().logs[{rank}]\n")
        stderr = event.get("stream") == "stderr"
        if self._grouped:
            self._hold(rank, shown, stderr)
            if capped:  # after the lines it follows
                self._release()
                self._write(capped)
            return
        self._write("".join(f"[rank {rank}] {line}\n" for line in shown) + capped, stderr=stderr)

    # -- a many-rank run's lines, grouped ------------------------------------------------
    def _hold(self, rank: int, lines: list[str], stderr: bool) -> None:
        """Keep a many-rank run's lines for ``GROUP_WINDOW``: the same line from several ranks
        within it prints once, with their rank list."""
        with self._lock:
            for line in lines:
                ranks = self._held.setdefault((stderr, line), [])
                if not ranks or ranks[-1] != rank:
                    ranks.append(rank)
            if self._timer is None:
                self._timer = threading.Timer(GROUP_WINDOW, contextvars.copy_context().run, args=(self._release,))
                self._timer.name = "hvdmagic-text-lines"
                self._timer.daemon = True
                self._timer.start()

    def _release(self) -> None:
        with self._lock:
            held, self._held, self._timer = self._held, {}, None
            for (stderr, line), ranks in held.items():
                self._write(f"[{rank_ranges.label(ranks)}] {line}\n", stderr=stderr)

    def _say_hangs(self) -> None:
        """A line for each new hang notice, or one whose ranks changed; not for Horovod's repeats."""
        with self._lock:
            self._hang_timer = None
            for index, notice in enumerate(self.record.hang_notices):
                text = notice.line()
                if index < len(self._hangs_said) and self._hangs_said[index] == text:
                    continue
                self._hangs_said[index:index + 1] = [text]
                self._write(f"hvdmagic: {notice.line()}\n")

    def _say_stragglers(self) -> None:
        """A line for each rank newly flagged as a straggler: who, not how much (that is in
        ``last_run().stragglers``), so that a notebook's text output stays the same run to run."""
        flags = self.record.stragglers
        for flag in flags[self._flags_said:]:
            self._write(f"hvdmagic: {progress_text.STRAGGLER_SIGN} {progress_text.row_name(self.record, flag.rank)} "
                        f"is a straggler: its step rate is {progress_text.SLOWER_TEXT} below the median\n")
        self._flags_said = len(flags)

    def _epoch_line(self, rank: RankRecord) -> None:
        """When rank 0's outer bar moves on, a line for the epoch it finished."""
        outer, inner = progress_text.pick_bars(dict(rank.bars))
        # The inner bar is the finished epoch's until it restarts after the outer bar moved.
        stale = inner is not None and outer is not None and inner[1].first_time < outer[1].time
        if outer is not None:
            desc, bar = outer
            done = int(min(bar.step, bar.total))
            if done > self._epochs_done:
                self._epochs_done = done
                parts = [f"{desc.strip() or 'epoch'} {progress_text.count(done)}/{progress_text.count(bar.total)}"]
                finished = _inner_text(*inner) if stale else self._inner
                if finished:
                    parts.append(finished)
                latest = self.record.latest_metrics()
                if latest:
                    parts.append("  ".join(f"{name}={value:.4g}" for name, (_, value) in sorted(latest.items())))
                self._write("rank 0 · " + " · ".join(parts) + "\n")
        if inner is not None and not stale:
            self._inner = _inner_text(*inner)

    def _after_the_failure(self) -> None:
        """The lines each rank printed once the run had failed: those from before its own error (they
        may still explain it), then one line for the rest, the stop's fallout (Gloo's "Connection reset
        by peer"). A rank's lines and the others' errors reach the kernel in any order."""
        fallout = [0] * self.record.np
        for rank in self.record.ranks:
            if rank.logs_at_failure is None:
                continue
            cut = rank.logs_cut
            for index, (stream, line) in enumerate(rank.logs[rank.logs_at_failure:], start=rank.logs_at_failure):
                if is_startup_noise(line):
                    continue
                if index >= cut:
                    fallout[rank.rank] += 1
                elif self._printed[rank.rank] < self._max_lines:
                    self._printed[rank.rank] += 1
                    self._write(f"[rank {rank.rank}] {line}\n", stderr=stream == "stderr")
        if any(fallout):
            self._write(progress_text.after_failure_line(fallout) + "\n")

    def _write(self, text: str, stderr: bool = False) -> None:
        stream = (self._err or sys.stderr) if stderr else (self._out or sys.stdout)
        stream.write(text)
        stream.flush()

    def close(self) -> None:
        with self._lock:
            timer = self._timer
        if timer is not None:
            timer.cancel()
        self._release()  # the last lines, before the summary that follows them
        with self._lock:
            hang_timer = self._hang_timer
        if hang_timer is not None:
            hang_timer.cancel()
        self._say_hangs()  # a notice whose window had not ended yet
        self._after_the_failure()
        if self.record.ended_before_launch:  # no rank started: the error is all there is to say
            return
        text = Snapshot(self.record).text(output=False)  # the lines were printed as they came
        if self.record.timeline:
            text += describe(self.record.timeline) + "\n"
        self._write(text)


def _inner_text(desc: str, bar) -> str:
    total = f"/{progress_text.count(bar.total)}" if bar.total is not None else ""
    parts = [f"{desc} {progress_text.count(bar.step)}{total}".strip()]
    if bar.rate:
        parts.append(progress_text.rate_text(bar.rate))
    parts.append(progress_text.duration(bar.time - bar.first_time))
    return " · ".join(parts)

