"""Where ranks are: Python's fault handler output, trimmed to the user's frames and grouped by rank.

A rank's ``faulthandler`` writes every thread's stack when a crash signal kills it, and
when its supervisor asks (``protocol.STACKS_SIGNAL``), with no help from the user's code
and even while a thread waits in C++ (a collective). Where py-spy is installed beside the
task, the supervisor adds its dump (``task.native_stacks``): the native frames above each
thread's innermost Python call, shown under the Python stacks. A rank that a crash signal
kills waits in its crash hold (``rank.crash_hold``) while its supervisor reads it with py-spy;
``died_in`` writes those frames out in the task, after the fault handler's dump on the rank's
stderr. This module reads that text in the kernel: standard library only.

A frame in a notebook cell is written as the file the cell was compiled into, which exists in
the kernel alone; ``name_cells`` names it as IPython does (``Cell In[5], line 3``), with its line,
from what the kernel knows of its cells (``kernel.cell_frames``). ``summary`` says in one sentence
where each group of ranks is: in which of the user's functions, or waiting in which collective.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hvdmagic import rank_ranges
from hvdmagic.protocol import NATIVE_STACKS_MARK

FATAL_ERROR = "Fatal Python error: "  # how faulthandler starts what it writes for a dying process
_THREAD = ("Thread 0x", "Current thread 0x")
# Frames of hvdmagic's own start-up and threads (its flusher, its parent watch), not the user's.
_OURS = ("/hvdmagic/", "<frozen runpy>", '/threading.py"')
NATIVE = "native frames (py-spy), most recent call first, down to the Python call:"
NATIVE_FRAMES = 12  # per thread, the innermost: where it waits, and the library calls that led there


def user_stacks(lines: list[str]) -> str:
    """The threads of one faulthandler dump that run the user's code, the interrupted one first,
    each as ``Thread``/``Current thread`` and its frames (most recent call first); hvdmagic's
    frames and threads left out, as they are from a raised exception's traceback. A first line
    that is not a thread's (``Fatal Python error: Aborted``) is kept as the headline."""
    if NATIVE_STACKS_MARK in lines:
        at = lines.index(NATIVE_STACKS_MARK)
        python, native = user_stacks(lines[:at]), _native("\n".join(lines[at + 1:]))
        return "\n\n".join(part for part in (python, native and f"{NATIVE}\n{native}") if part)
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


def _native(dump: str) -> str:
    """py-spy's JSON dump as text: for each thread that runs the user's Python, the native frames
    above its innermost Python frame (where a collective waits), without the binding glue; text
    that is no dump as it is (the note the supervisor sent instead, or a crashed rank's frames that
    its supervisor wrote out: ``died_in``); "" when no such thread is in C."""
    dump = dump.strip()
    try:
        threads = json.loads(dump)
    except ValueError:
        return dump
    return "\n".join(text for thread in (threads if isinstance(threads, list) else [])
                     if (text := _native_thread(thread)))


def _native_thread(thread: dict) -> str:
    frames = thread.get("frames") or []
    # py-spy names the library of a native frame (its "module"), and none for a Python frame.
    python = [i for i, frame in enumerate(frames) if frame.get("module") is None]
    if not python or all(_ours(frames[i].get("filename") or "") for i in python):
        return ""  # no Python frame, or only hvdmagic's: not a thread of the user's code
    return _thread_text(thread, [_frame(frame) for frame in frames[:python[0]] if not _glue(frame)])


def _thread_text(thread: dict, native: list[str], label: str = "Thread") -> str:
    if not native:
        return ""
    more = [f"  … {len(native) - NATIVE_FRAMES} more"] if len(native) > NATIVE_FRAMES else []
    name = thread.get("thread_name")  # none where the process never imported threading
    return "\n".join([f'{label} "{name}":' if name else f"{label}:",
                      *("  " + line for line in native[:NATIVE_FRAMES]), *more])


# What ``died_in`` says when no thread waits in the crash hold: py-spy lists Python's threads only.
CRASHED_OUTSIDE_PYTHON = "(the thread that crashed runs no Python code; py-spy reads only Python's threads)"


