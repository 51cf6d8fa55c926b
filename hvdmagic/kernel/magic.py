"""The %%horovod and %%torchrun cell magics: arguments, capture, and handing off to the launcher."""

from __future__ import annotations

import importlib.util
import math
import os
import re
import textwrap

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from hvdmagic import rank_ranges
from hvdmagic.kernel import warm_sessions
from hvdmagic.kernel.capture import capture_cell, parse_cell
from hvdmagic.kernel.framework_check import check_cell
from hvdmagic.kernel.hang_notices import stall_check_env
from hvdmagic.kernel.runner import execute
from hvdmagic.launch import Elastic, Placement, PlacementError, ResultPolicy
from hvdmagic.launch.interrupts import before_launch
from hvdmagic.protocol import Framework
from hvdmagic.rank.error_hold import HOLD_ENV

# A payload from this size on is worth a line even on a session's quick cell: it takes time to send.
LARGE_PAYLOAD = 1 << 20
# A cell that seems to log metrics (ours, Keras' fit, a callback of ours) gets room for its charts
# from the dashboard's first frame; a wrong guess costs an empty band while the run is live.
LOGS_METRICS = re.compile(r"\blog_metrics\b|\bHvdmagicCallback\b|\.fit\(")
# Likewise a cell that seems to drive a progress bar (ours, tqdm's, Keras' or a trainer's) gets the
# overall bar's row from the first frame, its place kept; any other shows it once the ranks step.
DRIVES_BARS = re.compile(r"\b(track|progress|tqdm|trange)\b|\.fit\(|\bTrainer\b|\bHvdmagicCallback\b")
HELP_WIDTH = 100  # the help's prose, wrapped (%%horovod?)


def _launch_arguments(func):
    """The arguments every launching cell magic takes: declared once (as ipyparallel's magics share theirs).

    Each help is one short line of the help's table (``cell_help``); no ``%`` in them, which
    argparse would format."""
    for decorate in reversed([
        argument("--np", type=int, metavar="N",
                 help="N ranks on Spark; -N: N processes here (local mode); none: the session's"),
        argument("--ranks", metavar="LIST",
                 help="a session's cell on these ranks only (0, 0,2 or 0-3); the others stay idle, state kept"),
        argument("--out", metavar="NAME", help="store rank 0's result in the variable NAME"),
        argument("--timeout", type=float, metavar="SECONDS", help="stop every rank and fail after SECONDS"),
        argument("--stall-timeout", type=float, metavar="SECONDS",
                 help="fail when a rank makes no progress for SECONDS (a deadlock)"),
        argument("--hold-on-error", type=float, metavar="SECONDS",
                 help="keep the failed rank SECONDS for debug, its Spark slot taken (HVDMAGIC_HOLD_ON_ERROR)"),
        argument("--reconnect-grace", type=float, metavar="SECONDS",
                 help="how long a task cut off from the kernel may take to come back (default 120)"),
        argument("--data", metavar="NAME", help="a Spark DataFrame: each rank reads its shard with hvdmagic.shard()"),
        argument("--metrics", metavar="NAME", help="store the metrics history (a pandas DataFrame, all ranks) in NAME"),
        argument("--mlflow", nargs="?", const="", metavar="EXPERIMENT",
                 help="log rank 0's metrics, the params and the duration to MLflow"),
    ]):
        func = decorate(func)
    return func


def _invocation(action) -> str:
    """An option as the help's table shows it: ``--np N``, ``--mlflow [EXPERIMENT]``, ``--controller {gloo,mpi}``."""
    if action.nargs == 0:  # a switch: --debug
        return action.option_strings[0]
    meta = action.metavar or "{" + ",".join(action.choices) + "}"
    return f"{action.option_strings[0]} [{meta}]" if action.nargs == "?" else f"{action.option_strings[0]} {meta}"


