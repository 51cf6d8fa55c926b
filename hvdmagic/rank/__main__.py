"""Entry point of one rank process: ``python -m hvdmagic.rank``, or a fork of the host's template.

The supervisor that started us writes our Boot and then the payload on stdin
(``protocol.write_boot``/``write_payload``: a local pipe from our own parent, so it
is trusted) and keeps stdin open: EOF means the supervisor is gone, and the rank
exits rather than live on as an orphan holding a GPU. A session's rank hands over
to ``rank.cell_loop``, which reads one payload per cell. Structured events (stage,
result, error) go to the supervisor as JSON lines on the file descriptor named by
``HVDMAGIC_EVENT_FD``; stdout and stderr are forwarded by the supervisor as they are.
"""

from __future__ import annotations

import faulthandler
import os
import sys

from hvdmagic import protocol
from hvdmagic.protocol import CRASH_HOLD_ENV, STACKS_ENV, STACKS_SIGNAL, Stage
from hvdmagic.rank import debugger, error_hold, framework_bars, telemetry
from hvdmagic.rank.outcome import report_error, report_result

_stacks_file = None


def _shutdown_horovod() -> None:
    """Shut Horovod down, if the cell started it, before the process exits.

    Horovod's shutdown stops its timeline writer without draining the writer's
    queue, so on a slow machine a Timeline loses its last events or stays empty;
    stop_timeline() first blocks until the queue is written and the file closed.
    The result is reported before this: shutdown can block while others still train.
    """
    hvd = sys.modules.get("horovod.torch")
    if hvd is not None and hvd.is_initialized():
        if os.environ.get("HOROVOD_TIMELINE"):
            hvd.stop_timeline()
        hvd.shutdown()


def main() -> int:
    stdin = sys.stdin.buffer
    boot = protocol.read_boot(stdin)
    if boot is None:
        return 137  # the supervisor went away before it said anything
    # A rank that dies of SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL (a crash inside a
    # framework's C++) writes every thread's Python stack to its stderr, which its
    # supervisor relays: the cell's error then says where it died (kernel.record).
    if os.environ.get(CRASH_HOLD_ENV):
        # First, so that the fault handler chains to it: the dying rank then waits for its
        # supervisor to read its native frames too (py-spy), and dies of its signal after.
        from hvdmagic.rank import crash_hold

        crash_hold.install()
    faulthandler.enable(all_threads=True)
    if path := os.environ.get(STACKS_ENV):
        # Its supervisor asks for the stacks (a stall, a timeout) with a signal, and faulthandler
        # writes them from its C handler: while a thread waits in a collective too.
        global _stacks_file
        _stacks_file = open(path, "w")
        faulthandler.register(STACKS_SIGNAL, file=_stacks_file, all_threads=True)
    telemetry.open_events()
    # The first event: it also tells the supervisor that the stacks handler is in place.
    telemetry.emit(protocol.stage_reached(Stage.IMPORTING))
    framework_bars.install()  # tqdm's and Keras' bars drive this rank's row, and print nothing
    if boot.session:
        from hvdmagic.rank.cell_loop import serve

        return serve(boot.rank, boot.results, stdin)
    payload = protocol.read_payload(stdin)
    if payload is None:
        return 137
    hold = 0.0 if boot.elastic else error_hold.seconds()  # --hold-on-error: a failure waits for %debug
    # The kernel's lines come on stdin, which the parent watch reads: pdb's at a breakpoint(), and
    # --hold-on-error's DEBUG. Nothing follows the payload until the rank has asked, so the buffered
    # reader above cannot have read one ahead.
    stdin = error_hold.relay_stdin()
    debugger.install_breakpoint_hook(boot.rank, lambda: protocol.read_request(stdin))
    if boot.elastic:
        from hvdmagic.rank import elastic

        elastic.install()
    try:
        from hvdmagic.rank.blobs import load_payload

        fn, args, kwargs = load_payload(payload[1])
        try:
            value = fn(*args, **kwargs)
        except SystemExit as exc:
            # sys.exit() inside the cell ends this rank; a zero code is a normal, result-less end.
            if exc.code in (None, 0):
                value = None
            else:
                raise
        rank, fields = boot.rank, {}
        if boot.elastic:  # ranks change at resets: rank 0 is whoever is rank 0 at the end
            from hvdmagic.rank.elastic import world

            rank = world().get("world_rank", int(os.environ.get("HOROVOD_RANK", "0")))
            fields["world_rank"] = rank
        report_result(value, rank, boot.results, **fields)
        _shutdown_horovod()
    except BaseException as exc:
        report_error(exc)
        sys.stdout.flush()
        sys.stderr.flush()
        if hold and not isinstance(exc, KeyboardInterrupt):
            error_hold.hold(exc, boot.rank, hold, stdin)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


def _exit(code: int) -> None:
    """Exit without the interpreter's teardown.

    Tearing down a process that imported torch takes 0.5-0.7 s, and every cell
    waits for its slowest rank to exit. atexit hooks (the cell's own included)
    still run; only module and object finalisation is skipped, which frees
    nothing the operating system does not free anyway.
    """
    import atexit

    atexit._run_exitfuncs()
    for flush in (telemetry.flush, sys.stdout.flush, sys.stderr.flush):
        try:
            flush()
        except (OSError, ValueError):
            pass  # the supervisor is gone; nobody is left to read it
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--template"]:
        # The host's rank template (rank.template): it returns only in a forked child, which is then a rank.
        from hvdmagic.rank import template

        child = template.main()
        if child is None:
            _exit(0)
        template.become_rank(child)
    _exit(main())
