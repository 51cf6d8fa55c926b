"""``%debug``, ``%pdb on``, ``%horovod debug`` and ``hvdmagic.debug``: pdb in the rank whose cell failed.

IPython's ``%debug`` opens pdb at the frame where the last exception was raised. After a failed
hvdmagic cell that frame is in a rank, so this module takes IPython's ``debugger`` (which
``%debug`` and ``%pdb on`` both call) where the last exception is one of hvdmagic's, and leaves
every other exception to IPython:

- a session's rank keeps its last failed cell's exception, frames and all (``rank.cell_loop``):
  ``Session.debug`` runs pdb there, at the failing frame, its prompt in the notebook's own input
  box (``input()`` on the kernel's main thread: ipykernel turns it into an input_request), or fed
  from a list of commands (``hvdmagic.debug(commands=[...])``, for a notebook run without a person);
- a fresh ``--np N`` cell with ``--hold-on-error S`` leaves its failed rank waiting S seconds
  (``launch.held_rank``): ``HeldRank.debug`` runs pdb there the same way, and the rank ends after;
- otherwise a fresh cell's ranks end with it, and a session restarted since took its ranks'
  frames away: then one line says how to keep a traceback, and no pdb opens in hvdmagic's code.

The runner tells this module of each run's failure (``remember``); the last one is the one debugged.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

from hvdmagic.errors import HvdmagicError, JobFailed, JobInterrupted, LaunchError
from hvdmagic.kernel.breakpoint_console import show
from hvdmagic.launch.held_rank import HeldRank
from hvdmagic.launch.warm_ranks import Session


@dataclass
class _Failure:
    """A run's error, and where the ranks that raised it keep their frames."""

    error: BaseException
    ranks: list[int]  # the ranks whose code raised, the root cause first
    session: Session | None  # None: fresh ranks, gone with the cell
    generation: int = 0  # the session's ranks then: a restart since took their frames
    held: HeldRank | None = None  # a fresh cell's failed rank, kept for %debug (--hold-on-error)


_last: _Failure | None = None


def remember(error: BaseException, session: Session | None, generation: int = 0) -> None:
    """The runner's word that a run ended with ``error`` (on ``session``'s ranks of ``generation``)."""
    global _last
    failures = getattr(error, "failures", ())
    # A rank killed by a signal raised nothing: no frame of its to debug (and its session restarted anyway).
    ranks = [failure.rank for failure in failures if failure.traceback]
    _last = _Failure(error, list(dict.fromkeys(ranks)), session, generation, getattr(error, "held", None))


def debug(commands: Iterable[str] | None = None, rank: int | None = None) -> None:
    """pdb in the rank whose cell failed last, at the frame where it raised: the notebook's ``%debug``.

    Args:
        commands: the lines to type at pdb's prompt, each printed as if typed, then ``q`` if the
            list does not end with it (for a notebook run without a person: nbval, a job).
            None: ask for each line in the notebook's input box, as ``%debug`` does.
        rank: the rank to debug; None: the first that failed (the root cause, as the error names it).

    ``p``, ``pp``, ``l``, ``u``/``d``, ``w`` and expressions on the rank's variables work as in
    pdb; ``q`` leaves, and the session keeps its ranks and their state. A session's ranks keep a
    failed cell's frames (``%horovod start --np N``), and a fresh cell's failed rank waits for this
    with ``--hold-on-error S`` (it ends once pdb quits); otherwise this prints, in one line, how to
    get them. Stop ends pdb (the session keeps its ranks; a held rank ends) and raises ``JobInterrupted``.

    Example::

        %%horovod
        x = 1 / (hvd.rank() - 1)        # fails on rank 1

        hvdmagic.debug(commands=["p hvd.rank()", "w", "q"])
    """
    if (why := _why_not(_last, rank)) is not None:
        print(f"hvdmagic: {why}", flush=True)
        return
    failure = _last
    if failure.held is not None:
        _debug_held(failure.held, commands)
        return
    chosen = rank if rank is not None else failure.ranks[0]
    failure.session.check_ranks([chosen])  # a ValueError in one sentence for a rank it does not have
    ask = _typed(commands) if commands is not None else _asked
    try:
        kept = failure.session.debug(chosen, ask, show, on_start=lambda event: _header(chosen, event, failure))
    except LaunchError as exc:
        print(f"hvdmagic: {exc}", flush=True)
        return
    if not kept:
        others = f" (ranks that failed: {', '.join(map(str, failure.ranks))})" if failure.ranks else ""
        print(f"hvdmagic: rank {chosen} holds no traceback: no cell of this session failed on it{others}.",
              flush=True)


