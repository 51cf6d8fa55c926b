"""The %%horovod and %%torchrun cell magics: arguments, capture, and handing off to the launcher."""

from __future__ import annotations

import importlib.util

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from hvdmagic.kernel import warm_sessions
from hvdmagic.kernel.capture import capture_cell, parse_cell
from hvdmagic.kernel.framework_check import check_cell
from hvdmagic.kernel.runner import execute
from hvdmagic.launch import Elastic, Placement, PlacementError, ResultPolicy
from hvdmagic.protocol import Framework

# A payload from this size on is worth a line even on a session's quick cell: it takes time to send.
LARGE_PAYLOAD = 1 << 20


def _launch_arguments(func):
    """The arguments every launching cell magic takes: declared once (as ipyparallel's magics share theirs)."""
    for decorate in reversed([
        argument("--np", type=int, metavar="N",
                 help="Number of ranks. N > 0 runs them as one Spark barrier stage; "
                      "N < 0 runs |N| processes on the driver without Spark (local mode). "
                      "Without --np the cell runs on the ranks of the session that %%horovod start began."),
        argument("--out", metavar="NAME", help="Store rank 0's result in the notebook variable NAME."),
        argument("--timeout", type=float, metavar="SECONDS", help="Stop every rank and fail after SECONDS."),
        argument("--stall-timeout", type=float, metavar="SECONDS",
                 help="Fail when a rank that has started reporting (output, progress, metrics) goes silent "
                      "for SECONDS, e.g. in a deadlocked collective."),
        argument("--data", metavar="NAME",
                 help="A Spark DataFrame in the notebook: each rank gets an equal-size shard, "
                      "read with hvdmagic.shard()."),
        argument("--metrics", metavar="NAME",
                 help="Store the run's metrics history (a pandas DataFrame, all ranks) in the variable NAME."),
        argument("--mlflow", nargs="?", const="", metavar="EXPERIMENT",
                 help="After a successful run, log rank 0's metrics, the params and the duration to MLflow "
                      "(experiment EXPERIMENT, else MLflow's default); see hvdmagic.kernel.mlflow_export."),
    ]):
        func = decorate(func)
    return func


@magics_class
class HorovodMagics(Magics):
    @magic_arguments(name="%horovod")  # the usage line then reads %%horovod, as the cell is written
    @_launch_arguments
    @argument("--timeline", metavar="PATH",
              help="Record a Horovod Timeline (a Chrome trace written by rank 0) at PATH. It costs throughput.")
    @argument("--controller", choices=("gloo", "mpi"), default="gloo",
              help="How the ranks talk: Gloo (the default), or Open MPI, whose mpirun starts the ranks "
                   "through the Spark tasks (no ssh), as HorovodRunner did.")
    @argument("--min-np", type=int, metavar="N",
              help="Elastic training (hvd.elastic.run): the run goes on while at least N ranks remain.")
    @argument("--max-np", type=int, metavar="N",
              help="Elastic training: up to N ranks, added at a commit when slots come back "
                   "(default: --np). Spark runs N tasks; --np of them must start for training to begin.")
    @argument("--reset-limit", type=int, metavar="N",
              help="Elastic training: fail after N resets (default: no limit).")
    @argument("--elastic-timeout", type=float, metavar="SECONDS",
              help="Elastic training: how long to wait for --min-np slots, at the start and after a loss, "
                   "before failing (default 60).")
    @line_cell_magic
    def horovod(self, line: str, cell: str | None = None):
        """Run the cell on Horovod ranks and return rank 0's result.

        The cell is ordinary PyTorch + Horovod code: call hvd.init() in it. The notebook
        variables it reads are shipped to every rank with cloudpickle, and the value of
        its last expression on rank 0 is the cell's result. Inside the cell,
        hvdmagic.progress, hvdmagic.log_metrics and hvdmagic.track feed the live
        dashboard; afterwards hvdmagic.last_run() holds the run's record (metrics, logs,
        timings, result). {var} on the magic line is expanded: %%horovod --np {n}.

        Example:

            %%horovod --np 2 --out accuracy
            import torch, horovod.torch as hvd
            hvd.init()
            model = make_model()
            for epoch in hvdmagic.track(range(5), desc="epoch"):
                loss = train_one_epoch(model, X_train[hvd.rank()::hvd.size()])
                hvdmagic.log_metrics(loss=loss)
            hvd.allreduce(torch.tensor(evaluate(model))).item()
        """
        if cell is None:
            return warm_sessions.line_magic("%horovod", line, Framework.HOROVOD)
        args = parse_argstring(self.horovod, line)
        return self._launch("%%horovod", args, cell, Framework.HOROVOD, timeline=args.timeline,
                            controller=args.controller, elastic=_elastic(args))

    @magic_arguments(name="%torchrun")
    @_launch_arguments
    @line_cell_magic
    def torchrun(self, line: str, cell: str | None = None):
        """Run the cell as torchrun would run a script on every rank, and return rank 0's result.

        The cell is ordinary torch.distributed code: each rank gets the environment
        torchrun gives (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
        MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*), so
        torch.distributed.init_process_group("gloo") (or "nccl" on GPUs) joins the
        others, and DDP, FSDP or Lightning's strategy="ddp" work as under torchrun.
        No horovod is needed. Everything else is as with %%horovod: the notebook
        variables the cell reads are shipped with cloudpickle, the live dashboard,
        --out, --metrics, --data, the timeouts and local mode (--np -N).

        Example:

            %%torchrun --np 2 --out accuracy
            import torch, torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP
            dist.init_process_group("gloo")
            model = DDP(make_model())
            for epoch in hvdmagic.track(range(5), desc="epoch"):
                train_one_epoch(model, X_train[dist.get_rank()::dist.get_world_size()])
            evaluate(model)
        """
        if cell is None:
            return warm_sessions.line_magic("%torchrun", line, Framework.TORCH)
        args = parse_argstring(self.torchrun, line)
        return self._launch("%%torchrun", args, cell, Framework.TORCH)

    def _launch(self, magic: str, args, cell: str, framework: Framework, *, controller: str = "gloo",
                elastic: Elastic | None = None, timeline: str | None = None):
        """Check the arguments, capture the cell, run it, and store what --out and --metrics name."""
        session = placement = None
        if args.np is None:
            session = warm_sessions.for_cell(magic, framework)
            for flag in ("data", "timeline"):
                if getattr(args, flag, None) is not None:
                    raise UsageError(f"--{flag} needs ranks of its own: give the cell --np N (a session's ranks "
                                     "are already running).")
        else:
            try:
                placement = Placement.of(args.np, framework=framework, controller=controller, elastic=elastic)
            except PlacementError as exc:
                raise UsageError(str(exc)) from None
        for flag, name in (("--out", args.out), ("--metrics", args.metrics)):
            if name is not None and not name.isidentifier():
                raise UsageError(f"{flag} needs a valid Python variable name, not {name!r}.")
        for flag, seconds in (("--timeout", args.timeout), ("--stall-timeout", args.stall_timeout)):
            if seconds is not None and seconds <= 0:
                raise UsageError(f"{flag} must be a positive number of seconds.")
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
                         timeline=timeline, captured=capture.summary())
        if args.out:
            self.shell.user_ns[args.out] = record.result
        if args.metrics:
            self.shell.user_ns[args.metrics] = record.metrics
        if args.mlflow is not None:
            from hvdmagic.kernel.mlflow_export import log_run

            run_id = log_run(record, experiment=args.mlflow or None)
            print(f"hvdmagic: logged rank 0's metrics to MLflow run {run_id}", flush=True)
        return record.result


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
