"""Ctrl-C during a launch: one clear outcome, never a broken Spark session."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable

from hvdmagic.errors import JobInterrupted
from hvdmagic.protocol import Stage

# What an interrupt before the job starts leaves behind, by the stage it hit.
_BEFORE_JOB = {
    None: "before anything was started",
    Stage.SPARK_STARTING: ("while the embedded Spark was starting; it finishes starting in the background, "
                           "and the next cell uses it"),
    Stage.PREPARING_DATA: "while the DataFrame was being prepared; no rank was started",
    Stage.WAITING_FOR_SLOTS: "while waiting for Spark slots; nothing was submitted",
}


def interrupted_before_job(stage: Stage | None) -> str:
    return f"interrupted {_BEFORE_JOB.get(stage, _BEFORE_JOB[None])}."


@contextlib.contextmanager
def before_launch(stage: Callable[[], Stage | None] = lambda: None):
    """A Stop before the launch ends the cell in one line, as one during the run does: pickling the
    notebook's values or a call's arguments takes seconds for large ones, and a print's wait for the
    kernel's output thread, a thread's start, or the Spark session's start (``stage()``, the last
    stage reached, says how far it got) is where a Stop lands, not only once the ranks run."""
    try:
        yield
    except KeyboardInterrupt:
        raise JobInterrupted(interrupted_before_job(stage())) from None


@contextlib.contextmanager
def interruptible():
    """Ctrl-C raises KeyboardInterrupt in the main thread, whatever handler is installed.

    PySpark installs a SIGINT handler (in a session the user created) that cancels
    *every* Spark job of the context by calling the JVM from inside the handler. We
    want only ours stopped, through the normal shutdown path; and the main thread
    makes no JVM call during a launch (see ``launch.spark_session``), so a plain
    KeyboardInterrupt there is always safe.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is not None:  # None: a handler installed from C, which we cannot restore
            signal.signal(signal.SIGINT, previous)
