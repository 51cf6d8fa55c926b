"""When each rank last moved: the clock behind ``--stall-timeout``, for one-shot jobs and session cells.

A rank's clock starts when the rank is given its go (a session's: when the cell is sent), not at its
first line of output: a rank that never printed or reported anything (the one asleep while the others
wait for it in an allreduce) is exactly the one a user needs the limit for. What restarts a clock is
what shows the rank at work: its output, reports and result, and the stages it passes while it starts
(its interpreter running, horovod imported, horovod initialised).

Start-up is not a stall: while any rank imports a framework (or its host's template does), every
clock is held, because the other ranks wait for that rank in ``hvd.init`` or the first collective,
and an import on a busy machine can take longer than the limit. ``--timeout`` bounds start-up.

Nor is a rank in pdb at a ``breakpoint()`` (from its DEBUG_PROMPT to its DEBUG_END): every clock
is held while one is, since the others wait for it in their next collective, as for a slow rank,
and the time it was there (``in_debugger_for``) is added to ``--timeout``'s deadline.
"""

from __future__ import annotations

from hvdmagic.protocol import PROGRESS_EVENTS, Event, Stage


class StallClock:
    def __init__(self, started: float):
        self._started = started  # every rank's clock starts here (the go, or the cell's start)
        self._last: dict[int, float] = {}  # by rank: when it last moved, on the driver's clock
        self._importing: set[int] = set()
        self._debugging: set[int] = set()  # the ranks in pdb now, at a breakpoint()
        self._debugging_since: float | None = None  # since when some rank has been
        self._debugged = 0.0  # seconds some rank was in pdb, before that

    def saw(self, event: dict, now: float) -> None:
        """Account one event from a rank (any other is ignored)."""
        rank, kind = event.get("rank"), event.get("type")
        if not isinstance(rank, int):
            return
        if kind == Event.STAGE:
            stage = event.get("stage")
            # A rank's IMPORTING without a name is its interpreter starting the cell, not an import.
            if stage == Stage.TEMPLATE or (stage == Stage.IMPORTING and event.get("importing")):
                self._importing.add(rank)
            else:
                self._importing.discard(rank)
            self._last[rank] = now
        elif kind == Event.DEBUG_PROMPT:
            if not self._debugging:
                self._debugging_since = now
            self._debugging.add(rank)
        elif kind in (Event.DEBUG_END, Event.EXIT, Event.IDLE) and rank in self._debugging:
            self._debugging.discard(rank)
            self._last[rank] = now  # the others' clocks were held meanwhile (``stalled``)
            if not self._debugging:
                self._debugged += now - self._debugging_since
                self._debugging_since = None
        elif kind in PROGRESS_EVENTS:
            self._last[rank] = now

    def in_debugger_for(self, now: float) -> float:
        """Seconds some rank has been in pdb at a breakpoint(), all told: what ``--timeout`` does not count."""
        return self._debugged + (now - self._debugging_since if self._debugging_since is not None else 0.0)

    def silent_for(self, rank: int, now: float) -> float:
        return now - self._last.get(rank, self._started)

    def stalled(self, running, now: float, limit: float) -> list[int]:
        """The running ranks silent for longer than ``limit`` seconds; none while a rank imports, or is in pdb."""
        running = list(running)
        if self._importing.intersection(running) or self._debugging.intersection(running):
            for rank in running:  # held: the clocks start again once the import is done
                self._last[rank] = now
            return []
        return sorted(rank for rank in running if self.silent_for(rank, now) > limit)
