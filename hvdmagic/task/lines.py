"""A rank's output as the driver gets it: complete lines, the latest \r update, and event lines."""

from __future__ import annotations

import re

TRANSIENT_INTERVAL = 1.0  # seconds between forwarded \r progress updates per stream
MAX_LINE = 10_000
_LINE_END = re.compile(r"\r\n|\n|\r")
# Keras' progress bar rewrites its line with as many backspaces as it printed, then \r.
_BACKSPACES_THEN_CR = re.compile(r"\x08+\r")


class LineSplitter:
    """Turns a byte stream into complete lines plus the latest \\r-terminated update.

    A tqdm-style bar rewrites its line with \\r many times a second; only the
    newest state matters, so transient updates are rate-limited and superseded.
    """

    def __init__(self, interval: float = TRANSIENT_INTERVAL):
        self._buffer = ""
        self._interval = interval
        self._last_transient = float("-inf")
        self.pending_transient: str | None = None

    def feed(self, text: str, now: float) -> tuple[list[str], str | None]:
        """Returns (complete lines, transient to show now or None)."""
        self._buffer = _BACKSPACES_THEN_CR.sub("\r", self._buffer + text)
        lines: list[str] = []
        pos = 0
        for match in _LINE_END.finditer(self._buffer):
            segment = _erase(self._buffer[pos:match.start()])[:MAX_LINE]
            pos = match.end()
            if match.group() == "\r":
                self.pending_transient = segment
            else:
                lines.append(segment)
                self.pending_transient = None
        self._buffer = self._buffer[pos:]
        if len(self._buffer) > MAX_LINE:  # a runaway line with no end
            lines.append(self._buffer[:MAX_LINE])
            self._buffer = ""
        if lines:
            self._last_transient = float("-inf")
        transient = None
        if self.pending_transient is not None and now - self._last_transient >= self._interval:
            transient, self.pending_transient = self.pending_transient, None
            self._last_transient = now
        return lines, transient

    def finish(self) -> list[str]:
        tail = [t for t in (self.pending_transient, self._buffer) if t]
        self.pending_transient, self._buffer = None, ""
        return tail


def _erase(segment: str) -> str:
    """Apply the backspaces left in a line, as a terminal would."""
    if "\b" not in segment:
        return segment
    kept: list[str] = []
    for char in segment:
        if char == "\b":
            if kept:
                kept.pop()
        else:
            kept.append(char)
    return "".join(kept)


def split_at_marks(data: bytes, mark: bytes) -> tuple[list[bytes], bytes]:
    """``data`` cut at each ``mark``: the pieces around the marks (one more than there were
    marks), and a tail held back from the last piece because it may be the start of a mark
    that the next read completes."""
    pieces = data.split(mark)
    last = pieces[-1]
    for keep in range(min(len(mark) - 1, len(last)), 0, -1):
        if mark.startswith(last[-keep:]):
            pieces[-1] = last[:-keep]
            return pieces, last[-keep:]
    return pieces, b""


def relayed(line: bytes, tail: bytes) -> bytes | None:
    """A rank's event line as the frame the driver gets, ``tail`` naming the rank; None to skip it.

    Relayed as text: appending the rank is all an event needs, and decoding then
    re-encoding every metric row here cost more than everything else on its way.
    The appended key comes last, and JSON keeps the last of duplicate keys, so a
    rank cannot claim another rank's number.
    """
    line = line.rstrip(b"\n")
    if len(line) > 2 and line.startswith(b"{") and line.endswith(b"}"):
        return line[:-1] + tail
    return None
