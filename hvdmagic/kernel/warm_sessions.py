"""The kernel's warm-rank sessions: ``%horovod start|stop|status`` and ``hvdmagic.session``.

One session per magic (``%horovod``, ``%torchrun``) per kernel; a cell of that magic
without ``--np`` runs on it. The ranks themselves are ``hvdmagic.launch.warm_ranks``'s.
"""

from __future__ import annotations

import argparse
import atexit
import shlex
import time

from IPython.core.error import UsageError

from hvdmagic.errors import LaunchError
from hvdmagic.launch.placement import Placement
from hvdmagic.launch.warm_ranks import Session
from hvdmagic.protocol import Framework

_sessions: dict[Framework, Session] = {}


def session(np: int, *, backend: str = "horovod", controller: str = "gloo", timeout: float | None = None,
            idle_timeout: float | None = None) -> Session:
    """Warm ranks for ``hvdmagic.run(fn, session=s)``: started now, stopped by ``stop()`` or ``with``.

    Args:
        np: ranks as one Spark barrier stage (> 0), or processes on the driver (< 0).
        backend: "horovod" or "torch" (torchrun's environment), as in ``hvdmagic.run``.
        controller: "gloo" (the default) or "mpi" (Horovod only).
        timeout: seconds the ranks get to come up; None waits.
        idle_timeout: stop the ranks, freeing their slots and GPUs, after this many idle seconds.

    Returns:
        A running ``Session``; each ``hvdmagic.run(fn, session=s)`` then calls ``fn`` on its ranks,
        in processes that keep their imports, ``hvd.init()`` and module state between calls.

    Example::

        with hvdmagic.session(2) as s:
            hvdmagic.run(setup, session=s)          # import torch, hvd.init(), load data: once
            for lr in (0.1, 0.05):
                print(hvdmagic.run(train, session=s, lr=lr))
    """
    from hvdmagic.kernel.record import RunRecord
    from hvdmagic.kernel.ui import make_view

    warm = Session(Placement.of(np, framework=Framework(backend), controller=controller), start_timeout=timeout,
                   idle_timeout=idle_timeout)
    _start(warm, make_view, RunRecord)
    atexit.register(warm.stop)
    return warm


def for_cell(magic: str, framework: Framework) -> Session:
    """The session a cell without --np runs on, or a UsageError that says what to do."""
    warm = _sessions.get(framework)
    if warm is None:
        raise UsageError(f"{magic} needs --np N, or a session: start one with {magic[1:]} start --np N.")
    if not warm.running:
        raise UsageError(f"the {magic[1:]} session is not running ({warm.ended}): start it again with "
                         f"{magic[1:]} start --np {warm.placement.signed_np}, or give the cell --np N.")
    return warm


def _parser(magic: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=magic, add_help=False, exit_on_error=False)
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", add_help=False, exit_on_error=False)
    start.add_argument("--np", type=int, required=True)
    start.add_argument("--controller", choices=("gloo", "mpi"), default="gloo")
    start.add_argument("--timeout", type=float, help="seconds the ranks get to come up")
    start.add_argument("--idle-timeout", type=float, help="stop the session after this many idle seconds")
    start.add_argument("--restart", action="store_true", help="stop a running session first")
    commands.add_parser("stop", add_help=False, exit_on_error=False)
    commands.add_parser("status", add_help=False, exit_on_error=False)
    commands.add_parser("env", add_help=False, exit_on_error=False)
    commands.add_parser("where", add_help=False, exit_on_error=False)
    debug = commands.add_parser("debug", add_help=False, exit_on_error=False)
    debug.add_argument("--rank", type=int, help="the rank to debug (default: the first that failed)")
    return parser


USAGE = ("{magic} start --np N [--controller gloo|mpi] [--timeout S] [--idle-timeout S] [--restart] | "
         "{magic} stop | {magic} status | {magic} env | {magic} where | {magic} debug [--rank N]")


# What each of the line magic's commands does, for its help (%horovod?); "start" has its own lines there.
COMMANDS = {
    "status": "each rank's host, busy or idle, its memory and idle time",
    "stop": "stop the ranks, freeing their Spark slots and GPUs",
    "env": "this kernel's Python and packages beside each executor host's",
    "where": "where each rank of the live run is now (its Python stack); a notebook cell waits behind the\n"
             "      running one, so ask from a subshell console, or press the cell's where button",
    "debug": "[--rank N] pdb where the last failed cell raised, in its rank (as %debug)",
}


def line_help(magic: str, framework: Framework) -> str:
    """The line magic's help (``%horovod?``): the session's commands, short and plain, in the
    parser's order."""
    horovod = framework == Framework.HOROVOD
    setup = ("import horovod.torch as hvd; hvd.init()" if horovod else
             'import torch.distributed as dist\n  dist.init_process_group("gloo")')
    commands = list(next(action for action in _parser(magic)._actions if action.dest == "command").choices)
    width = max(map(len, commands)) + 2
    others = [f"  {magic} {name:<{width}}{COMMANDS.get(name, '')}".rstrip() for name in commands if name != "start"]
    controller = " [--controller gloo|mpi]" if horovod else ""
    return "\n".join([
        f"{magic} {'|'.join(commands)}: warm ranks that stay up between %{magic} cells.",
        "",
        f"  {magic} start --np N{controller} [--timeout S] [--idle-timeout S] [--restart]",
        "      start N ranks as one Spark barrier stage (--np -N: N processes on this machine); cells",
        "      without --np then run on them, and keep their imports, variables and process groups.",
        "      --timeout S: seconds they get to come up; --idle-timeout S: stop them after S idle",
        "      seconds; --restart: stop a running session first.",
        *others,
        "",
        "Example:",
        f"  {magic} start --np 2 --idle-timeout 1800",
        f"  %{magic}                                  # runs on the session's ranks, which keep what it does",
        f"  {setup}",
        "",
        f"%{magic}? has the cell magic's arguments.",
    ]) + "\n"


