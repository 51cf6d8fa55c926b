"""The kernel's side of ``breakpoint()`` in a running cell: pdb's prompts, one rank at a time.

A rank at a breakpoint (``rank.debugger``) sends DEBUG_PROMPT among its cell's events, and DEBUG_END
each time it runs again (``c``, ``n``, ``q``). The loop that reads a running cell's events (``Job``'s
for a fresh cell, ``Session.run_cell``'s for a session's) hands each here. One rank's stop is served
at a time, by a ``PdbRelay``, until it ends; the prompts of ranks that stopped meanwhile wait for it,
in the order they came, so two ranks never share the input box. Each prompt names its rank,
``(Pdb rank 1)``. The loop waits while the user types (``Console.ask`` is ``input()`` on the kernel's
main thread); its stall clock and ``--timeout`` do not count that time (``StallClock``).

Without a console (``hvdmagic.run`` from a script with no terminal), or one that finds it cannot ask
(a front end without stdin), each rank's stop is answered ``c`` and a note says, once, that
breakpoint() needs a notebook: the run goes on as if the breakpoint were not there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from hvdmagic import protocol
from hvdmagic.launch.pdb_relay import PdbRelay
from hvdmagic.protocol import Event

NEEDS_A_NOTEBOOK = ("hvdmagic: breakpoint() stopped {who}, but nothing here can answer pdb's prompt (it needs a "
                    "notebook, or a terminal): the run goes on, as after c.")


class CannotAsk(Exception):
    """Raised by ``Console.ask`` when its front end has no input box (ipykernel's ``allow_stdin`` off)."""


@dataclass
class Console:
    """How the kernel talks to the user at a rank's breakpoint. ``ask(prompt)``: the user's line, or None
    to end pdb (EOF, which quits); ``show(text)``: pdb's text; ``on_start(rank, event)``: a rank's first stop."""

    ask: Callable[[str], str | None]
    show: Callable[[str], None]
    on_start: Callable[[int, dict], None]


class BreakpointPrompts:
    """The running cell's ranks that stopped at breakpoint(). ``send_to(rank, message)`` reaches that rank's
    task alone (``Job.send_to``); ``on_event``: the run's notes go there."""

    def __init__(self, send_to: Callable[[int, dict], None], console: Console | None,
                 on_event: Callable[[dict], None]):
        self._send_to, self._console, self._on_event = send_to, console, on_event
        self._relays: dict[int, PdbRelay] = {}  # by rank: a rank's stops share one relay (its header once)
        self._current: int | None = None  # the rank whose stop is being served
        self._waiting: deque[dict] = deque()  # the first prompts of the other ranks that stopped meanwhile
        self._stopped = False
        self._noted = False

    def handle(self, event: dict) -> None:
        """Take one of the running cell's events (any kind: only its ranks' debugger events and ends count)."""
        kind, rank = event.get("type"), event.get("rank")
        if not isinstance(rank, int):
            return
        if kind == Event.DEBUG_PROMPT:
            if self._stopped:
                self._send_to(rank, protocol.debug_input(rank, None))  # EOF: its pdb quits
            elif self._console is None:
                self._go_on(rank)
            elif self._current in (None, rank):
                self._serve(event)
            else:
                self._waiting.append(event)
        elif kind in (Event.DEBUG_END, Event.EXIT, Event.IDLE, Event.ERROR):
            if kind != Event.DEBUG_END:  # the rank's cell or process ended, and any stop of its with it
                self._waiting = deque(waiting for waiting in self._waiting if waiting.get("rank") != rank)
            if rank == self._current:
                if kind == Event.DEBUG_END:
                    self._relays[rank].handle(event)  # shows what pdb wrote last
                self._current = None
                if self._waiting:
                    self.handle(self._waiting.popleft())

    def stop(self) -> None:
        """Stop, a failure or a limit ends the cell: every rank in pdb quits it (EOF), and those that
        stop from now on quit at once."""
        self._stopped = True
        if self._current is not None:
            self._relays[self._current].stop()
            self._current = None
        for waiting in self._waiting:
            self._send_to(waiting["rank"], protocol.debug_input(waiting["rank"], None))
        self._waiting.clear()

    def _serve(self, event: dict) -> None:
        rank = event["rank"]
        self._current = rank
        relay = self._relays.get(rank)
        if relay is None:
            console = self._console
            relay = self._relays[rank] = PdbRelay(rank, lambda message: self._send_to(rank, message), console.ask,
                                                  console.show, lambda first: console.on_start(rank, first))
        try:
            relay.handle(event)
        except CannotAsk:
            self._console = None  # said once; every later stop goes on too
            self._go_on(rank)
            self._current = None

    def _go_on(self, rank: int) -> None:
        """Answer ``c`` for the user, who cannot be asked; say so once."""
        if not self._noted:
            self._noted = True
            self._on_event(protocol.note(NEEDS_A_NOTEBOOK.format(who=f"rank {rank}")))
        self._send_to(rank, protocol.debug_input(rank, "c"))