def cell_help(magic: str, parser, what: str, example: str, local_example: str) -> str:
    """A cell magic's help (``%%horovod?``), short and plain: what it does, its options as a
    compact table built from its ``parser``, two examples and the session's commands.

    It replaces the help that ``magic_arguments`` builds (argparse's, in reST markup, three
    times as long); the parser itself, and so every argument and its error, stays as it is.
    """
    options = [(_invocation(action), action.help or "") for action in parser._actions if action.option_strings]
    width = max(len(name) for name, _ in options) + 2
    line = magic[1:]
    sessions = (f"Sessions: {line} start --np N keeps ranks up, with their state, for cells without --np; "
                f"{line} status | stop | env | where (a live run's stacks: ask from a subshell console) | debug "
                f"(pdb in the rank a cell failed in, as %debug); {line}? has more.")
    return "\n".join([
        *textwrap.wrap(f"{magic} --np N [options]: {what}", HELP_WIDTH),
        "",
        *(f"  {name:<{width}}{text}" for name, text in options),
        "",
        "Examples:",
        *(f"  {row}" for row in example.strip("\n").splitlines()),
        "",
        f"  {local_example}",
        "",
        *textwrap.wrap(sessions, HELP_WIDTH),
    ]) + "\n"


def _cell_help(what: str, example: str, local_example: str):
    """Put ``cell_help`` in the place of the help ``magic_arguments`` built (outermost decorator)."""
    def decorate(func):
        func.__doc__ = cell_help("%%" + func.argcmd_name.lstrip("%"), func.parser, what, example, local_example)
        return func
    return decorate


