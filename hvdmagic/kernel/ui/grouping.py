"""A run of many ranks, grouped: ranks that read the same share a row, identical lines are shown once.

As pdsh's ``dshbak -c`` and py-spy's grouped dumps do, so that 64 or 256 ranks fit on a
screen: ranks in the same state, at the same place, collapse into one row named by their
rank list ("ranks 0–10, 12–63"), and the ranks worth a look keep a row of their own: a
failed rank (its state differs), the slowest running rank when it is really behind the
others (``really_behind``: a tie is not news), and any rank a marker in ``OWN_ROW`` flags
(the straggler check's, for one). Identical output lines of several ranks are shown once,
with their rank list.

Up to ``ONE_ROW_PER_RANK`` ranks the views keep a row per rank, as before: eight rows fit
in the space of the header and the charts, a row per rank is what a small run's user reads
(and what every earlier notebook's record shows), and grouping four ranks saves little while
it hides which is which. From nine on the rows are grouped.

The views draw from ``rows`` and ``grouped_lines``; ``hvdmagic.last_run()`` keeps every
rank's full record. Functions of the record alone, without widgets or IPython; the cost is
one pass over the ranks (and over each rank's last lines), so linear in the number of ranks.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from hvdmagic import rank_ranges
from hvdmagic.kernel.noise import is_startup_noise
from hvdmagic.kernel.record import RankRecord, RunRecord
from hvdmagic.kernel.ui import progress_text
from hvdmagic.protocol import Stage

ONE_ROW_PER_RANK = 8  # up to this many ranks, a row per rank; from one more, grouped rows

# Why a rank keeps a row of its own whatever the others do: each marker is a function of the
# run's record and the rank's returning a short reason ("straggler, 35 % slower") or "" for no.
# A check that flags ranks appends its marker here once, at import (the straggler tracking's,
# ``progress_text.straggler_reason``, is in from the start); the first marker that speaks names
# the row. The slowest running rank and a rank in a state of its own need no marker: ``rows``
# singles them out itself.
Marker = Callable[[RunRecord, RankRecord], str]
OWN_ROW: list[Marker] = [progress_text.straggler_reason]

SLOWEST = "slowest"
_LIVE = ("launching", "running")
# When the slowest running rank of a group is behind the others, not tied with them. Ranks that meet
# in a collective every step are never more than a step apart, yet each reports every 0.1 s
# (rank.telemetry.FLUSH_INTERVAL) and the kernel reads them at different moments: at any instant
# some read a step further than others, and at many steps a second several. So the slowest rank is
# behind only when the median of the others is more than TIE_STEPS ahead of it and more than
# TIE_SECONDS of the group's pace (its members' median steps a second): what reporting cannot explain.
# Half a second is five reports: a rank's report that late is itself news, and a rank that really
# falls behind (a slow shard, a busy host) passes it within seconds, well before the straggler check
# (three 2 s windows) flags it.
TIE_STEPS = 1.0
TIE_SECONDS = 0.5


def is_grouped(record: RunRecord) -> bool:
    """Whether the views group this run's ranks (more than ``ONE_ROW_PER_RANK`` rows)."""
    return record.np > ONE_ROW_PER_RANK


