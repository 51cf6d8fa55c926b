"""The metrics history of one run, kept in typed columns.

A run can log millions of rows. Kept as Python tuples and dicts, every row was
an object the kernel's garbage collector had to walk, and at 10,000 rows a
second its full collections stalled the notebook for a second at a time. Typed
arrays hold the same numbers with no Python object per row.
"""

from __future__ import annotations

from array import array

from hvdmagic.metric_rows import GAP_ROW, pad, present


def _step(value: float) -> int | float:
    return int(value) if value.is_integer() else value


class MetricHistory:
    """Every rank's metric rows, plus rank 0's series per metric for the charts."""

    def __init__(self):
        self.ranks = array("i")
        self.steps = array("d")
        self.times = array("d")
        self.columns: dict[str, array] = {}  # a NaN (metric_rows.GAP_BITS) where a row lacks the metric
        self.rank0: dict[str, tuple[array, array]] = {}  # name -> (steps, values), rows that have it

    def __len__(self) -> int:
        return len(self.ranks)

    def extend(self, rank: int, steps: array, times: array, values: dict[str, array]) -> None:
        """Append one batch of rows from ``rank``, as ``metric_rows.decode`` returns it."""
        rows = len(steps)
        before = len(self.ranks)
        self.ranks.extend(array("i", [rank]) * rows)
        self.steps.extend(steps)
        self.times.extend(times)
        for name, column in values.items():
            if name not in self.columns:
                self.columns[name] = GAP_ROW * before
            self.columns[name].extend(column)
        for column in self.columns.values():
            pad(column, before + rows)
        if rank == 0:
            for name, column in values.items():
                xs, ys = self.rank0.setdefault(name, (array("d"), array("d")))
                rows_with_it = present(column)
                if rows_with_it is None:
                    xs.extend(steps)
                    ys.extend(column)
                else:
                    xs.extend(array("d", [steps[i] for i in rows_with_it]))
                    ys.extend(array("d", [column[i] for i in rows_with_it]))

    def latest(self) -> dict[str, tuple[float, float]]:
        """name -> (step, value): rank 0's newest value of each metric."""
        return {name: (_step(xs[-1]), ys[-1]) for name, (xs, ys) in self.rank0.items() if xs}

    def frame(self):
        """One pandas row per logged call: rank, step, time (UTC) and a column per metric."""
        import numpy as np
        import pandas as pd

        steps = np.frombuffer(self.steps, dtype=np.float64).copy()
        if len(steps) and np.all(np.isfinite(steps)) and np.all(steps == np.floor(steps)):
            steps = steps.astype(np.int64)  # the usual integer step counter
        data = {"rank": np.frombuffer(self.ranks, dtype=np.int32).astype(np.int64), "step": steps,
                "time": pd.to_datetime(np.frombuffer(self.times, dtype=np.float64), unit="s", utc=True)}
        data.update({name: np.frombuffer(column, dtype=np.float64).copy() for name, column in self.columns.items()})
        return pd.DataFrame(data)
