"""The fault scenarios of tests/test_faults.py and scripts/soak.py, each written once.

A scenario is a ``%%horovod`` cell on 2 ranks with one fault on one of them (the
"faulty rank"), and the check of the outcome that fault must produce. The tests run
each scenario once, with the rank and limits they choose; the soak runs many, on a
random rank, in Spark mode (``--np 2``) and local mode (``--np -2``) at random.

Just before the fault, the faulty rank writes ``time.time()`` to a stamp file, so
the time from the fault to the cell's return can be measured.

A check fails with an AssertionError that says what was wrong. test_faults.py has
pytest rewrite this module's asserts; the soak catches the error and records it (so
it refuses to run under ``python -O``, which would skip them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hvdmagic
from hvdmagic.errors import JobFailed, JobTimeout

FLOOD_LINES = 100_000
LIVE_CAP = 1000  # hvdmagic.kernel.ui.text.MAX_LIVE_LINES


@dataclass
class Outcome:
    """What a scenario's cell gave."""

    result: Any
    error: BaseException | None
    output: str  # what the cell printed
    rank: int  # the faulty rank
    limit: float | None = None  # the value of the scenario's option (--timeout or --stall-timeout)

    @property
    def other(self) -> int:
        return 1 - self.rank

    @property
    def message(self) -> str:
        return "" if self.error is None else str(self.error)


@dataclass(frozen=True)
class Scenario:
    name: str
    expected: str  # the outcome in words; "{limit}" stands for the option's value
    body: str  # the cell below its %%horovod line: {rank}, {other}, {stamp} and {flood} are filled in
    check: Callable[[Outcome], None]  # raises AssertionError unless the outcome is the expected one
    option: str | None = None  # "--timeout" or "--stall-timeout", given the limit; None: no limit
    times_out: bool = False  # the expected outcome is the limit running out (a JobTimeout)
    own_failure: str | None = None  # how the faulty rank's own failure summary begins, where it fails
    fail_within: float | None = None  # the tests' bound, in seconds, from the fault to the cell's return

    def cell(self, np: int, rank: int, stamp: str | Path, limit: float | None = None) -> str:
        """The cell on ``np`` ranks (2, or -2 for local mode) with the fault on ``rank``.

        ``stamp``: the file the faulty rank writes the fault's time to; ``limit``: the
        option's value, which a scenario with an option needs.
        """
        if (self.option is None) != (limit is None):
            raise ValueError(f"{self.name}: {self.option or 'no option'}, limit {limit!r}")
        head = f"%%horovod --np {np}" + (f" {self.option} {limit:g}" if self.option else "")
        write = f"open({str(stamp)!r}, 'w').write(repr(time.time()))"
        return head + "\n" + self.body.format(rank=rank, other=1 - rank, stamp=write, flood=FLOOD_LINES)

    def describe(self, limit: float | None = None) -> str:
        """The expected outcome in words, for the given limit."""
        return self.expected.replace("{limit}", f"{limit:g}" if limit is not None else "?")


# --------------------------------------------------------------------------- checks

def _succeeded(o: Outcome) -> None:
    assert o.error is None, f"the cell failed: {type(o.error).__name__}: {o.error}"


def _job_failed(o: Outcome) -> None:
    assert isinstance(o.error, JobFailed) and not isinstance(o.error, JobTimeout), \
        f"expected a JobFailed (not a JobTimeout), got {type(o.error).__name__}: {o.error}"


def _first_failure_is_the_faulty_rank(o: Outcome) -> None:
    _job_failed(o)
    assert o.error.failures and o.error.failures[0].rank == o.rank, \
        f"the first failure is not rank {o.rank}'s: {[(f.rank, f.summary[:100]) for f in o.error.failures]}"


def _timed_out(o: Outcome) -> None:
    assert isinstance(o.error, JobTimeout), f"expected a JobTimeout, got {type(o.error).__name__}: {o.error}"


def check_none(o: Outcome) -> None:
    _succeeded(o)
    assert o.result == 3.0, o.result
    assert hvdmagic.last_run().results == [3.0, 3.0], hvdmagic.last_run().results


def check_raise(o: Outcome) -> None:
    _first_failure_is_the_faulty_rank(o)
    rendered = "\n".join(o.error._render_traceback_())
    assert f"KeyError: 'missing feature on rank {o.rank}'" in rendered, rendered[-2000:]


def check_sigkill(o: Outcome) -> None:
    _first_failure_is_the_faulty_rank(o)
    assert o.error.failures[0].summary == "killed by SIGKILL", o.error.failures[0].summary
    assert "killed by SIGKILL" in o.message, o.message


def check_exit_code(o: Outcome) -> None:
    _first_failure_is_the_faulty_rank(o)
    assert o.error.failures[0].summary == "exited with code 3", o.error.failures[0].summary
    assert "exited with code 3" in o.message, o.message