@magics_class
class HorovodMagics(Magics):
    @_cell_help(
        "run the cell's Horovod code on N Spark tasks (-N: N local processes); the notebook "
        "variables it reads go with it, and rank 0's last expression is the result.",
        """
%%horovod --np 2 --out accuracy
import horovod.torch as hvd
hvd.init()
train(model, X_train, hvd.rank(), hvd.size())    # train, model, X_train: notebook variables
evaluate(model)                                   # rank 0's value: the result, and accuracy
""",
        "%%horovod --np -4 --timeout 600 --metrics history    # 4 processes here, no Spark")
    @magic_arguments(name="%horovod")
    @_launch_arguments
    @argument("--stall-check", type=float, metavar="SECONDS",
              help="after SECONDS, name the ranks a collective waits for (default 60)")
    @argument("--timeline", metavar="PATH", help="record a Horovod Timeline (a Chrome trace) at PATH; costs speed")
    @argument("--controller", choices=("gloo", "mpi"), default="gloo",
              help="Gloo (the default), or Open MPI: mpirun, through the Spark tasks")
    @argument("--min-np", type=int, metavar="N",
              help="elastic training (hvd.elastic.run): go on while N ranks remain")
    @argument("--max-np", type=int, metavar="N",
              help="elastic: up to N ranks (default --np), added as slots come back")
    @argument("--reset-limit", type=int, metavar="N", help="elastic: fail after N resets (default: no limit)")
    @argument("--elastic-timeout", type=float, metavar="SECONDS",
              help="elastic: how long to wait for --min-np slots after a loss (default 60)")
    @cell_magic
    def horovod(self, line: str, cell: str):
        """Run the cell on Horovod ranks and return rank 0's result (its help: ``cell_help``)."""
        args = parse_argstring(self.horovod, line)
        try:
            env = stall_check_env(args.stall_check)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return self._launch("%%horovod", args, cell, Framework.HOROVOD, timeline=args.timeline,
                            controller=args.controller, elastic=_elastic(args), env=env)

    @line_magic("horovod")
    def horovod_session(self, line: str):
        return warm_sessions.line_magic("%horovod", line, Framework.HOROVOD)

    horovod_session.__doc__ = warm_sessions.line_help("%horovod", Framework.HOROVOD)

    @_cell_help(
        "run the cell's torch.distributed code on N ranks with torchrun's environment (RANK, "
        "WORLD_SIZE, ...), as one Spark barrier stage, or with --np -N on N processes here; no horovod "
        "needed. The notebook variables it reads go to every rank; rank 0's last expression is the result.",
        """
%%torchrun --np 2 --out accuracy
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")                   # or "nccl" on GPUs
model = DDP(make_model())                         # make_model: a notebook function
evaluate(model)                                   # rank 0's value: the result, and accuracy
""",
        "%%torchrun --np -4 --timeout 600 --metrics history   # 4 processes here, no Spark")
    @magic_arguments(name="%torchrun")
    @_launch_arguments
    @argument("--debug", action="store_true",
              help="TORCH_DISTRIBUTED_DEBUG=DETAIL: a mismatched collective fails, naming it")
    @cell_magic
    def torchrun(self, line: str, cell: str):
        """Run the cell as torchrun would run a script on every rank (its help: ``cell_help``)."""
        args = parse_argstring(self.torchrun, line)
        # DETAIL wraps every process group in a checker that compares each collective's kind,
        # shapes and order across the ranks before running it (torch's ProcessGroupWrapper).
        env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"} if args.debug else {}
        return self._launch("%%torchrun", args, cell, Framework.TORCH, env=env)

    @line_magic("torchrun")
    def torchrun_session(self, line: str):
        return warm_sessions.line_magic("%torchrun", line, Framework.TORCH)

    torchrun_session.__doc__ = warm_sessions.line_help("%torchrun", Framework.TORCH)

    def _launch(self, magic: str, args, cell: str, framework: Framework, *, controller: str = "gloo",
                elastic: Elastic | None = None, timeline: str | None = None, env: dict[str, str] | None = None):
        """Check the arguments, capture the cell, run it, and store what --out and --metrics name."""
        session = placement = None
        if args.np is None:
            # The rank environment (--stall-check, --debug) is read when the ranks start, as --timeline is.
            for flag in ("data", "timeline", "stall_check", "debug"):
                if getattr(args, flag, None) not in (None, False):
                    raise UsageError(f"--{flag.replace('_', '-')} needs ranks of its own: give the cell --np N "
                                     "(a session's ranks are already running).")
            session = warm_sessions.for_cell(magic, framework)
        elif args.ranks is not None:
            raise UsageError(_RANKS_NEED_A_SESSION.format(magic=magic, line=magic[1:], **_RANK_CALLS[framework]))
        else:
            try:
                placement = Placement.of(args.np, framework=framework, controller=controller, elastic=elastic)
            except PlacementError as exc:
                raise UsageError(str(exc)) from None
        for flag, name in (("--out", args.out), ("--metrics", args.metrics)):
            if name is not None and not name.isidentifier():
                raise UsageError(f"{flag} needs a valid Python variable name, not {name!r}.")
        for flag, seconds in (("--timeout", args.timeout), ("--stall-timeout", args.stall_timeout),
                              ("--reconnect-grace", args.reconnect_grace)):
            if seconds is not None and seconds <= 0:
                raise UsageError(f"{flag} must be a positive number of seconds.")
        if args.hold_on_error is not None and args.hold_on_error < 0:
            raise UsageError("--hold-on-error must be 0 (no hold) or a positive number of seconds.")
        if args.hold_on_error and (session is not None or elastic is not None or controller == "mpi"):
            raise UsageError("--hold-on-error keeps a fresh --np cell's failed rank for %debug: a session's ranks "
                             "keep a failed cell's frames anyway, mpirun ends every rank once one fails, and an "
                             "elastic run's ranks are reset, not held.")
        if session is None and elastic is None and controller != "mpi":
            env = {**(env or {}), **hold_on_error_env(args.hold_on_error)}
        if args.reconnect_grace is not None and session is not None:
            raise UsageError("--reconnect-grace applies to new ranks: a session's tasks keep the grace they started "
                             "with (spark.hvdmagic.reconnectGrace, set before %horovod start).")
        ranks = None
        if args.ranks is not None:
            try:
                ranks = rank_ranges.parse(args.ranks, session.size)
            except ValueError as exc:
                raise UsageError(f"--ranks: {exc}") from None
        if not cell.strip():
            raise UsageError(f"{magic} needs a cell body: the training code to run on every rank.")
        data = None
        if args.data is not None:
            data = self.shell.user_ns.get(args.data)
            if not hasattr(data, "mapInArrow"):
                raise UsageError(f"--data needs the name of a Spark DataFrame in the notebook; "
                                 f"{args.data!r} is {'undefined' if data is None else type(data).__name__}.")
        if placement is not None:
            try:
                placement.check_options(data=data, stall_timeout=args.stall_timeout)
            except PlacementError as exc:
                raise UsageError(str(exc)) from None
        if args.mlflow is not None and importlib.util.find_spec("mlflow") is None:
            raise UsageError("--mlflow needs MLflow in the notebook's environment: pip install mlflow-skinny.")

        # The capture pickles the notebook's values (seconds for large ones) and its summary's print waits
        # for the kernel's output thread: a Stop there is one line, as one during the run.
        with before_launch():
            source = cell_source(self.shell, cell)
            tree = parse_cell(source)  # the one parse: the checks, the capture and the ranks share it
            if framework == Framework.HOROVOD:
                check_cell(tree)
            capture = capture_cell(source, self.shell.user_ns, set(self.shell.user_ns_hidden), tree=tree)
            if session is None or capture.payload.size >= LARGE_PAYLOAD:
                # A session's quick cells leave one line; what they captured is in last_run().capture.
                print(capture.summary(), flush=True)
        record = execute(capture.payload, placement, timeout=args.timeout, stall_timeout=args.stall_timeout,
                         data=data, results=ResultPolicy.ALL_OR_REPR, session=session, command=magic,
                         timeline=timeline, captured=capture.summary(), env=env,
                         charts_expected=bool(args.metrics or LOGS_METRICS.search(source)),
                         bars_expected=bool(DRIVES_BARS.search(source)),
                         cell=capture.function, reconnect_grace=args.reconnect_grace, ranks=ranks)
        if args.out:
            self.shell.user_ns[args.out] = record.result
        if args.metrics:
            self.shell.user_ns[args.metrics] = record.metrics
        if args.mlflow is not None:
            from hvdmagic.kernel.mlflow_export import log_run

            run_id = log_run(record, experiment=args.mlflow or None)
            print(f"hvdmagic: logged rank 0's metrics to MLflow run {run_id}", flush=True)
        return record.result


