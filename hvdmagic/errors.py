"""The errors a %%horovod cell can end with.

Each renders itself for IPython through ``_render_traceback_`` (as ipyparallel's
CompositeError does), so the user sees the remote traceback of their own cell,
not the launcher's frames or a page of Java. Each also subclasses the standard
exception it means (as nbclient's do), so callers can catch it without importing
hvdmagic: a launch that cannot start and a failed job are RuntimeErrors, a
timeout is a TimeoutError, a cell that cannot be captured is a ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass

from hvdmagic import flight_records, rank_ranges
from hvdmagic import stacks as rank_stacks


class HvdmagicError(Exception):
    """Base class; the message is complete and the launcher's stack is noise."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class LaunchError(HvdmagicError, RuntimeError):
    """The job could not start: bad set-up, not enough slots, no Spark, no horovod.

    The message is one paragraph; ``details`` keeps the whole underlying error (a
    Java stack trace, say) for whoever needs it.
    """

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class BadArgument(HvdmagicError, ValueError):
    """An argument that cannot work (an estimator's, a store's path): the message says what to give."""


class BadArgumentType(HvdmagicError, TypeError):
    """An argument of a kind, or a name, that the callee does not take."""


class CaptureError(HvdmagicError, ValueError):
    """The cell could not be turned into something the ranks can run."""


class CellSyntaxError(CaptureError):
    def __init__(self, formatted: str):
        super().__init__(formatted)
        self.formatted = formatted

    def _render_traceback_(self) -> list[str]:
        return ["%%horovod cell has a syntax error:", *self.formatted.rstrip("\n").splitlines()]


# Errors a rank raises because another rank failed first: never the root cause.
FALLOUT = ("HorovodInternalError",)
# What torch.distributed's Gloo raises (a RuntimeError or DistBackendError) in a rank whose peer is
# gone: the peer's death is the news, and it may reach the driver after this error does.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


@dataclass
class RankFailure:
    rank: int
    summary: str  # "ValueError: boom" or "exited with code 3"
    traceback: str = ""
    host: str = ""
    time: float = float("inf")  # when it happened, on the rank's clock

    @property
    def is_fallout(self) -> bool:
        kind = self.summary.split(":", 1)[0]
        return kind in FALLOUT or (kind.endswith("Error") and any(sign in self.summary for sign in PEER_GONE))


# How the launcher's watchdog (``launch.job``) says a silent rank still sends heartbeats. Where the
# stacks say where the rank is, the guess gives way to them (``JobFailed._headline``).
ALIVE_GUESS = "alive, e.g. stuck in a collective"


class JobFailed(HvdmagicError, RuntimeError):
    """One or more ranks failed; the others were stopped.

    Its message is made when it is shown (``str``): the kernel names the notebook cells in
    ``stacks`` after the launcher raised it (``kernel.runner``), and the message says where
    the ranks were from them (``stacks.summary``)."""

    MAX_TRACEBACKS = 3
    QUIET_LINES = 20

    def __init__(self, failures: list[RankFailure], stopped: list[int], note: str = "",
                 stacks: dict[int, str] | None = None):
        # The root cause first: a real error before fallout, then the earliest.
        self.failures = sorted(failures, key=lambda f: (f.is_fallout, f.time))
        self.stopped = stopped
        self.note = note
        # By rank: the Python stacks each running rank's fault handler wrote before it was stopped.
        self.stacks = rank_stacks.trimmed(stacks)
        # By rank: start-up chatter the views hid while it ran (kernel.noise), shown with the failure.
        self.quiet_output: dict[int, list[str]] = {}
        # By rank: what a failed rank printed after the run's first failure, as the others were
        # stopped (Gloo's "Connection reset by peer"): counted under its traceback, never in front.
        self.after_failure: dict[int, list[str]] = {}
        # By rank: the digest of its NCCL flight recorder's dump, where torch wrote one (set by the kernel).
        self.flight_records: dict[int, dict] = {}
        super().__init__(self._headline())

    def _headline(self) -> str:
        parts = []
        first = self.failures[0] if self.failures else None
        if first is not None:
            where = f" on {first.host}" if first.host else ""
            parts.append(f"rank {first.rank}{where} failed: {first.summary}")
        others = sorted({f.rank for f in self.failures[1:]})
        if others:
            parts.append(f"rank(s) {rank_ranges.compress(others)} failed too")
        if self.stopped:
            parts.append(f"rank(s) {rank_ranges.compress(self.stopped)} were stopped")
        where = rank_stacks.summary(self.stacks)
        if self.note:
            parts.append(self.note.replace(f"({ALIVE_GUESS})", "(alive)") if where else self.note)
        headline = "; ".join(parts) + "."
        return f"{headline} {where[0].upper()}{where[1:]}." if where else headline

    def __str__(self) -> str:
        return self._headline()

    def _render_traceback_(self) -> list[str]:
        lines = [f"{type(self).__name__}: {self}"]
        shown: dict[str, list[int]] = {}
        for failure in self.failures:
            shown.setdefault(failure.traceback or failure.summary, []).append(failure.rank)
        for i, (text, ranks) in enumerate(shown.items()):
            if i == self.MAX_TRACEBACKS:
                lines.append(f"... and {len(shown) - i} more distinct failure(s)")
                break
            lines.append("")
            lines.append(f"--- rank {rank_ranges.compress(ranks)} ---")
            lines.extend(text.rstrip("\n").splitlines())
            for rank in ranks:
                if quiet := self.quiet_output.get(rank):
                    lines.append(f"(rank {rank}'s start-up messages, hidden while it ran:)")
                    lines.extend(quiet[-self.QUIET_LINES:])
                if after := self.after_failure.get(rank):
                    lines.append(_fallout_line(rank, after))
        return lines + _stack_lines(self.stacks) + flight_records.describe(self.flight_records)


