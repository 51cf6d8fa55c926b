"""Rank lists as people read them: "0–10, 12–63", as pdsh's ``dshbak -c`` writes host lists.

One formatter for every place that names several ranks at once: the grouped stacks
(``stacks.describe``), the grouped rows and log lines of a many-rank run (``kernel/ui/grouping.py``);
and its reader, for the ranks a user names (``%%horovod --ranks 0-3``). Standard library only: the
kernel's error messages use it too.
"""

from __future__ import annotations

from collections.abc import Iterable

DASH = "–"  # an en dash, as a range is typeset; a hyphen would read as a minus next to negative exit codes


def compress(ranks: Iterable[int]) -> str:
    """Sorted, de-duplicated, runs of three or more as ``a–b``: ``[0, 1, 2, 3, 5, 7, 8]`` -> "0–3, 5, 7, 8".

    A run of two stays two numbers: "7, 8" is no longer than "7–8" and reads without a second look.
    """
    numbers = sorted(set(ranks))
    parts: list[str] = []
    start = 0
    for i in range(1, len(numbers) + 1):
        if i == len(numbers) or numbers[i] != numbers[i - 1] + 1:
            run = numbers[start:i]
            parts.extend([f"{run[0]}{DASH}{run[-1]}"] if len(run) >= 3 else map(str, run))
            start = i
    return ", ".join(parts)


def label(ranks: Iterable[int], noun: str = "rank") -> str:
    """"rank 3" for one, "ranks 0–10, 12–63" for several (``noun``: "task" for an elastic run's rows)."""
    numbers = sorted(set(ranks))
    return f"{noun}{'s' if len(numbers) != 1 else ''} {compress(numbers)}"


def parse(text: str, size: int) -> list[int]:
    """The ranks a person wrote, of ``size`` ranks, sorted: "0", "0,2", "0-3" (or "0–3") and mixes of
    them -> ``[0, 2]``. A ValueError in one sentence for anything else or any rank outside ``0..size-1``."""
    ranks: set[int] = set()
    for part in text.replace(DASH, "-").split(","):
        first, dash, last = part.strip().partition("-")
        if not (first.strip().isdigit() and (not dash or last.strip().isdigit())):
            raise ValueError(f"{text!r} is not a list of ranks: write them as 0, 0,2 or 0-3.")
        low, high = int(first), int(last) if dash else int(first)
        if low > high:
            raise ValueError(f"{part.strip()!r} runs backwards: write the lower rank first ({high}-{low}).")
        if high >= size:
            raise ValueError(f"rank {high} is not among the {size} ranks ({compress(range(size))}).")
        ranks.update(range(low, high + 1))
    return sorted(ranks)
