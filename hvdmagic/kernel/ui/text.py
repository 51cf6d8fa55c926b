"""The text twin: a run as plain text, for terminals, nbconvert and nbval.

While the job runs it prints each rank's output lines, labelled, up to a cap per
rank. At the end it prints a deterministic summary (no timings, no rates), so a
notebook checked by nbval can compare it: each rank's final progress and state,
and rank 0's latest metrics.
"""

from __future__ import annotations

import sys

from hvdmagic.kernel.record import RunRecord
from hvdmagic.kernel.timeline import describe
from hvdmagic.protocol import Event

MAX_LIVE_LINES = 1000  # per rank; the record keeps every line


class TextView:
    def __init__(self, record: RunRecord, out=None, err=None, max_lines: int = MAX_LIVE_LINES):
        self.record = record
        self._out = out
        self._err = err
        self._max_lines = max_lines
        self._printed = [0] * record.np

    def start(self) -> None:
        pass

    def on_event(self, event: dict) -> None:
        if event.get("type") != Event.OUTPUT:
            return
        rank = event["rank"]
        lines = list(event.get("lines") or [])
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
        stream = (self._err or sys.stderr) if event.get("stream") == "stderr" else (self._out or sys.stdout)
        stream.write(text)
        stream.flush()

    def close(self) -> None:
        text = summary(self.record)
        if self.record.timeline:
            text += describe(self.record.timeline) + "\n"
        if text:
            out = self._out or sys.stdout
            out.write(text)
            out.flush()


def summary(record: RunRecord) -> str:
    lines = []
    for rank in record.ranks:
        bar = rank.bar
        if bar is None:
            continue
        label = f" {rank.last_bar}" if rank.last_bar else ""
        total = f"/{bar.total:g}" if bar.total is not None else ""
        lines.append(f"rank {rank.rank}:{label} {bar.step:g}{total} [{rank.state}]")
    lines.extend(record.notes)
    latest = record.latest_metrics()
    if latest:
        step = max(step for step, _ in latest.values())
        values = "  ".join(f"{name}={value:.4g}" for name, (_, value) in sorted(latest.items()))
        lines.append(f"rank 0 metrics at step {step}: {values}")
    return "".join(line + "\n" for line in lines)
