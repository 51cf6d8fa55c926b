"""Horovod's own hang report, read from a rank's stderr and said in the user's terms.

Horovod's coordinator (rank 0) checks every ``HOROVOD_STALL_CHECK_TIME_SECONDS`` (60 by
default; ``--stall-check``) for tensors that some ranks submitted and others did not, and
logs, from C++ to its stderr (``horovod/common/stall_inspector.cc``, 0.28.1)::

    [2026-11-26 00:10:00.123456: W /.../horovod/common/stall_inspector.cc:107] One or more tensors
    were submitted to be reduced, gathered or broadcasted by subset of ranks and are waiting for
    remainder of ranks for more than 60 seconds. This may indicate ... which will cause deadlock.
    Missing ranks:
    1: [allreduce.grad.fc1.weight]
    2!: [allreduce.a, allreduce.b, allreduce.c, allreduce.d, allreduce.e, allreduce.f ...]
    One or more rank (marked by "!") is stalled for longer than 120 seconds. Will shutdown.

(the first line is one line; ``!`` and the last line only under
``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``). The lines reach the kernel as separate lines,
in one event or several, so a ``StallReader`` per rank follows the report across them; the record turns each report
into a ``HangNotice`` ("rank 1 has not submitted `allreduce.grad.fc1.weight` for 60 s;
ranks 0, 2 are waiting") that the views show above the ranks, and that
``last_run().hang_notices`` keeps. Horovod repeats the report at every check while the
stall lasts: a repeat updates the notice (``reports``, ``last_seen``) instead of adding one.

Under Gloo, horovod 0.28.1 never names a missing rank (its controller's rank list stays
empty); ``hvdmagic.build_horovod`` patches that. Under MPI it works as it is.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field

STALL_CHECK_ENV = "HOROVOD_STALL_CHECK_TIME_SECONDS"
SHOWN_NAMES = 3  # tensor names a notice shows per rank; the notice keeps all Horovod listed

_HEADER = re.compile(r"One or more tensors were submitted to be reduced, gathered or broadcasted by subset of "
                     r"ranks and are waiting for remainder of ranks for more than (\d+) seconds\.")
_MISSING = re.compile(r"^\s*(\d+)(!?): \[(.*?)( \.\.\.)?\]\s*$")
_SHUTDOWN = re.compile(r'One or more rank \(marked by "!"\) is stalled for longer than (\d+) seconds\. '
                       r"Will shutdown\.")


def stall_check_env(seconds, flag: str = "--stall-check") -> dict[str, str]:
    """The rank environment for Horovod's stall check every ``seconds``; ``{}`` for None.

    Raises ValueError in one sentence for anything but a whole number of seconds, 1 or more:
    Horovod reads the variable with ``strtol``, so 2.5 would silently be 2, and 0 would warn
    at every cycle."""
    if seconds is None:
        return {}
    real = isinstance(seconds, numbers.Real) and not isinstance(seconds, bool)
    number = float(seconds) if real else math.nan
    if not (math.isfinite(number) and number >= 1 and number.is_integer()):
        given = f"{number:g}" if real else repr(seconds)  # the magic's parser made "0" a float: say 0
        raise ValueError(f"{flag} must be a whole number of seconds, 1 or more (Horovod's stall check counts "
                         f"whole seconds), not {given}.")
    return {STALL_CHECK_ENV: str(int(number))}


@dataclass
class StallReport:
    """One stall-inspector report, as Horovod logged it: at least ``seconds`` waited, and by Horovod
    rank the tensors that rank has not submitted (``truncated``: Horovod listed six and wrote "...")."""

    seconds: int
    missing: dict[int, tuple[str, ...]] = field(default_factory=dict)
    truncated: frozenset[int] = frozenset()
    shutdown: int | None = None  # Horovod shuts down after this many seconds stalled (the "!" ranks)
    shutdown_ranks: frozenset[int] = frozenset()


class StallReader:
    """Follows one rank's stderr, line by line, through Horovod's stall reports.

    ``feed`` says whether a line belongs to a report (the live views leave those out: the
    notice says it); ``report`` is the newest report, complete as far as its lines came (a
    new header starts a new ``StallReport`` object, so a caller can tell a repeat by identity).
    """

    def __init__(self):
        self.report: StallReport | None = None
        self._state = "idle"  # "head": after the header; "ranks": after "Missing ranks:"

    def feed(self, line: str) -> bool:
        if self._state == "head":
            if line.strip() == "Missing ranks:":
                self._state = "ranks"
                return True
            self._state = "idle"
        elif self._state == "ranks":
            if found := _MISSING.match(line):
                rank, marked, names, more = int(found[1]), found[2], found[3], found[4]
                report = self.report
                report.missing[rank] = tuple(name for name in names.split(", ") if name)
                if more:
                    report.truncated = report.truncated | {rank}
                if marked:
                    report.shutdown_ranks = report.shutdown_ranks | {rank}
                return True
            if found := _SHUTDOWN.search(line):
                self.report.shutdown = int(found[1])
                self._state = "idle"
                return True
            self._state = "idle"
        if found := _HEADER.search(line):
            self.report = StallReport(int(found[1]))
            self._state = "head"
            return True
        return False


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _names(names: tuple[str, ...], truncated: bool) -> str:
    shown = ", ".join(f"`{name}`" for name in names[:SHOWN_NAMES])
    left = len(names) - SHOWN_NAMES
    if truncated:
        return shown + " and more"
    return shown + (f" and {left} more" if left > 0 else "")


@dataclass
class HangNotice:
    """Horovod's stall report in the user's terms: which ranks have not submitted which tensors,
    for how long, and which ranks wait for them. ``reporter``: the rank whose stderr said it (the
    coordinator, rank 0); ``size``: the ranks of the run then. ``first_seen`` and ``last_seen``:
    the kernel's clock at the first and the latest report of the same stall; ``reports``: how
    many times Horovod reported it (once per check while it lasts)."""

    seconds: int
    missing: dict[int, tuple[str, ...]]
    size: int
    reporter: int
    first_seen: float
    last_seen: float
    truncated: frozenset[int] = frozenset()
    shutdown: int | None = None
    reports: int = 1
    # Where the ranks were, asked when the notice came (``stacks.summary``): "rank 1 is in `load`
    # (Cell In[3], line 4); ranks 0, 2 wait in `allreduce` (Cell In[5], line 9)"; "" until they answer.
    where: str = ""

    @classmethod
    def of(cls, report: StallReport, *, size: int, reporter: int, now: float) -> HangNotice:
        return cls(report.seconds, dict(report.missing), size, reporter, now, now, report.truncated,
                   report.shutdown)

    @property
    def waiting(self) -> list[int]:
        """The ranks that submitted every tensor some other rank has not: they wait in the collective."""
        return [rank for rank in range(self.size) if rank not in self.missing]

    def text(self) -> str:
        """One sentence, the same for the same stall (no clock in it): "rank 1 has not submitted
        `allreduce.grad.fc1.weight` for 60 s; ranks 0, 2 are waiting"."""
        groups: dict[tuple, list[int]] = {}
        for rank, names in sorted(self.missing.items()):
            groups.setdefault((names, rank in self.truncated), []).append(rank)
        parts = []
        for (names, truncated), ranks in groups.items():
            verb = "has" if len(ranks) == 1 else "have"
            parts.append(f"{_ranks(ranks)} {verb} not submitted {_names(names, truncated)}")
        text = " and ".join(parts) + f" for {self.seconds} s; "
        waiting = self.waiting
        if waiting:
            text += f"{_ranks(waiting)} {'is' if len(waiting) == 1 else 'are'} waiting"
        else:
            text += ("every rank waits for a tensor another has not submitted: the ranks called different "
                     "collectives, or the same ones in another order")
        if self.shutdown is not None:
            text += f"; Horovod shuts the job down after {self.shutdown} s stalled"
        return text

    def line(self) -> str:
        """``text()`` with where it comes from, and where the ranks were once they answered: what the views print."""
        return f"{self.text()} (Horovod's stall check)" + (f". {self.where[0].upper()}{self.where[1:]}." if self.where
                                                          else "")

    def __str__(self) -> str:
        return self.text()

    def same_stall(self, report: StallReport) -> bool:
        return report.missing == self.missing and report.seconds == self.seconds


