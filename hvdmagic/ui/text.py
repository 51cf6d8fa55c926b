"""Live plain-text output of a run: every rank's lines, labelled, as they arrive."""

from __future__ import annotations

import sys


class TextOutput:
    """Receives job events and prints rank output to the cell's stdout/stderr."""

    def __init__(self, out=None, err=None):
        self._out = out
        self._err = err

    def __call__(self, event: dict) -> None:
        if event.get("type") != "output":
            return
        stream = (self._err or sys.stderr) if event.get("stream") == "stderr" else (self._out or sys.stdout)
        prefix = f"[rank {event['rank']}] "
        lines = list(event.get("lines") or [])
        if event.get("transient"):
            lines.append(event["transient"])
        if lines:
            stream.write("".join(prefix + line + "\n" for line in lines))
            stream.flush()
