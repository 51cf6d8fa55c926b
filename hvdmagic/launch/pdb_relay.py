"""The kernel's side of a rank's pdb: its prompts asked in the notebook, the lines sent to that rank alone.

The rank's pdb (``rank.debugger``) sends DEBUG_PROMPT with what it wrote since its last prompt and
the prompt itself, and DEBUG_END when it ends. ``PdbRelay`` shows the text, asks for a line (``ask``:
the notebook's input box, or a list of commands) and sends it back as DEBUG_INPUT through ``send``,
which reaches that rank's task alone (``Job.send_to``), over the job's authenticated channel.

Stop (a KeyboardInterrupt in the caller, while it asks or waits) calls ``stop``: a line of None,
which the rank's pdb reads as EOF and quits on, and SIGINT, which ends what pdb evaluates now (a
long ``p``). A rank that has not ended its pdb ``grace`` seconds later is stuck where no signal
reaches Python, in C; the caller decides what becomes of it.

It knows nothing of sessions: a ``breakpoint()`` in a running cell can be served by the same
relay from the job's event loop, its DEBUG_PROMPTs arriving among the cell's events.
"""

from __future__ import annotations

from collections.abc import Callable

from hvdmagic import protocol
from hvdmagic.protocol import Event


class PdbRelay:
    """One pdb conversation with ``rank``. ``ask(prompt)`` returns the user's line, or None to end
    pdb (EOF); ``show(text)`` writes pdb's text in the notebook; ``on_start(event)`` is called
    with the first prompt (it says what is debugged: ``raised``, ``cell``)."""

    def __init__(self, rank: int, send: Callable[[dict], None], ask: Callable[[str], str | None],
                 show: Callable[[str], None], on_start: Callable[[dict], None] | None = None):
        self.rank = rank
        self._send, self._ask, self._show = send, ask, show
        self._on_start = on_start
        self.started = False
        self.ended = False
        self.kept = True  # False: the rank held no traceback, and no pdb ran

    def begin(self) -> None:
        self._send(protocol.debug(self.rank))

    def handle(self, event: dict) -> bool:
        """Take one of the job's events; True once the rank's pdb has ended."""
        if event.get("rank") != self.rank:
            return self.ended
        kind = event.get("type")
        if kind == Event.DEBUG_PROMPT:
            if not self.started:
                self.started = True
                if self._on_start is not None:
                    self._on_start(event)
            self._show(str(event.get("text", "")))
            self._send(protocol.debug_input(self.rank, self._ask(str(event.get("prompt", "")))))
        elif kind == Event.DEBUG_END:
            self._show(str(event.get("text", "")))
            self.kept = bool(event.get("kept", True))
            self.ended = True
        elif kind == Event.OUTPUT:  # what the rank's code printed to its own streams (C code, a thread)
            self._show("".join(f"{line}\n" for line in event.get("lines") or []))
        return self.ended

    def stop(self) -> None:
        """End the rank's pdb (Stop): EOF for its next read, SIGINT for what it evaluates now."""
        self._send(protocol.debug_input(self.rank, None))
        self._send(protocol.bare(Event.INTERRUPT))