def died_in(dump: str) -> str:
    """py-spy's JSON dump of a rank that its crash hold keeps (``rank.crash_hold``) as text: first
    the thread that crashed, ``Current thread`` as the fault handler names it, with its native frames
    from the one it crashed in down to its Python call (the hold's and the fault handler's frames
    left out); then the other threads as ``_native`` shows them. Text that is no dump (a note on
    why py-spy could not read the rank) comes back as it is."""
    try:
        threads = json.loads(dump)
    except ValueError:
        return dump.strip()
    crashed, others = "", []
    for thread in threads if isinstance(threads, list) else []:
        below = _below_the_hold(thread.get("frames") or [])
        if below is None:
            others.append(_native_thread(thread))
        elif not crashed:
            python = next((i for i, frame in enumerate(below) if frame.get("module") is None), len(below))
            # The innermost frame is where it crashed: kept even where py-spy could not name it.
            native = [_frame(frame) for i, frame in enumerate(below[:python]) if i == 0 or not _glue(frame)]
            crashed = _thread_text(thread, native, "Current thread") or "Current thread: (no native frame)"
    return "\n".join(text for text in (crashed or CRASHED_OUTSIDE_PYTHON, *others) if text)


def _below_the_hold(frames: list[dict]) -> list[dict] | None:
    """The frames of a thread that waits in the crash hold, from the one it crashed in outwards; None
    for a thread that does not. The hold is libc's ``sleep`` called by the kernel: a signal frame
    (libc's ``__restore_rt``, unnamed) is under it. Where the fault handler raised the signal again
    from its own handler, a second signal frame at the same address follows within a few frames."""
    for i, frame in enumerate(frames[:-1]):
        if frame.get("module") is None:
            return None  # a Python frame before any hold: this thread runs on
        trampoline = frames[i + 1]
        if frame.get("name") == "sleep" and _in_libc(frame) and _in_libc(trampoline) and _unnamed(trampoline):
            rest = frames[i + 2:]
            again = next((j for j, f in enumerate(rest[:4]) if f.get("name") == trampoline.get("name")), None)
            return rest if again is None else rest[again + 1:]
    return None


def _in_libc(frame: dict) -> bool:
    return str(frame.get("short_filename") or "").startswith("libc.")


def _unnamed(frame: dict) -> bool:
    return str(frame.get("name", "")).startswith("0x")


def _ours(filename: str) -> bool:
    return "/hvdmagic/" in filename or filename.startswith("<frozen runpy>") or filename.endswith("/threading.py")


def _glue(frame: dict) -> bool:
    """A frame that says nothing of where the thread is: an address py-spy could not name, pybind11's
    call machinery, CPython's inline helpers (``Py_INCREF``) that the debug info puts in the stack."""
    name, filename = str(frame.get("name", "")), str(frame.get("filename", ""))
    return name.startswith(("0x", "pybind11::")) or "/include/python3" in filename


def _frame(frame: dict) -> str:
    where = frame.get("short_filename") or frame.get("module") or "?"
    name = "??" if _unnamed(frame) else frame.get("name")  # an address, as gdb shows a frame it cannot name
    return f"{name} ({where}{f':{line}' if (line := frame.get('line')) else ''})"


def split(text: str) -> tuple[str, str]:
    """A rank's trimmed stacks as (its Python stacks, its native frames or ""), as ``user_stacks`` joined them."""
    python, _, native = ("\n\n" + text).partition(f"\n\n{NATIVE}\n")
    return python[2:], native


def trimmed(dumps: dict[int, str] | None) -> dict[int, str]:
    """By rank, ``user_stacks`` of each rank's whole dump."""
    return {rank: user_stacks(text.splitlines()) for rank, text in (dumps or {}).items()}


def where_it_died(stderr: list[str]) -> str:
    """Where a crash signal killed a rank, from its stderr lines; "" when its fault handler wrote nothing."""
    start = next((i for i in range(len(stderr) - 1, -1, -1) if stderr[i].startswith(FATAL_ERROR)), None)
    return "" if start is None else user_stacks(stderr[start:])