@dataclass
class Group:
    """One row of the grouped view: ``members`` read the same (or one rank kept apart, with its ``reason``)."""

    members: list[RankRecord]
    reason: str = ""  # why this rank has a row of its own ("slowest", a marker's reason); "" for a group

    @property
    def ranks(self) -> list[int]:
        return [member.rank for member in self.members]

    def name(self, record: RunRecord) -> str:
        """"rank 3", "ranks 0–10, 12–63" (an elastic run's rows are tasks: "tasks 0–5")."""
        return rank_ranges.label(self.ranks, "task" if record.elastic else "rank")

    @cached_property
    def slowest(self) -> RankRecord:
        """The member whose row stands for the group: the least far along (the lowest rank among equals).
        Found once: the ranks move on while a view draws, and its row must read as one rank's."""
        return min(self.members, key=lambda member: (_progress(member), member.rank))

    def step_range(self) -> tuple[float, float] | None:
        """The lowest and highest step of the members' current bars, when they differ; else None."""
        bars = [progress_text.pick_bars(dict(member.bars))[1] for member in self.members]
        if not all(bars):
            return None
        steps = [bar.step for _, bar in bars]  # type: ignore[misc]
        return (min(steps), max(steps)) if min(steps) != max(steps) else None

    def _spread(self) -> tuple[str, float | None] | None:
        """The members' step range as counts ("145–150") and their bar's total, when their steps differ."""
        spread = self.step_range()
        if spread is None:
            return None
        total = progress_text.pick_bars(dict(self.slowest.bars))[1][1].total
        low, high = map(progress_text.count, spread)
        return f"{low}{rank_ranges.DASH}{high}", total

    def steps(self) -> str:
        """The members' steps when they differ, as a row's count column reads: "145–150/300"; else ""."""
        spread = self._spread()
        if spread is None:
            return ""
        counts, total = spread
        return counts + (f"/{progress_text.count(total)}" if total is not None else "")

    def count_column(self) -> str | None:
        """The members' steps when they differ, in a row's steps column ("  5–6/20  ",
        ``progress_text.count_column``); None when they do not differ or the range is too long for it."""
        spread = self._spread()
        return None if spread is None else progress_text.count_column(*spread)

    def progress(self) -> str:
        """The group's progress as ``progress_text.progress_summary`` writes a rank's, with the
        members' step range when they differ: "epoch 2/5 · train 9–12/200"."""
        rank = self.slowest
        spread = self.step_range()
        if spread is None:
            return progress_text.progress_summary(rank)
        outer, (desc, bar) = progress_text.pick_bars(dict(rank.bars))  # type: ignore[misc]
        total = f"/{bar.total:g}" if bar.total is not None else ""
        steps = f"{spread[0]:g}{rank_ranges.DASH}{spread[1]:g}{total}"
        text = f"{desc} {steps}" if desc else steps
        return f"{progress_text.epoch_text(outer)} · {text}" if outer is not None else text

    def hosts(self) -> list[str]:
        return sorted({member.host for member in self.members if member.host})


def _progress(rank: RankRecord) -> float:
    """How far a rank is, for finding the slowest: its fraction, else its bar's step; -1 without a bar."""
    bars = dict(rank.bars)
    outer, inner = progress_text.pick_bars(bars)
    value = progress_text.fraction(outer, inner)
    if value is not None:
        return value
    return inner[1].step if inner is not None else -1.0


def _pace(rank: RankRecord) -> float | None:
    """A rank's steps a second: the straggler check's latest window, else its current bar's average."""
    if rank.step_rate:
        return rank.step_rate
    _, inner = progress_text.pick_bars(dict(rank.bars))
    return inner[1].rate if inner is not None else None


def really_behind(slowest: RankRecord, others: list[RankRecord]) -> bool:
    """Whether ``slowest`` is behind ``others`` by more than reporting explains (``TIE_STEPS``,
    ``TIE_SECONDS``), counted in every step the ranks made (``RankRecord.steps``): 24 ranks at step
    5 or 6 of 20 at 3.3 steps a second are tied, and none of them is news. A rank that keeps up
    at a lower rate is the straggler check's to flag (``OWN_ROW``), once it falls behind."""
    if not others:
        return False
    lag = statistics.median(member.steps for member in others) - slowest.steps
    rates = [rate for rate in map(_pace, [slowest, *others]) if rate]
    pace = statistics.median(rates) if rates else 0.0
    return lag > max(TIE_STEPS, pace * TIE_SECONDS)


def _key(rank: RankRecord) -> tuple:
    """What two ranks must share to share a row.

    While a rank runs: its state, its start-up stage, and which bars it is in (names and
    totals, not the steps, which differ between any two ranks at any moment: the row shows
    their range). Once it ended: its state, where it ended, its exit code, and for a rank that
    finished its final progress exactly (one that did fewer steps than the others differs).
    """
    outer, inner = progress_text.pick_bars(dict(rank.bars))
    bars = tuple((named[0], named[1].total) for named in (outer, inner) if named is not None)
    key = (progress_text.row_state(rank), rank.exit_code, progress_text.where_it_ended(rank), bars)
    if rank.state in _LIVE and rank.stage is not Stage.TRAINING:
        key += (progress_text.stage_label(rank),)  # "importing tensorflow" apart from "importing"
    if rank.state in progress_text.UP:
        key += (progress_text.progress_summary(rank),)
    return key


def _marked(record: RunRecord, rank: RankRecord) -> str:
    for marker in list(OWN_ROW):
        try:
            reason = marker(record, rank)
        except Exception:  # a marker's problem must not cost the run its view: that rank is just not marked
            continue
        if reason:
            return str(reason)
    return ""


def rows(record: RunRecord) -> list[Group]:
    """The run's rows, by first rank: a ``Group`` per set of ranks that read the same, and a
    group of one for each rank a marker flags and, while the run is live, for the slowest rank
    of a group when it is ``really_behind`` the others (the one that holds them back)."""
    groups: dict[tuple, Group] = {}
    singles: list[Group] = []
    for rank in list(record.ranks):
        reason = _marked(record, rank)
        if reason:
            singles.append(Group([rank], reason))
        else:
            groups.setdefault(_key(rank), Group([])).members.append(rank)
    out = singles
    for group in groups.values():
        slowest = group.slowest if len(group.members) > 1 and group.members[0].state == "running" else None
        others = [member for member in group.members if member is not slowest]
        if slowest is not None and really_behind(slowest, others):
            out.append(Group([slowest], SLOWEST))
            group = Group(others)
        out.append(group)
    return sorted(out, key=lambda group: group.ranks[0])


