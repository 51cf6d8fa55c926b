"""Metric rows in typed columns, and the form they travel in.

``log_metrics`` appends each call's numbers straight into one ``array('d')`` per
metric, so no Python object is made per row, and the flusher ships a batch as
base64 of the raw doubles inside its JSON event: data, never a pickle, and a
copy rather than a walk over every value. Before, building per-row columns and
writing every number as JSON text cost the rank's flusher 1.7 µs per event while
it held the GIL, which the training thread paid for.

A metric that a row did not log holds a NaN with a payload of its own (``GAP_BITS``),
so that a NaN the user logged (a loss that diverged) still shows as one.
"""

from __future__ import annotations

import base64
import json
import sys
from array import array

GAP_BITS = 0x7FF8_0000_0000_0001
GAP_ROW = array("d", array("Q", [GAP_BITS]).tobytes())  # ``GAP_ROW * n``: n rows without the metric
_GAP_BYTES = GAP_ROW.tobytes()


def pad(column: array, rows: int) -> None:
    """Fill ``column`` up to ``rows`` rows with gaps: the rows since its metric was last logged."""
    if len(column) < rows:
        column.extend(GAP_ROW * (rows - len(column)))


def present(column: array) -> list[int] | None:
    """Indices of the rows that logged this metric, or None when all of them did."""
    raw = column.tobytes()
    if _GAP_BYTES not in raw:  # the usual case, at the speed of a byte search
        return None
    return [i for i, bits in enumerate(array("Q", raw)) if bits != GAP_BITS]


class MetricRows:
    """The rows logged since the last flush: steps, times and one column per metric.

    ``telemetry.log_metrics`` appends to the arrays itself: on the training thread a
    method call cost more than the append.
    """

    __slots__ = ("columns", "steps", "times")

    def __init__(self):
        self.steps = array("d")
        self.times = array("d")
        self.columns: dict[str, array] = {}

    def __len__(self) -> int:
        return len(self.steps)

    def drop_row(self, row: int) -> None:
        """Undo a row that failed part-way (``telemetry.log_metrics`` appends column by column)."""
        del self.steps[row:]
        del self.times[row:]
        for name, column in list(self.columns.items()):
            del column[row:]
            if column.tobytes() == _GAP_BYTES * row:  # made by the failed call: no value of its own
                del self.columns[name]

    def to_json(self) -> str:
        """The batch as a JSON object: a row count and each column as base64 of little-endian doubles.

        Written by hand because json.dumps scans every base64 character for
        escapes, which took longer than the encoding itself.
        """
        rows = len(self.steps)
        for column in self.columns.values():
            pad(column, rows)
        values = ",".join(f'{json.dumps(name)}:"{_pack(column)}"' for name, column in self.columns.items())
        return f'{{"rows":{rows},"steps":"{_pack(self.steps)}","times":"{_pack(self.times)}","values":{{{values}}}}}'


def decode(batch: dict) -> tuple[array, array, dict[str, array]]:
    """(steps, times, {name: column}) from a parsed ``MetricRows.to_json``; ValueError if it is malformed."""
    rows = batch["rows"]
    if type(rows) is not int or rows < 0:
        raise ValueError(f"bad metric batch row count {rows!r}")
    return (_unpack(batch["steps"], rows), _unpack(batch["times"], rows),
            {name: _unpack(text, rows) for name, text in batch["values"].items()})


def _pack(column: array) -> str:
    if sys.byteorder == "big":
        column = array("d", column)
        column.byteswap()
    return base64.b64encode(column).decode("ascii")


def _unpack(text: str, rows: int) -> array:
    raw = base64.b64decode(text, validate=True)
    if len(raw) != 8 * rows:
        raise ValueError(f"metric column of {len(raw)} bytes for {rows} rows")
    column = array("d", raw)
    if sys.byteorder == "big":
        column.byteswap()
    return column
