"""pdb in a rank, its prompt in the notebook: ``%debug`` after a session's cell failed.

The rank has no terminal. Its pdb reads its lines from the rank's stdin, where the supervisor
writes each DEBUG_INPUT that the kernel sent this rank's task over the job's authenticated
channel (``protocol.write_control``), and writes into a buffer that goes to the kernel with
each prompt (a DEBUG_PROMPT event on the rank's event socket) or with its end (DEBUG_END). One
pipe each way, so the kernel gets pdb's answers and prompts in the order pdb wrote them. The
kernel asks the user with ``input()`` (``kernel.rank_debugger``); no port is opened anywhere.

A line of None (the user quit, or Stop) reads as EOF, which ends pdb as it does at a terminal;
after that every read is EOF, so a KeyboardInterrupt that pdb catches meanwhile cannot leave it
waiting for a line that will not come. Stop also sends SIGINT, which raises KeyboardInterrupt in
what pdb evaluates (``interrupts.allowed``), never while it reads a line: a frame cut in half
would leave the next reader out of step.

``ChannelPdb`` serves any frame: post-mortem on a failed cell's (``post_mortem``), or a running
cell's at ``breakpoint()`` (``install_breakpoint_hook``: ``sys.breakpointhook`` in every rank). At a
breakpoint each stop (the breakpoint, each ``n`` or ``s`` after it) ends with DEBUG_END, so that the
kernel knows the rank runs again; its prompt names the rank, ``(Pdb rank 1)``, since several ranks
may stop at once. ``q`` raises BdbQuit in the cell, as pdb's quit does in a script: the cell fails.
"""

from __future__ import annotations

import contextlib
import os
import pdb
import sys
from collections.abc import Callable
from pathlib import Path

from hvdmagic import protocol
from hvdmagic.protocol import Event
from hvdmagic.rank import telemetry
from hvdmagic.rank.outcome import in_library

_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)  # hvdmagic's frames, left below the user's


class _Buffer:
    """pdb's stdout: kept until its next prompt, then sent with it."""

    def __init__(self):
        self._parts: list[str] = []

    def write(self, text: str) -> int:
        self._parts.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def take(self) -> str:
        text, self._parts = "".join(self._parts), []
        return text


class _Lines:
    """pdb's stdin: each ``readline`` sends the prompt pdb just wrote, with what it wrote before it,
    and waits for the kernel's line."""

    def __init__(self, debugger: ChannelPdb):
        self._debugger = debugger
        self.ended = False  # EOF was read (or stdin closed): every later read is EOF too
        self.stdin_closed = False

    def readline(self) -> str:
        if self.ended:
            return ""
        debugger = self._debugger
        text = debugger.out.take()
        prompt = debugger.prompt
        if text.endswith(prompt):  # pdb writes its prompt, then reads: the kernel shows it in its input box
            text = text[:-len(prompt)]
        telemetry.emit(protocol.debug_prompt(text, prompt, debugger.raised, debugger.cell))
        # EOF is recorded before SIGINT may raise again: Stop's SIGINT, handled as this read returns, makes
        # pdb catch a KeyboardInterrupt and read once more, and that read must not wait for a line.
        with debugger.interrupts.held():
            request = debugger.read_control()
            if request is None:
                self.stdin_closed = True
            line = request.get("line") if isinstance(request, dict) and request.get("type") == Event.DEBUG_INPUT \
                else None
            self.ended = line is None
        return "" if line is None else str(line).replace("\n", " ") + "\n"


class _NoInterrupts:
    """A one-shot rank's SIGINT: Python's own (Stop ends such a rank with the job's ABORT, not SIGINT)."""

    def allowed(self, allowed: bool = True):
        return contextlib.nullcontext()

    def held(self):
        return contextlib.nullcontext()