class HangNotices:
    """A run's hang notices, read from every rank's stderr (``RunRecord`` holds one).

    A report's lines may come in several events (Horovod writes them piece by piece to an
    unbuffered stderr), so a report first seen as a repeat of the last notice may turn out,
    as its lines come, to be another stall: the repeat is then taken back and the report
    gets a notice of its own.
    """

    def __init__(self):
        self.notices: list[HangNotice] = []
        self._readers: dict[int, StallReader] = {}
        # By rank: its newest report, the notice it went to, and that notice's state before the
        # report was counted as its repeat (None: the notice is the report's own).
        self._open: dict[int, tuple[StallReport, HangNotice, tuple | None]] = {}

    def read(self, rank: int, lines: list[str], *, size: int, now: float) -> list[str]:
        """Feed a rank's stderr lines; keep its reports as notices; return the lines that are not a report's.

        ``size``: the ranks of the run now, so a notice can name the ones that wait."""
        reader = self._readers.setdefault(rank, StallReader())
        kept = [line for line in lines if not reader.feed(line)]
        report = reader.report
        if report is None or not report.missing:  # none yet, or its "Missing ranks" lines are still to come
            return kept
        opened = self._open.get(rank)
        if opened is not None and opened[0] is report:  # more lines of a report already counted
            _, notice, before = opened
            if before is None:
                notice.missing, notice.truncated = dict(report.missing), report.truncated
                notice.shutdown, notice.last_seen = report.shutdown, now
                previous = self.notices[-2] if len(self.notices) > 1 and self.notices[-1] is notice else None
                if previous is None or previous.reporter != rank or not previous.same_stall(report):
                    return kept
                # Its first lines looked like another stall; all of them are the last one's, repeated.
                self.notices.pop()
                self._count(rank, report, size, now)
                return kept
            if notice.same_stall(report):
                notice.truncated, notice.shutdown, notice.last_seen = report.truncated, report.shutdown, now
                return kept
            # Not a repeat after all: give the notice its state back; the report is a stall of its own.
            notice.missing, notice.truncated, notice.shutdown, notice.reports, notice.last_seen = before
        self._count(rank, report, size, now)
        return kept

    def _count(self, rank: int, report: StallReport, size: int, now: float) -> None:
        last = self.notices[-1] if self.notices else None
        if last is not None and last.reporter == rank and last.same_stall(report):  # Horovod's next check
            before = (dict(last.missing), last.truncated, last.shutdown, last.reports, last.last_seen)
            last.reports += 1
            last.last_seen, last.truncated, last.shutdown = now, report.truncated, report.shutdown
            self._open[rank] = (report, last, before)
        else:
            notice = HangNotice.of(report, size=size, reporter=rank, now=now)
            self.notices.append(notice)
            self._open[rank] = (report, notice, None)


class ReportLines:
    """Which of each rank's stderr lines belong to a stall report: what a live view leaves out,
    since the notice says it (every line stays in ``last_run().logs``)."""

    def __init__(self):
        self._readers: dict[int, StallReader] = {}

    def drop(self, rank: int, lines: list[str]) -> list[str]:
        reader = self._readers.setdefault(rank, StallReader())
        return [line for line in lines if not reader.feed(line)]
