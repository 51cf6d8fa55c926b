"""Rank lists as people read them: "0–10, 12–63", as pdsh's ``dshbak -c`` writes host lists.

One formatter for every place that names several ranks at once: the grouped stacks
(``stacks.describe``), the grouped rows and log lines of a many-rank run (``kernel/ui/grouping.py``).
Standard library only: the kernel's error messages use it too.
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