class ChannelPdb(pdb.Pdb):
    """pdb whose prompt is the notebook's input box. ``read_control``: the next frame on the rank's
    stdin, where the supervisor writes the lines (None at EOF); ``interrupts``: when SIGINT may raise
    (``cell_loop.Interrupts``); ``raised`` and ``cell``: what it debugs, for the kernel's header;
    ``prompt``: pdb's prompt, when not "(Pdb) "; ``skip``: pdb's modules not to step into."""

    def __init__(self, read_control: Callable[[], object], interrupts, raised: str = "", cell: int | None = None,
                 at_the_users_call: bool = False, prompt: str | None = None, skip: list[str] | None = None):
        self.read_control, self.interrupts, self.raised, self.cell = read_control, interrupts, raised, cell
        self.at_the_users_call = at_the_users_call
        self.out = _Buffer()
        self.lines = _Lines(self)
        # nosigint: Stop is the kernel's (its SIGINT reaches what pdb evaluates, as a cell's code); no .pdbrc.
        super().__init__(stdin=self.lines, stdout=self.out, nosigint=True, readrc=False, skip=skip)
        if prompt is not None:
            self.prompt = prompt

    def setup(self, f, tb) -> None:
        super().setup(f, tb)
        users = [i for i, (frame, _) in enumerate(self.stack) if not in_library(frame.f_code.co_filename)]
        if self.at_the_users_call and users:  # an error hvdmagic raised in a library's call: start at the call
            self.curindex = users[-1]
            self.curframe = self.stack[self.curindex][0]
            self.curframe_locals = self.curframe.f_locals


def post_mortem(failure: BaseException | None, cell: int | None, stdin, interrupts) -> bool:
    """pdb at the frame where ``failure`` was raised, until the user quits; without one, say so
    (DEBUG_END with ``kept`` False). Returns False when stdin closed meanwhile (the session ended)."""
    tb = _users_frames(failure.__traceback__) if failure is not None else None
    if tb is None:
        telemetry.emit(protocol.debug_end("", kept=False))
        return True
    raised = f"{type(failure).__name__}: {failure}".splitlines()[0][:300]
    debugger = ChannelPdb(lambda: protocol.read_request(stdin), interrupts, raised, cell,
                          getattr(failure, "ends_at_the_users_call", False))
    debugger.reset()
    # pdb catches what a command raises, and a KeyboardInterrupt while it reads; one between (Stop as it
    # prints where it is) ends it here, as q would.
    failed = ""
    try:
        with contextlib.suppress(KeyboardInterrupt), interrupts.allowed():
            debugger.interaction(None, tb)
    except Exception as exc:  # the debugger's own failure ends the debugger, never the session's rank
        failed = f"\nhvdmagic: the debugger ended: {type(exc).__name__}: {exc}\n"
    telemetry.emit(protocol.debug_end(debugger.out.take() + failed, kept=True))
    sys.stdout.flush()
    return not debugger.lines.stdin_closed


class _BreakpointPdb(ChannelPdb):
    """pdb at a ``breakpoint()`` in a running cell: each stop ends with DEBUG_END (the rank runs again)."""

    def interaction(self, frame, tb) -> None:
        try:
            super().interaction(frame, tb)
        finally:
            telemetry.emit(protocol.debug_end(self.out.take(), kept=True))
            telemetry.flush()


def install_breakpoint_hook(rank: int, read_control: Callable[[], object], interrupts=None) -> None:
    """Make ``breakpoint()`` in this rank's code open pdb on the frame that called it, its prompt in
    the notebook (``read_control``: the next frame on the rank's stdin, None at EOF; ``interrupts``:
    a session's ``cell_loop.Interrupts``, None in a one-shot rank). ``PYTHONBREAKPOINT=0`` turns it
    off, as it turns Python's own hook off."""

    def hook(*_args, **_kwargs) -> None:
        if os.environ.get("PYTHONBREAKPOINT") == "0":
            return
        # hvdmagic's own frames (the cell loop under the cell) are not stepped into: n at the cell's end
        # leaves pdb rather than showing how the rank reports the cell.
        debugger = _BreakpointPdb(read_control, interrupts or _NoInterrupts(), raised="breakpoint()",
                                  prompt=f"(Pdb rank {rank}) ", skip=["hvdmagic.*"])
        debugger.set_trace(sys._getframe(1))

    sys.breakpointhook = hook


def _users_frames(tb):
    """The traceback from the user's first frame on: ``u`` stops at the cell, as IPython's %debug does,
    not in hvdmagic's cell loop below it. None when no frame is the user's."""
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        tb = tb.tb_next
    return tb