# -- output lines -------------------------------------------------------------------

@dataclass
class Block:
    """Consecutive output lines that the same ranks printed, each line once."""

    ranks: list[int]
    lines: list[tuple[str, str]]  # (stream, text)

    def name(self) -> str:
        return rank_ranges.label(self.ranks)


def _tail(rank: RankRecord, count: int) -> list[tuple[str, str]]:
    """A rank's last ``count`` (stream, line) that are not start-up noise (which comes first:
    the walk back rarely meets it)."""
    picked: list[tuple[str, str]] = []
    for stream, line in reversed(rank.logs):
        if len(picked) == count:
            break
        if not is_startup_noise(line):
            picked.append((stream, line))
    return picked[::-1]


RANK_FIELD = "{rank}"  # stands for each rank's own number in a line that differs only by it


def _own_number(rank: int) -> re.Pattern:
    # The rank's number as a number of its own: not a part of 170, 0.17 or 1e17.
    return re.compile(rf"(?<![\d.]){rank}(?![\d.]|e\d)")


def grouped_lines(record: RunRecord, per_rank: int, limit: int) -> tuple[list[Block], int]:
    """The last ``per_rank`` output lines of every rank, each distinct line once with the ranks
    that printed it, as ``Block``s of consecutive lines printed by the same ranks; at most
    ``limit`` lines in all, and how many distinct lines were left out.

    Lines are matched whole (stream and text). A line that no other rank printed as it is, and
    that differs from other ranks' only by each rank's own number ("rank 3 done", "rank 4
    done"), is shown once as ``rank {rank} done`` with the ranks that printed it: it reads
    back exactly, each rank's number in place of ``{rank}``. Lines are ordered by how far from
    its rank's end each was printed, the earliest first, ranks in order among equals: ranks that
    print the same sequence line up, and a line only some ranks printed sits among the shared
    ones where it came. When there are more than ``limit``, the earliest are left out, but never
    a line of a rank that failed (what it printed last says why). The result depends on each
    rank's lines only, never on the order in which the ranks' lines arrived.
    """
    tails = [(rank.rank, rank.state == "failed", _tail(rank, per_rank)) for rank in list(record.ranks)]
    exact: dict[tuple[str, str], set[int]] = {}
    for rank, _, tail in tails:
        for line in tail:
            exact.setdefault(line, set()).add(rank)
    # line -> [-distance from its rank's end, first rank, ranks, printed by a failed rank]
    seen: dict[tuple[str, str], list] = {}
    for rank, failed, tail in tails:
        number = None
        for i, (stream, text) in enumerate(tail):
            line = (stream, text)
            if len(exact[line]) == 1:  # its own line: the same as others' but for the rank's number?
                number = number or _own_number(rank)
                masked = number.sub(RANK_FIELD, text)
                if masked != text and RANK_FIELD not in text:
                    line = (stream, masked)
            place = i - len(tail)
            entry = seen.get(line)
            if entry is None:
                seen[line] = [place, rank, [rank], failed]
                continue
            if entry[2][-1] != rank:  # a rank that printed the same line twice counts once
                entry[2].append(rank)
            entry[0], entry[3] = min(entry[0], place), entry[3] or failed
    # A template only one rank's line fits is that line as it was printed.
    lines = []
    for (stream, text), (place, first, ranks, failed) in seen.items():
        if len(ranks) == 1 and RANK_FIELD in text and (stream, text) not in exact:
            text = text.replace(RANK_FIELD, str(ranks[0]))
        lines.append((place, first, (stream, text), ranks, failed))
    lines.sort(key=lambda item: (item[0], item[1]))
    spare = max(0, len(lines) - limit)  # how many to leave out, the earliest that no failed rank printed
    kept = []
    for item in lines:
        if spare and not item[4]:
            spare -= 1
            continue
        kept.append(item)
    kept = kept[-limit:] if len(kept) > limit else kept  # more failed ranks' lines than room: their latest
    left_out = len(lines) - len(kept)
    blocks: list[Block] = []
    for _, _, line, ranks, _ in kept:
        if blocks and blocks[-1].ranks == ranks:
            blocks[-1].lines.append(line)
        else:
            blocks.append(Block(ranks, [line]))
    return blocks, left_out
