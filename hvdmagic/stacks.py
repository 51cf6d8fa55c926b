"""Where ranks are: Python's fault handler output, trimmed to the user's frames and grouped by rank.

A rank's ``faulthandler`` writes every thread's stack when a crash signal kills it, and
when its supervisor asks (``protocol.STACKS_SIGNAL``), with no help from the user's code
and even while a thread waits in C++ (a collective). This module reads that text in the
kernel: standard library only.
"""

from __future__ import annotations

FATAL_ERROR = "Fatal Python error: "  # how faulthandler starts what it writes for a dying process
_THREAD = ("Thread 0x", "Current thread 0x")
# Frames of hvdmagic's own start-up and threads (its flusher, its parent watch), not the user's.
_OURS = ("/hvdmagic/", "<frozen runpy>", '/threading.py"')


def user_stacks(lines: list[str]) -> str:
    """The threads of one faulthandler dump that run the user's code, the interrupted one first,
    each as ``Thread``/``Current thread`` and its frames (most recent call first); hvdmagic's
    frames and threads left out, as they are from a raised exception's traceback. A first line
    that is not a thread's (``Fatal Python error: Aborted``) is kept as the headline."""
    headline, threads = [], []
    for line in lines:
        if line.startswith(_THREAD):
            threads.append([line.split(" (", 1)[0].rsplit(" 0x", 1)[0] + ":"])  # its id says nothing here
        elif line.startswith("  File ") and threads:
            if not any(part in line for part in _OURS):
                threads[-1].append(line)
        elif line.strip() and not threads and not headline:
            headline.append(line)
    threads = [t for t in threads if len(t) > 1 or t[0].startswith("Current")]
    threads.sort(key=lambda t: not t[0].startswith("Current"))
    return "\n\n".join([*headline, *("\n".join(t) for t in threads)])


def trimmed(dumps: dict[int, str] | None) -> dict[int, str]:
    """By rank, ``user_stacks`` of each rank's whole dump."""
    return {rank: user_stacks(text.splitlines()) for rank, text in (dumps or {}).items()}


def where_it_died(stderr: list[str]) -> str:
    """Where a crash signal killed a rank, from its stderr lines; "" when its fault handler wrote nothing."""
    start = next((i for i in range(len(stderr) - 1, -1, -1) if stderr[i].startswith(FATAL_ERROR)), None)
    return "" if start is None else user_stacks(stderr[start:])


def grouped(stacks: dict[int, str]) -> list[tuple[list[int], str]]:
    """Ranks whose stacks read the same, together: ``[([0, 2], stack), ([1], other)]``, by first rank."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(stacks):
        groups.setdefault(stacks[rank], []).append(rank)
    return [(ranks, text) for text, ranks in groups.items()]


def describe(stacks: dict[int, str]) -> list[str]:
    """The grouped stacks as lines for an error or a view."""
    lines = ["where the ranks were (most recent call first):"]
    for ranks, text in grouped(stacks):
        label = "rank" if len(ranks) == 1 else "ranks"
        lines.append(f"{label} {', '.join(map(str, ranks))}:")
        lines.extend("  " + line if line else "" for line in (text or "(no stack came back)").splitlines())
    return lines