def _debug_held(held: HeldRank, commands: Iterable[str] | None) -> None:
    def header(event: dict) -> None:
        print(f"hvdmagic: pdb in rank {held.rank}, held after the cell failed (--hold-on-error), where "
              f"{event.get('raised', held.raised)} was raised; q leaves it, and the rank ends.", flush=True)

    try:
        held.debug(_typed(commands) if commands is not None else _asked, show, on_start=header)
    except LaunchError as exc:
        print(f"hvdmagic: {exc}", flush=True)


def install(shell) -> None:
    """Make IPython's ``debugger`` (``%debug``, ``%pdb on``) rank-aware for hvdmagic's errors."""
    original = shell.debugger
    if getattr(original, "_hvdmagic", False):
        return

    def debugger(force: bool = False):
        last = getattr(sys, "last_value", None)
        if not (force or shell.call_pdb) or not isinstance(last, HvdmagicError):
            return original(force)
        if _last is None or _last.error is not last:
            print(f"hvdmagic: the last error ({type(last).__name__}) came from the kernel, before or around the "
                  "ranks' code: there is no rank frame to debug.", flush=True)
            return None
        return debug_as_magic()

    debugger._hvdmagic = True
    shell.debugger = debugger


def debug_as_magic(rank: int | None = None) -> None:
    """``debug`` as ``%debug``, ``%pdb on`` and ``%horovod debug`` run it: Stop is said in a line, not raised
    (as IPython's own %debug; and ``%pdb on`` runs it inside IPython's display of the cell's error)."""
    try:
        debug(rank=rank)
    except JobInterrupted as exc:
        print(f"hvdmagic: {exc}", file=sys.stderr, flush=True)


def _why_not(failure: _Failure | None, rank: int | None) -> str | None:
    """Why no rank can be debugged now, in one line; None when one can."""
    how = ("give the cell --hold-on-error SECONDS to keep its failed rank that long for %debug, or run it on a "
           "session's ranks (%horovod start --np N, then the cell without --np), which keep a failed cell's frames")
    if failure is None:
        return f"no hvdmagic run has failed in this kernel yet. Once one has, %debug opens pdb where it raised; {how}."
    if not isinstance(failure.error, (JobFailed, JobInterrupted)):
        return (f"the last run ended before any rank ran its code ({type(failure.error).__name__}): there is no "
                "rank frame to debug.")
    if failure.held is not None:
        if rank is not None and rank != failure.held.rank:
            return (f"only rank {failure.held.rank} was held after the cell failed (--hold-on-error keeps the first "
                    f"rank that raised): %debug reaches it; rank {rank} ended with the cell.")
        if not failure.held.alive:
            return (f"rank {failure.held.rank}, held after the cell failed, has ended ({failure.held.ended}), and "
                    "its frames with it: run the cell again, then %debug.")
        return None
    if failure.session is None:
        return f"the failed cell's ranks ended with it, and their frames with them: {how}."
    session = failure.session
    if not session.running or session.generation != failure.generation:
        return ("the session's ranks were restarted or stopped after that cell failed (its error says why), and "
                "its frames went with them: run the cell again, then %debug.")
    if rank is None and not failure.ranks:
        return "no rank raised in the last cell (it was stopped or timed out): %horovod debug --rank N picks one."
    return None


def _asked(prompt: str) -> str | None:
    """A line from the notebook's input box (ipykernel's input_request); None at EOF."""
    try:
        return input(prompt)
    except EOFError:
        return None
    except Exception as exc:  # ipykernel's StdinNotImplementedError: a front end that cannot answer input()
        if type(exc).__name__ != "StdinNotImplementedError":
            raise
        print("\nhvdmagic: this front end cannot answer pdb's prompt (no stdin): pass the lines with "
              "hvdmagic.debug(commands=[...]).", flush=True)
        return None


def _typed(commands: Iterable[str]):
    """``ask`` from a list: each line printed after its prompt, as if typed; ``q`` once the list ends."""
    lines = iter([*commands])

    def ask(prompt: str) -> str | None:
        line = next(lines, "q")
        print(f"{prompt}{line}", flush=True)
        return line

    return ask


def _header(rank: int, event: dict, failure: _Failure) -> None:
    earlier = "" if rank in failure.ranks else " (from an earlier cell: it did not raise in the last one)"
    print(f"hvdmagic: pdb in rank {rank}, where {event.get('raised', 'its exception')} was raised{earlier}; q leaves "
          "it, and the session keeps its ranks and their state.", flush=True)