def line_magic(magic: str, line: str, framework: Framework):
    """``%horovod start|stop|status``: the session's life, from a line magic."""
    try:
        args = _parser(magic).parse_args(shlex.split(line))
    except (argparse.ArgumentError, SystemExit, ValueError) as exc:
        raise UsageError(f"{exc}. Usage: {USAGE.format(magic=magic)}") from None
    warm = _sessions.get(framework)
    if args.command == "stop":
        if warm is None or not warm.running:
            print(f"hvdmagic: no {magic} session is running.")
            return None
        warm.stop()
        del _sessions[framework]
        print(f"hvdmagic: the {magic} session stopped; its Spark slots and GPUs are free.")
        return None
    if args.command == "status":
        print(describe(magic, warm))
        return None
    if args.command == "env":
        print(environment_table(magic))
        return None
    if args.command == "where":
        from hvdmagic.kernel.api import where

        print(where())
        return None
    if args.command == "debug":
        from hvdmagic.kernel import rank_debugger

        try:
            return rank_debugger.debug_as_magic(rank=args.rank)
        except ValueError as exc:  # a rank the session does not have
            raise UsageError(str(exc)) from None
    for flag, seconds in (("--timeout", args.timeout), ("--idle-timeout", args.idle_timeout)):
        if seconds is not None and seconds <= 0:
            raise UsageError(f"{flag} must be a positive number of seconds.")
    if warm is not None and warm.running:
        if not args.restart:
            raise UsageError(f"a {magic} session of {warm.size} ranks is running: stop it with {magic} stop, "
                             f"or start over with {magic} start --np N --restart.")
        warm.stop()
    try:
        warm = Session(Placement.of(args.np, framework=framework, controller=args.controller),
                       start_timeout=args.timeout, idle_timeout=args.idle_timeout)
    except LaunchError as exc:
        raise UsageError(str(exc)) from None
    from hvdmagic.kernel.record import RunRecord
    from hvdmagic.kernel.ui import make_view

    _start(warm, make_view, RunRecord)
    _sessions[framework] = warm
    print(f"hvdmagic: {magic} session of {warm.size} ranks ready ({warm.where}); "
          f"cells without --np run on it.")
    return None


def environment_table(magic: str) -> str:
    """``%horovod env``: this kernel's Python and packages beside each executor host's, as its tasks
    last reported them; ``*`` marks what differs (docs/diagnostics.md)."""
    from hvdmagic.launch import versions

    hosts = versions.reported()
    if not hosts:
        return ("hvdmagic: no task has reported its environment in this kernel yet: run a cell with --np N "
                "first.")
    here = versions.kernel_versions()
    columns = ["", "this kernel", *hosts]
    rows = [[name, str(mine), *(f"{theirs.get(name)}{' *' if theirs.get(name) != mine else ''}"
                                for theirs in hosts.values())] for name, mine in here.items()]
    widths = [max(len(row[i]) for row in [columns, *rows]) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [columns, *rows]]
    return "\n".join(lines + [f"(* differs from this kernel; {magic} env shows what the last run's tasks sent)"])


def _start(warm: Session, make_view, record_type) -> None:
    """Start the ranks under a dashboard of their own, so their start-up stages show as a cell's do."""
    record = record_type(warm.placement, f"%{'torchrun' if warm.framework == Framework.TORCH else 'horovod'} start")
    view = make_view(record)

    def on_event(event: dict) -> None:
        record.apply(event)
        view.on_event(event)

    view.start()
    try:
        warm.start(on_event)
    except BaseException as exc:
        record.finish(error=exc)
        raise
    else:
        record.finish(results=[None] * warm.size, ready=True)  # its ranks stay up: "ready", not "finished"
    finally:
        view.close()


def describe(magic: str, warm: Session | None) -> str:
    if warm is None:
        return f"no {magic} session: start one with {magic} start --np N"
    if not warm.running:
        return f"{magic} session: not running ({warm.ended})"
    now = time.monotonic()
    lines = [f"{magic} session: {warm.size} ranks ({warm.placement.where}), "
             f"{'busy' if warm.busy else 'idle'}",
             f"{'rank':>4}  {'host':<16} {'state':<5} {'memory':>9}  idle"]
    for row in warm.status():
        memory = f"{row.rss / 2**20:.0f} MiB" if row.rss else "?"
        idle = "-" if row.idle_since is None else f"{now - row.idle_since:.0f} s"
        lines.append(f"{row.rank:>4}  {row.host[:16]:<16} {'busy' if row.busy else 'idle':<5} {memory:>9}  {idle}")
    return "\n".join(lines)


def stop_all() -> None:
    for warm in _sessions.values():
        warm.stop()
    _sessions.clear()


atexit.register(stop_all)