_RANKS_NEED_A_SESSION = (
    "--ranks runs a cell on some of a session's ranks ({line} start --np N, then {magic} without --np), which "
    "keep their state between cells. A cell with --np starts fresh ranks that all run it and wait for each other "
    "in {init}: to run code on one of them, put it under `if {rank} == 0:`.")
_RANK_CALLS = {Framework.HOROVOD: {"init": "hvd.init()", "rank": "hvd.rank()"},
               Framework.TORCH: {"init": "init_process_group", "rank": "dist.get_rank()"}}


def hold_on_error_env(seconds: float | None) -> dict[str, str]:
    """The rank environment for ``--hold-on-error`` (``rank.error_hold``); without the option, the kernel's
    own HVDMAGIC_HOLD_ON_ERROR is the default, and it is passed on explicitly, so that a Spark task's
    environment does not decide it. A default that is not a number is one paragraph."""
    if seconds is None:
        default = os.environ.get(HOLD_ENV, "").strip()
        try:
            seconds = float(default or 0)
        except ValueError:
            seconds = math.nan
        if not seconds >= 0:
            raise UsageError(f"{HOLD_ENV} (the default of --hold-on-error) must be a number of seconds, such as 300, "
                             f"not {default!r}: set it with %env {HOLD_ENV}=300, or 0 for no hold.")
    return {HOLD_ENV: f"{seconds:g}"}


def _elastic(args) -> Elastic | None:
    """The elastic settings of a %%horovod line, or None when it names none."""
    given = {"min_np": args.min_np, "max_np": args.max_np, "reset_limit": args.reset_limit,
             "timeout": args.elastic_timeout}
    if all(value is None for value in given.values()):
        return None
    if args.np is None:
        raise UsageError("--min-np, --max-np, --reset-limit and --elastic-timeout start an elastic run of its own: "
                         "give the cell --np N (the ranks it starts with) too.")
    return Elastic.from_arguments(args.np, **given)


def cell_source(shell, cell: str) -> str:
    """The cell as plain Python, padded so line numbers match the cell as the user sees it.

    Line 1 is the %%horovod line itself. IPython's transforms drop leading blank
    lines, which would shift every later line, so they are put back.
    """
    transformed = shell.transform_cell(cell)

    def leading_blank(text: str) -> int:
        lines = text.splitlines()
        return next((i for i, line in enumerate(lines) if line.strip()), len(lines))

    return "\n" * (1 + leading_blank(cell) - leading_blank(transformed)) + transformed