def grouped(stacks: dict[int, str]) -> list[tuple[list[int], str]]:
    """Ranks whose Python stacks read the same, together: ``[([0, 2], stack), ([1], other)]``, by
    first rank. Their native frames (``split``) are not compared: ``describe`` groups them within."""
    return _alike({rank: split(text)[0] for rank, text in stacks.items()})


def _alike(texts: dict[int, str]) -> list[tuple[list[int], str]]:
    groups: dict[str, list[int]] = {}
    for rank in sorted(texts):
        groups.setdefault(texts[rank], []).append(rank)
    return [(ranks, text) for text, ranks in groups.items()]


def describe(stacks: dict[int, str], noun: str = "rank") -> list[str]:
    """The grouped stacks as lines for an error or a view: each group's Python stacks, then its
    native frames, once if every rank of the group has the same, else grouped again by rank.
    ``noun``: what the keys are, "task" for an elastic run's rows (its ranks change at resets)."""
    lines = ["where the ranks were (most recent call first):"]
    for ranks, text in grouped(stacks):
        lines.append(f"{rank_ranges.label(ranks, noun)}:")
        lines.extend(_indented(text or "(no stack came back)", 2))
        natives = {rank: native for rank in ranks if (native := split(stacks[rank])[1])}
        if natives:
            lines.append("  " + NATIVE)
            alike = _alike(natives)
            if len(alike) == 1 and alike[0][0] == ranks:
                lines.extend(_indented(alike[0][1], 4))
            else:
                for some, native in alike:
                    lines.append(f"    {rank_ranges.label(some, noun)}:")
                    lines.extend(_indented(native, 6))
    return lines


def _indented(text: str, by: int) -> list[str]:
    return [" " * by + line if line else "" for line in text.splitlines()]


# A frame as the fault handler writes it: '  File "/tmp/ipykernel_7/3.py", line 3 in slow_step'.
_FILE_FRAME = re.compile(r'^(?P<indent> *)File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.*)$')
# A frame ``name_cells`` named: '  Cell In[5], line 3 in slow_step', its source line under it.
_CELL_FRAME = re.compile(r"^(?P<indent> *)(?P<file>Cell In\[\d+\]), line (?P<line>\d+) in (?P<function>.*)$")

# A frame's file -> (its notebook cell's name, "Cell In[5]", and the cell's lines), or None for a file of no cell.
CellLookup = Callable[[str], tuple[str, Sequence[str]] | None]


def name_cells(text: str, cell_of: CellLookup) -> str:
    """``text`` (``user_stacks``) with each frame in a notebook cell named as IPython's tracebacks name it,
    its source line under it, as a traceback shows it::

        Cell In[5], line 3 in slow_step
          time.sleep(60)

    Other frames, native frames and text named already stay as they are."""
    lines = []
    for line in text.splitlines():
        frame = _FILE_FRAME.match(line)
        cell = cell_of(frame["file"]) if frame else None
        if cell is None:
            lines.append(line)
            continue
        (name, source), number, indent = cell, int(frame["line"]), frame["indent"]
        lines.append(f"{indent}{name}, line {number} in {frame['function']}")
        code = source[number - 1].strip() if 0 < number <= len(source) else ""
        if code:
            lines.append(f"{indent}  {code}")
    return "\n".join(lines)


@dataclass(frozen=True)
class _Frame:
    file: str  # a path, "<horovod-cell>" or, once named, "Cell In[5]"
    line: int
    function: str

    @property
    def place(self) -> str:
        """Where it is, short: "Cell In[5], line 3", "train.py, line 12"."""
        return f"{self.file.rsplit('/', 1)[-1]}, line {self.line}"


# Frames that are not the user's own code: installed packages, the standard library, frozen modules.
_LIBRARY = re.compile(r"/(site|dist)-packages/|/lib(64)?/python\d[\d.]*/|^<frozen ")
# Frames of the collectives a rank waits in for the others: Horovod's (its synchronize, under
# allreduce and the rest), torch.distributed's. Wherever either is installed from.
_COLLECTIVE = re.compile(r"/horovod/|/torch/distributed/")
# Functions that only wrap a collective (torch's c10d_logger decorates dist.all_reduce with ``wrapper``).
_WRAPPERS = ("wrapper", "inner", "wrapped", "decorator")
SUMMARY_PLACES = 4  # the groups a summary names; the stacks under it show the rest