class JobTimeout(JobFailed, TimeoutError):
    """--timeout or --stall-timeout ran out; a TimeoutError, so callers can catch it without hvdmagic.

    Where the stacks say where the ranks were, that comes first: the rank that does not wait in a
    collective is the news ("Rank 1 is in `nap` (Cell In[3], line 5); rank 0 waits in `allreduce`
    ...: rank(s) 0, 1 made no progress for 20 s (--stall-timeout) ...; rank(s) 0, 1 were stopped.")."""

    def _headline(self) -> str:
        where = rank_stacks.summary(self.stacks)
        if not where or any(not failure.is_fallout for failure in self.failures):
            return super()._headline()
        parts = [self.note.replace(f"({ALIVE_GUESS})", "(alive)")] if self.note else []
        # A collective that failed because the stop ended its peer (Gloo's "Connection reset by peer")
        # is part of the stop, not news: those ranks count as stopped (their tracebacks follow).
        stopped = sorted({*self.stopped, *(failure.rank for failure in self.failures)})
        if stopped:
            parts.append(f"rank(s) {rank_ranges.compress(stopped)} were stopped")
        where = f"{where[0].upper()}{where[1:]}"
        return f"{where}: {'; '.join(parts)}." if parts else f"{where}."


class JobInterrupted(HvdmagicError):
    """The user interrupted the kernel; the ranks were stopped.

    ``stacks``: by rank, where the ranks that were still running were (their fault handlers'
    Python stacks), taken before they were stopped.
    """

    def __init__(self, message: str, stacks: dict[int, str] | None = None):
        super().__init__(message)
        self.stacks = rank_stacks.trimmed(stacks)
        self.flight_records: dict[int, dict] = {}  # as JobFailed's

    def __str__(self) -> str:
        """The message, then where the ranks were in one sentence (made when shown, as JobFailed's)."""
        where = rank_stacks.summary(self.stacks)
        message = super().__str__()
        return f"{message} {where[0].upper()}{where[1:]}." if where else message

    def _render_traceback_(self) -> list[str]:
        return super()._render_traceback_() + _stack_lines(self.stacks) + flight_records.describe(self.flight_records)


def _fallout_line(rank: int, after: list[str]) -> str:
    """One line for what a rank printed once the run had failed: it followed the stop, it is not the cause."""
    first = after[0].strip()
    first = first if len(first) <= 100 else "..." + first[-97:]  # a log line's news is at its end
    more = f" and {len(after) - 1} more" if len(after) > 1 else ""
    return (f"(then, as the ranks were stopped, rank {rank} printed \"{first}\"{more}: in "
            f"hvdmagic.last_run().logs[{rank}])")


def _stack_lines(stacks: dict[int, str]) -> list[str]:
    """Where the ranks were, after a blank line; nothing when no stack was taken."""
    return ["", *rank_stacks.describe(stacks)] if stacks else []
