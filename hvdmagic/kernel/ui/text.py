"""The text twin: a run as plain text, for terminal IPython and plain Python.

While the job runs it prints each rank's output lines, labelled, up to a cap per rank,
and, as Keras does without a progress bar, one line per finished epoch of rank 0's outer
loop (nested ``hvdmagic.track`` calls): the epoch, its inner bar, rate and time, and rank
0's latest metrics. At the end it prints the run's ``Snapshot`` text: a deterministic
headline and summary (no timings, no rates), so a notebook checked by nbval can compare
it: each rank's final progress and state, and rank 0's latest metrics. The error, if
any, is the cell's error output; the text says only "failed (see the error below)".
"""

from __future__ import annotations

import sys

from hvdmagic.kernel.noise import is_startup_noise
from hvdmagic.kernel.record import RankRecord, RunRecord
from hvdmagic.kernel.timeline import describe
from hvdmagic.kernel.ui import progress_text
from hvdmagic.kernel.ui.snapshot import Snapshot
from hvdmagic.protocol import Event, Stage

MAX_LIVE_LINES = 1000  # per rank; the record keeps every line


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

    def start(self) -> None:
        pass

    def on_event(self, event: dict) -> None:
        kind = event.get("type")
        if kind == Event.STAGE and event.get("stage") == Stage.SPARK_STARTING and not self._spark_said:
            self._spark_said = True
            self._write("hvdmagic: starting the embedded Spark (the first run in this process)\n")
        elif kind == Event.REPORT and event.get("rank") == 0 and event.get("progress"):
            self._epoch_line(self.record.ranks[0])
        elif kind == Event.LOST:
            self._write(f"hvdmagic: {progress_text.row_name(self.record, event['rank'])}'s rank was lost "
                        f"({event.get('reason')}); the others go on\n")
        elif kind == Event.RESUMED:
            self._write(f"hvdmagic: {event['reset'].describe()}\n")
        if kind != Event.OUTPUT:
            return
        rank = event["rank"]
        lines = [line for line in event.get("lines") or [] if not is_startup_noise(line)]
        if event.get("transient"):
            lines.append(event["transient"])
        room = self._max_lines - self._printed[rank]
        if room <= 0 or not lines:
            return
        shown = lines[:room]
        self._printed[rank] += len(shown)
        text = "".join(f"[rank {rank}] {line}\n" for line in shown)
        if self._printed[rank] >= self._max_lines:
            text += (f"[rank {rank}] ... output capped at {self._max_lines} lines here; "
                     f"the full log is in hvdmagic.last_run().logs[{rank}]\n")
        self._write(text, stderr=event.get("stream") == "stderr")

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

    def _write(self, text: str, stderr: bool = False) -> None:
        stream = (self._err or sys.stderr) if stderr else (self._out or sys.stdout)
        stream.write(text)
        stream.flush()

    def close(self) -> None:
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