def _frames(thread: str) -> list[_Frame]:
    found = (_FILE_FRAME.match(line) or _CELL_FRAME.match(line) for line in thread.splitlines())
    return [_Frame(m["file"], int(m["line"]), m["function"]) for m in found if m]


def _users(frame: _Frame) -> bool:
    return not (_LIBRARY.search(frame.file) or _COLLECTIVE.search(frame.file))


def _place(stack: str) -> tuple[bool, str] | None:
    """Where a rank is, from its stacks (most recent call first): (whether it waits in a collective,
    what it does there), e.g. (True, "`allreduce` (Cell In[6], line 7)"); None without a frame.

    The thread read is the first of its Python stacks (the interrupted one) that runs the user's code:
    its innermost frame of user code says where it is; its innermost frame of all, whether it waits."""
    threads = [frames for part in split(stack)[0].split("\n\n") if (frames := _frames(part))]
    if not threads:
        return None
    frames = next((t for t in threads if any(map(_users, t))), threads[0])
    own = next((frame for frame in frames if _users(frame)), None)
    at = f" ({own.place})" if own is not None else ""
    if _COLLECTIVE.search(frames[0].file):
        # The collective the user called: the outermost frame of the collective's library under the
        # user's call (torch's autograd may sit in between: Horovod's allreduce is a torch Function).
        called = [frame for frame in frames[:frames.index(own) if own else len(frames)]
                  if _COLLECTIVE.search(frame.file)]
        named = [frame for frame in called if not frame.function.startswith("_") and frame.function not in _WRAPPERS]
        return True, f"`{(named or called)[-1].function}`{at}"
    if own is None:
        return False, f"`{frames[0].function}` ({frames[0].place})"
    if own.function == "<module>":
        return False, f"at {own.place}"
    return False, f"`{own.function}`{at}"


def place(stack: str) -> str | None:
    """Where a rank is, from its stacks, as a row says it: "in `allreduce` (Cell In[6], line 7)",
    "at Cell In[5], line 3"; None without a frame."""
    if (found := _place(stack)) is None:
        return None
    what = found[1]
    return what if what.startswith("at ") else f"in {what}"


_CELL_LINE = re.compile(r"Cell In\[\d+\], line \d+")


def raised_at(traceback_text: str) -> str | None:
    """The innermost notebook-cell line of a traceback ("Cell In[15], line 6"), or None."""
    found = _CELL_LINE.findall(traceback_text)
    return found[-1] if found else None


def summary(stacks: dict[int, str], noun: str = "rank") -> str:
    """Where the ranks are, in one sentence, ranks in the same place together: "rank 1 is in
    `slow_step` (Cell In[5], line 3); ranks 0, 2–23 wait in `allreduce` (Cell In[6], line 7)".
    The ranks that do not wait in a collective come first: they are the news. "" without a frame."""
    places: dict[tuple[bool, str], list[int]] = {}
    for rank in sorted(stacks):
        if (place := _place(stacks[rank])) is not None:
            places.setdefault(place, []).append(rank)
    ordered = sorted(places.items(), key=lambda item: (item[0][0], item[1][0]))
    parts = []
    for (waits, what), ranks in ordered[:SUMMARY_PLACES]:
        one = len(ranks) == 1
        if waits:
            verb = "waits in" if one else "wait in"
        else:
            verb = ("is" if one else "are") + ("" if what.startswith("at ") else " in")
        parts.append(f"{rank_ranges.label(ranks, noun)} {verb} {what}")
    elsewhere = [rank for _, ranks in ordered[SUMMARY_PLACES:] for rank in ranks]
    if elsewhere:
        parts.append(f"{rank_ranges.label(elsewhere, noun)} {'is' if len(elsewhere) == 1 else 'are'} elsewhere")
    return "; ".join(parts)