def check_early_exit(o: Outcome) -> None:
    _job_failed(o)
    assert f"rank(s) {o.rank} had finished the cell" in o.message, o.message


def check_hang_timeout(o: Outcome) -> None:
    _timed_out(o)
    assert f"--timeout {o.limit:g}" in o.message, o.message
    assert f"rank {o.rank} stopped progressing" in o.message and "alive" in o.message, o.message
    assert f"rank {o.other} stopped progressing" not in o.message, o.message


def check_stall_timeout(o: Outcome) -> None:
    _timed_out(o)
    assert f"rank(s) {o.rank} made no progress for {o.limit:g} s (--stall-timeout)" in o.message, o.message


def check_log_flood(o: Outcome) -> None:
    _succeeded(o)
    live = o.output.count("[rank 0] line ")
    assert live == LIVE_CAP, f"{live} live lines of rank 0, not {LIVE_CAP}"
    notice = f"output capped at {LIVE_CAP} lines here; the full log is in hvdmagic.last_run().logs[0]"
    assert notice in o.output, "no cap notice"
    log = hvdmagic.last_run().logs[0]
    assert log.count("\n") == FLOOD_LINES and log.endswith(f"line {FLOOD_LINES - 1}\n"), \
        f"the full log has {log.count(chr(10))} lines, ending {log[-40:]!r}"


# --------------------------------------------------------------------------- the scenarios

def _rank_dies(how: str) -> str:
    """The faulty rank ends its process with the statement ``how`` after hvd.init(); the other
    calls allreduce, then sleeps."""
    return """\
import os, signal, time, torch, horovod.torch as hvd
hvd.init()
if hvd.rank() == {rank}:
    {stamp}
    """ + how + """
hvd.allreduce(torch.ones(1))
time.sleep(600)
"""


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(
        "none", "success, result 3.0 (allreduce of rank+1)", """\
import torch, horovod.torch as hvd
hvd.init()
hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
""", check_none),
    Scenario(
        "raise", "JobFailed, first failure = the raising rank, its KeyError in the traceback", """\
import time, torch, horovod.torch as hvd
hvd.init()
hvd.allreduce(torch.ones(1), name="in_step")  # both ranks are here: the other goes straight into the next
if hvd.rank() == {rank}:
    {stamp}
    raise KeyError("missing feature on rank {rank}")
hvd.allreduce(torch.ones(1), name="never_joined")
""", check_raise, own_failure="KeyError: ", fail_within=5),
    Scenario(
        "sigkill", "JobFailed, first failure = the killed rank, 'killed by SIGKILL'",
        _rank_dies("os.kill(os.getpid(), signal.SIGKILL)"),
        check_sigkill, own_failure="killed by SIGKILL", fail_within=10),
    Scenario(
        "exit_code", "JobFailed, first failure = the rank, 'exited with code 3'", _rank_dies("os._exit(3)"),
        check_exit_code, own_failure="exited with code 3", fail_within=10),
    Scenario(
        # The --timeout is a safety net: the outcome must come before it.
        "early_exit", "JobFailed (not JobTimeout), 'rank(s) r had finished the cell'", """\
import sys, time, torch, horovod.torch as hvd
hvd.init()
if hvd.rank() == {rank}:
    {stamp}
    sys.exit(0)
for _ in range(3):
    hvd.allreduce(torch.ones(1))
""", check_early_exit, option="--timeout"),
    Scenario(
        "hang_timeout", "JobTimeout, '--timeout {limit}', names the stuck rank only", """\
import os, time
rank = int(os.environ["HOROVOD_RANK"])
print("started", flush=True)
if rank == {rank}:
    {stamp}
while True:
    if rank != {rank}:
        print("tick", flush=True)
    time.sleep(0.5 if rank != {rank} else 60)
""", check_hang_timeout, option="--timeout", times_out=True),
    Scenario(
        # The faulty rank waits in an allreduce the other never joins: a classic deadlock.
        "stall_timeout", "JobTimeout, 'rank(s) r made no progress for {limit} s (--stall-timeout)'", """\
import os, threading, time

def busy():
    while True:
        print("rank {other} busy", flush=True)
        time.sleep(0.5)

if os.environ["HOROVOD_RANK"] == "{other}":
    threading.Thread(target=busy, daemon=True).start()  # busy from the start, however slow imports are
import torch, horovod.torch as hvd
hvd.init()
if hvd.rank() == {rank}:
    print("entering the collective", flush=True)
    {stamp}
    hvd.allreduce(torch.ones(1), name="never_matched")
else:
    time.sleep(600)
""", check_stall_timeout, option="--stall-timeout", times_out=True),
    Scenario(
        "log_flood",
        f"success, {LIVE_CAP} live lines per rank + cap notice, full {FLOOD_LINES}-line log kept", """\
import sys
for i in range({flood}):
    sys.stdout.write(f"line {{i}}\\n")
""", check_log_flood),
)}
