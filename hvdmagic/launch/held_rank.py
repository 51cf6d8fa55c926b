"""The kernel's side of ``--hold-on-error``: a fresh cell's failed rank, its task and the job's channel
outlive the cell until ``%debug`` has quit, or the hold's seconds have passed.

A rank that failed with a hold says HELD (``rank.error_hold``) and waits. ``Job`` then ends the
cell as it does today, the other ranks aborted, but leaves that rank's task running and hands
its channel and backend to a ``HeldRank`` (on Spark the barrier stage stays up on that one task,
so its slot stays taken). A thread reads the held task's events: pdb's, while ``debug`` runs
(``PdbRelay``, as a session's ``%debug``), and its rank's exit. When the rank has exited (its
pdb quit, its seconds passed), or ``end`` is called (Stop in pdb, the next run), the thread
aborts what is left, joins the backend and closes the channel: nothing of the job stays.

One job's hold at a time: the next run ends it first (``end_for_next_run``), since on Spark it
would wait for the held slot, and says so in a note.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from hvdmagic import channel, protocol
from hvdmagic.errors import JobInterrupted, LaunchError
from hvdmagic.launch.interrupts import interruptible
from hvdmagic.launch.pdb_relay import PdbRelay
from hvdmagic.protocol import Event

# Seconds the held rank gets to exit past its hold, or after an abort, before its task is cancelled.
EXIT_WAIT = 5.0
JOIN_WAIT = 30.0  # seconds the backend's tasks get to end once the held rank has exited
POLL = 0.1
_ENDED: dict = {}  # put in the inbox once the held rank has exited

_current: HeldRank | None = None


class HeldRank:
    """``rank`` of a failed fresh cell, waiting ``seconds`` for ``%debug``; ``raised``: its error, in a line."""

    def __init__(self, rank: int, seconds: float, raised: str, send_to: Callable[[int, dict], None]):
        self.rank, self.seconds, self.raised = rank, seconds, raised
        self._send_to = send_to
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._end_asked = threading.Event()
        self._done = threading.Event()  # the rank, its task and the channel are gone
        self._debugging = False
        self.until = time.monotonic() + seconds
        self.ended: str | None = None  # why, once the hold is over

    @property
    def alive(self) -> bool:
        return self.ended is None

    def start(self, backend, server: channel.ChannelServer, task) -> None:
        """Take over the job's ``backend`` and ``server`` once its cell has ended; ``task``: the held rank's
        task's link."""
        global _current
        self.until = time.monotonic() + self.seconds
        _current = self
        threading.Thread(target=self._watch, args=(backend, server, task), name="hvdmagic-held-rank",
                         daemon=True).start()

    def _watch(self, backend, server: channel.ChannelServer, task) -> None:
        aborted_at: float | None = None
        pdb_ended = False
        try:
            while True:
                now = time.monotonic()
                if aborted_at is None and (self._end_asked.is_set()
                                           or (not self._debugging and now > self.until + EXIT_WAIT)):
                    self._send_to(self.rank, protocol.bare(Event.ABORT))
                    aborted_at = now
                if aborted_at is not None and now > aborted_at + EXIT_WAIT:
                    backend.cancel()
                    break
                try:
                    link, event = server.events.get(timeout=POLL)
                except queue.Empty:
                    continue
                if link is not task:
                    continue  # the other tasks' last words: their ranks ended with the cell
                kind = event.get("type")
                if kind in (Event.EXIT, Event.GONE):
                    break
                pdb_ended = pdb_ended or kind == Event.DEBUG_END
                self._inbox.put(event)
        finally:
            self.ended = ("its pdb ended" if pdb_ended else "Stop or the next run ended it" if self._end_asked.is_set()
                          else f"its {self.seconds:g} s (--hold-on-error) passed")
            backend.join(timeout=JOIN_WAIT)
            server.close()
            self._done.set()
            self._inbox.put(_ENDED)

    def end(self) -> None:
        """End the hold now: the rank is aborted, its task and the channel end."""
        self._end_asked.set()
        self._done.wait(2 * EXIT_WAIT + JOIN_WAIT)

    def debug(self, ask: Callable[[str], str | None], show: Callable[[str], None],
              on_start: Callable[[dict], None] | None = None) -> None:
        """pdb in the held rank, at the frame where its cell raised, its I/O relayed as a session's (``PdbRelay``);
        the rank, its task and the channel end once it quits. Stop ends pdb and the hold, raising JobInterrupted."""
        if not self.alive:
            raise LaunchError(f"rank {self.rank} held no more: {self.ended}.")
        self._debugging = True  # the user is in it: the hold's seconds no longer count
        relay = PdbRelay(self.rank, lambda event: self._send_to(self.rank, event), ask, show, on_start)
        with interruptible():
            relay.begin()
            try:
                while not relay.handle(self._next(relay)):
                    pass
            except KeyboardInterrupt:
                relay.stop()
                self.end()
                raise JobInterrupted(f"interrupted: Stop ended the debugger on rank {self.rank}, and the rank held "
                                     "for it.") from None
            self._done.wait(2 * EXIT_WAIT + JOIN_WAIT)  # q: the rank exits now, and its slot is free on return

    def _next(self, relay: PdbRelay) -> dict:
        try:
            event = self._inbox.get(timeout=POLL)  # a timeout, so that Stop's KeyboardInterrupt gets in
        except queue.Empty:
            return {}
        if event is _ENDED:
            started = "while pdb ran" if relay.started else "before pdb started"
            raise LaunchError(f"rank {self.rank} ended {started}: {self.ended}.")
        return event


def end_for_next_run(notify: Callable[[dict], None]) -> None:
    """End the last cell's held rank before a new run starts (on Spark, its slot would make the run wait),
    and say so in a note."""
    held = _current
    if held is None or not held.alive:
        return
    held.end()
    notify(protocol.note(f"hvdmagic: ended rank {held.rank}, held for %debug after the last cell failed "
                         "(--hold-on-error), to free its slot for this run."))
