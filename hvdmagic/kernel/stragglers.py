"""Which ranks hold the others back: each rank's step rate, window by window, against the median.

The record counts each rank's steps as its progress reports arrive (``RankRecord.steps``:
every bar's advances, a restarted bar's too, and the rank's own clock at the latest one),
so a rank does nothing for this and the kernel does one addition per bar per report.
Every window, ``StragglerDetector.check`` turns those counts into a rate per rank, the
steps over the rank's own seconds between its last report before the window and its last
report in it: the rate of whole steps, whatever their phase against the window's edges.

A rank is flagged once its rate has been ``SLOWER`` (20 %) or more below the median of the
ranks still training for ``WINDOWS`` (3) windows in a row, and unflagged after as many
windows back within 20 %. Only ranks that train take part: one that has not reported a bar
yet, has finished every bar it has, or has exited is neither compared nor counted in the
median, so the first rank to finish is not taken for a straggler; nor is one whose bar has
no total and that made no step in the window (its loop may be over). A straggler stays
flagged while it is the last one training (there is nothing to compare it with).

Ranks that meet in a collective every step make the same number of steps a second, the
straggler included: the others wait for it. So a rank's seconds leave out those it spent
waiting in collectives, where the rank times them (horovod.torch's ``synchronize``:
``rank.collective_wait``; each bar's state carries the sum): its rate is then that of its
own work, and the rank the others wait for is the slow one. Where waits are not timed
(TensorFlow's collectives, torch DDP's), the rate includes them, and only ranks that do not
wait for each other (loops without a collective, data preparation, inference) can be told
apart; see docs/diagnostics.md.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Set
from dataclasses import dataclass

# A window is at least 2 s of the kernel's clock. A rank reports its progress every 100 ms
# (rank.telemetry.FLUSH_INTERVAL), so a window holds some 20 reports of each rank, and the rates
# are measured between real steps (see the docstring), not between reports. Three windows flag
# a straggler within about 6 s, before a user starts to wonder, and a passing hiccup (a garbage
# collection, rank 0 writing a checkpoint, a neighbour's burst of CPU) seldom lasts three.
WINDOW_SECONDS = 2.0
# With slower steps a window stretches until the median rank has made this many: a rate
# from one or two steps says more about one step than about the rank.
MIN_STEPS = 4
# A rank that waited nearly the whole window still counts this share of it as its own work: its
# rate stays finite, and the clocks' and the wait's small errors cannot make it look many times faster.
MIN_BUSY = 0.1
CHECK_INTERVAL = 0.5  # seconds between two looks at a window that waits for MIN_STEPS
SLOWER = 0.2  # a rate this far below the median counts as behind
WINDOWS = 3  # windows in a row behind to be flagged, and within SLOWER of the median to be unflagged


@dataclass
class Straggler:
    """One rank flagged as a straggler, from ``since`` to ``until`` (None: until the run ended)."""

    rank: int  # its row: an elastic run's task
    host: str
    slower: float  # how far below the median its step rate was in the latest window: 0.35 is 35 %
    worst: float  # the most it was below the median while flagged
    rate: float  # its steps a second in the latest window
    median: float  # the median rank's steps a second in that window
    since: float  # epoch seconds (the kernel's clock) when it was flagged
    until: float | None = None  # when it came back within SLOWER of the median

    def describe(self, name: str | None = None, live: bool = True) -> str:
        """"rank 3 is 35 % slower than the median: host 10.0.0.2" ("was" once it caught up or the run
        ended, ``live`` False); ``name``: how the views call its row."""
        verb = "is" if live and self.until is None else "was"
        where = f": host {self.host}" if self.host else ""
        return f"{name or f'rank {self.rank}'} {verb} {round(self.slower * 100)} % slower than the median{where}"


class StragglerDetector:
    """The windows of one run. ``check`` is cheap to call often: it looks only when ``due``."""

    def __init__(self):
        self.flags: list[Straggler] = []  # every flag of the run, in the order they were raised
        self.rates: dict[int, float] = {}  # by rank: its steps a second in the latest window it took part in
        self._open: dict[int, Straggler] = {}  # flagged, and not back yet
        self._behind: dict[int, int] = {}  # windows in a row at least SLOWER below the median
        self._back: dict[int, int] = {}  # a flagged rank's windows in a row within SLOWER of it
        # By rank: (steps, its clock, its seconds waited in collectives) when the window began.
        self._start: dict[int, tuple[float, ...]] = {}
        self._next = 0.0

    def due(self, now: float) -> bool:
        return now >= self._next

    @property
    def current(self) -> list[Straggler]:
        """The ranks flagged now."""
        return list(self._open.values())

    def check(self, now: float, progress: Mapping[int, tuple[float, ...]], hosts: Mapping[int, str],
              open_ended: Set[int] = frozenset()) -> bool:
        """Close the window if it is long enough; True when a rank was flagged or unflagged.

        ``progress``: for each rank that trains now, ``(steps, its clock at the latest)``, or
        ``(steps, clock, seconds waited in collectives by then)`` where the rank times its waits;
        ``hosts``: where each rank runs, for the flag's description; ``open_ended``: the ranks
        whose bar has no total. One of those that made no step in a window may have finished
        its loop (``track`` over an iterable without a length never says it is done), so it is
        left out of that window rather than taken for the slowest.
        """
        if not self._start:
            self._start = dict(progress)
            self._next = now + WINDOW_SECONDS
            return False
        for rank, sample in progress.items():
            self._start.setdefault(rank, sample)  # a rank that started training mid-window counts from now
        moved = {}
        for rank, (steps, stamp, *waited) in progress.items():
            start_steps, start_stamp, *start_waited = self._start[rank]
            seconds = stamp - start_stamp
            wait = (waited[0] if waited else 0.0) - (start_waited[0] if start_waited else 0.0)
            moved[rank] = (steps - start_steps, max(seconds - wait, MIN_BUSY * seconds))
        if len(moved) < 2 or statistics.median(steps for steps, _ in moved.values()) < MIN_STEPS:
            self._next = now + CHECK_INTERVAL
            return False
        rates = {}
        for rank, (steps, seconds) in moved.items():
            if steps <= 0 and rank in open_ended:
                continue
            if seconds > 0:
                rates[rank] = steps / seconds
            elif steps <= 0:
                rates[rank] = 0.0  # not one step in the whole window
        self._start = dict(progress)
        self._next = now + WINDOW_SECONDS
        self.rates.update(rates)
        median = statistics.median(rates.values()) if len(rates) >= 2 else 0.0
        if median <= 0:
            return False
        changed = False
        for rank, rate in rates.items():
            slower = 1 - rate / median
            flag = self._open.get(rank)
            if slower >= SLOWER:
                self._behind[rank] = self._behind.get(rank, 0) + 1
                self._back.pop(rank, None)
                if flag is not None:
                    flag.slower, flag.worst, flag.rate, flag.median = slower, max(flag.worst, slower), rate, median
                elif self._behind[rank] >= WINDOWS:
                    flag = Straggler(rank, hosts.get(rank, ""), slower, slower, rate, median, now)
                    self._open[rank] = flag
                    self.flags.append(flag)
                    changed = True
            else:
                self._behind.pop(rank, None)
                if flag is not None:
                    self._back[rank] = self._back.get(rank, 0) + 1
                    if self._back[rank] >= WINDOWS:
                        flag.until = now
                        del self._open[rank], self._back[rank]
                        changed = True
        return changed
