"""Lightning's, Hugging Face's and accelerate's trainers, adopted in a rank: their progress drives
the rank's row and what they log becomes the rank's metrics, with no hvdmagic callback in the cell.

- **Lightning** (``lightning.pytorch`` or ``pytorch_lightning``). In a ``%%torchrun`` rank, a
  ``Trainer`` given neither ``devices`` nor ``num_nodes`` gets the cell's layout (the ranks on
  each host, the hosts), as ``torchrun``'s flags would have said. Every ``Trainer`` built in a
  rank gets ``HvdmagicCallback`` (a ``fit`` bar on every rank, and ``self.log``'s values as
  metrics through ``HvdmagicLogger``), unless the cell gave it one. Lightning's own bar is taken
  out either way: with ``rich`` installed Lightning picks ``RichProgressBar``, whose redrawn text
  the row cannot follow (it left "Epoch 2/2 ━━━ 8/8" lines in rank 0's log), and its tqdm bar
  exists on rank 0 only. A progress bar of the cell's own class stays.
- **Hugging Face's ``Trainer``.** Its default progress callback (tqdm bars on rank 0 that also
  print each ``logs`` dict) becomes one that reports on every rank: an ``epoch`` counter, a
  ``step`` bar (``global_step`` of ``max_steps``) and an ``evaluate`` bar while it evaluates or
  predicts. A callback added to every Trainer's defaults logs the numbers of ``on_log`` (``loss``,
  ``learning_rate``, ``grad_norm``, ``eval_*``, ...) as metrics at ``global_step``, whatever bar
  the arguments chose (``disable_tqdm`` keeps Hugging Face's printer). Its notebook callback is
  never chosen in a rank: a rank runs no IPython kernel, which is what ``is_in_notebook`` looks for.
- **accelerate.** ``Accelerator.log``'s numbers are metrics as well as the trackers' (on every
  rank; accelerate's trackers log the main process's). ``notebook_launcher`` in a rank runs its
  function in place and returns its value: the cell's ranks are the processes it would have started.
- **Hugging Face's ``TrainingArguments``** that need a GPU, in a rank that has none, fail saying so.
  On CPU ranks, they and ``Accelerator()`` train across the cell's ranks without ``use_cpu=True``
  or ``cpu=True`` (accelerate would otherwise run each rank alone); a Trainer still alone in a cell
  of several ranks says so in a note.
- **Other launchers' habits.** A Lightning ``Trainer`` whose strategy would spawn or fork
  (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``), or whose ``devices`` and ``num_nodes`` do not
  match the cell's layout, and ``torch.multiprocessing.spawn`` / ``start_processes`` called from
  outside torch, fail in one paragraph that says what to write instead.

Each is adopted when the module that defines it is imported (``framework_bars``'s hook), or at
``framework_bars.install`` if a template imported it first. What cannot be adopted (another
version's internals) runs as it would outside hvdmagic, with a note saying so.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import os
import sys

from hvdmagic import protocol
from hvdmagic.rank import telemetry

_ADOPTED = "_hvdmagic_adopted"
_RESERVED = {"step", "rank", "time"}  # the metrics table's own columns: a logged value of that name is left out


def _note_once(what: str, exc: BaseException) -> None:
    telemetry.emit(protocol.note(f"hvdmagic: {what} ({type(exc).__name__}: {exc})", once=f"trainers {what}"))


def _torchrun_layout() -> tuple[int, int, int] | None:
    """(ranks, ranks on this host, hosts) in a ``%%torchrun`` rank (its own TorchElastic run id, not
    variables the kernel's environment happened to hold); None elsewhere."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or os.environ["TORCHELASTIC_RUN_ID"] != os.environ.get(
            protocol.JOB_ID_ENV):
        return None
    return int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["GROUP_WORLD_SIZE"])


# -- Lightning ------------------------------------------------------------------------


def adopt_lightning(module) -> None:
    """Wrap ``module.Trainer`` (``<package>.trainer.trainer``) so that each Trainer joins the dashboard."""
    cls = module.Trainer
    if cls.__dict__.get(_ADOPTED):
        return
    package = module.__name__.rsplit(".trainer.trainer", 1)[0]  # "lightning.pytorch" or "pytorch_lightning"
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        layout = _torchrun_layout()
        if layout is not None and not args and "devices" not in kwargs and "num_nodes" not in kwargs:
            ranks, local, hosts = layout
            if local * hosts == ranks:  # Lightning needs as many processes on every node
                kwargs.update(devices=local, num_nodes=hosts)
        original(self, *args, **kwargs)
        _check_processes(self, layout)
        try:
            _join_dashboard(self, package)
        except Exception as exc:  # the Trainer trains as it would outside hvdmagic
            _note_once("Lightning's Trainer was not adopted: its bar and self.log values stay off the dashboard",
                       exc)

    cls.__init__ = __init__
    setattr(cls, _ADOPTED, True)


def _check_processes(trainer, layout: tuple[int, int, int] | None) -> None:
    """A Trainer that would start processes inside a rank, or lay out other processes than the cell's
    ranks, fails in one paragraph here, before ``fit`` forks or waits for peers that never come."""
    start_method = getattr(trainer.strategy, "_start_method", "popen")
    if start_method != "popen":  # ddp_spawn, ddp_fork, ddp_notebook: Lightning's multiprocessing launcher
        raise RuntimeError(
            f"Trainer(strategy=...) with start method {start_method!r} (ddp_spawn, ddp_fork or ddp_notebook) starts "
            f"processes of its own inside each rank, but the cell's ranks already are Lightning's processes: use "
            f"strategy=\"ddp\" in a %%torchrun cell, and --np for the number of processes.")
    if layout is None or not hasattr(trainer.strategy, "parallel_devices"):
        return  # a %%horovod cell (HorovodStrategy counts Horovod's ranks), or one process training alone
    ranks, local, hosts = layout
    devices, nodes = trainer.num_devices, trainer.num_nodes
    if devices != local or devices * nodes != ranks:
        fits = (f"devices={local}, num_nodes={hosts}" if local * hosts == ranks else
                "a cell with as many ranks on every host (Lightning needs that)")
        raise RuntimeError(
            f"Trainer(devices={devices}, num_nodes={nodes}) lays out {devices * nodes} processes, {devices} a node, "
            f"but this %%torchrun cell has {ranks} rank(s), {local} on this host of {hosts}, and each rank is one of "
            f"Lightning's processes. Leave devices and num_nodes out (the cell's layout is then given), give "
            f"{fits}, or run the cell with --np {devices * nodes}.")


def _join_dashboard(trainer, package: str) -> None:
    # Imported here, when a Trainer is built: while the hook runs, the package is half imported.
    public = "lightning" if package.startswith("lightning") else "pytorch_lightning"
    callback = importlib.import_module(f"hvdmagic.callbacks.{public}").HvdmagicCallback
    bars = importlib.import_module(f"{package}.callbacks.progress")
    lightnings = tuple(getattr(bars, name) for name in ("TQDMProgressBar", "RichProgressBar") if hasattr(bars, name))
    trainer.callbacks[:] = [given for given in trainer.callbacks if type(given) not in lightnings]
    if not any(isinstance(given, callback) for given in trainer.callbacks):  # the cell's own: not a second one
        trainer.callbacks.append(callback())


# -- what trainers log ------------------------------------------------------------------


def logged_numbers(logs) -> dict[str, float]:
    """The finite numbers of a trainer's ``logs`` (strings, schedules and the table's own columns left out)."""
    numbers = {}
    for name, value in (logs or {}).items():
        if isinstance(value, bool) or name in _RESERVED:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            continue
        if math.isfinite(number):
            numbers[name] = number
    return numbers


def _log(step, values, source: str) -> None:
    """``values``' numbers as metrics at ``step``; never fails the trainer's own logging."""
    try:
        if numbers := logged_numbers(values):
            telemetry.log_metrics(step=step, **numbers)
    except Exception as exc:
        _note_once(f"{source}'s values did not all reach the dashboard", exc)


# -- Hugging Face ---------------------------------------------------------------------


def adopt_transformers(module) -> None:
    """Swap ``transformers.trainer``'s default progress callback for the dashboard's, and add its metrics."""
    if getattr(module, _ADOPTED, False):
        return
    from transformers.trainer_callback import ProgressCallback, TrainerCallback

    class DashboardProgress(ProgressCallback):
        """Every rank's ``epoch`` counter, ``step`` bar and ``evaluate`` bar (Hugging Face draws rank
        0's only). A ProgressCallback, so ``trainer.remove_callback(ProgressCallback)`` still removes
        it; none of its tqdm bars is drawn."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.predicted = 0

        @staticmethod
        def epochs(state) -> int | None:
            # An IterableDataset with max_steps has sys.maxsize epochs: no total then.
            return math.ceil(state.num_train_epochs) if state.num_train_epochs < 1e9 else None

        def on_train_begin(self, args, state, control, **kwargs):
            self.on_epoch_begin(args, state, control)
            layout = _torchrun_layout()
            if layout and layout[0] > 1 and args.world_size == 1:  # never shown as healthy
                telemetry.emit(protocol.note(
                    f"hvdmagic: the Trainer of {{ranks}} runs alone ({args.parallel_mode}, world size 1) in a "
                    f"cell of {layout[0]} ranks: each rank trains its own copy on all the data. Leave "
                    "ACCELERATE_USE_CPU unset (or give TrainingArguments use_cpu=True on CPU ranks) so that it "
                    "trains across them.", rank=int(os.environ.get("RANK", 0)), ranked=True))

        def on_epoch_begin(self, args, state, control, **kwargs):
            # The step after the epoch, each time: the row's bar is the one first reported last
            # (``progress_text.pick_bars``), and the step is the bar to watch, the epoch its counter
            # ("epoch 1/2 ... step 5/16"); a report carries each bar's latest call.
            telemetry.progress(int(state.epoch or 0), self.epochs(state), "epoch")
            telemetry.progress(state.global_step, state.max_steps, "step")

        def on_step_end(self, args, state, control, **kwargs):
            telemetry.progress(state.global_step, state.max_steps, "step")

        def on_prediction_step(self, args, state, control, eval_dataloader=None, **kwargs):
            self.predicted += 1
            total = len(eval_dataloader) if hasattr(eval_dataloader, "__len__") else None
            telemetry.progress(self.predicted, total, "evaluate")

        def on_evaluate(self, args, state, control, **kwargs):
            self.predicted = 0

        on_predict = on_evaluate

        def on_log(self, args, state, control, logs=None, **kwargs):
            pass  # the logs are metrics (DashboardMetrics), not text in rank 0's log

        def on_train_end(self, args, state, control, **kwargs):
            telemetry.progress(math.ceil(state.epoch or 0), self.epochs(state), "epoch")

    class DashboardMetrics(TrainerCallback):
        """``logs``' numbers as this rank's metrics, at the trainer's global step."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            _log(state.global_step, logs, "the Trainer's logs")

    module.DEFAULT_PROGRESS_CALLBACK = DashboardProgress
    module.DEFAULT_CALLBACKS = [*module.DEFAULT_CALLBACKS, DashboardMetrics]
    setattr(module, _ADOPTED, True)


def _cpu_ranks_train_together() -> None:
    """In a ``%%torchrun`` cell of several ranks without GPUs, Hugging Face's ``TrainingArguments``
    and accelerate's ``Accelerator`` not given ``use_cpu=True`` / ``cpu=True`` would run NOT_PARALLEL:
    accelerate picks its distributed type from the devices it finds, and takes the CPU's (gloo) only
    when told. Each rank then trained a copy of its own on all the data, and looked healthy.
    ``ACCELERATE_USE_CPU``, which ``accelerate launch --cpu`` sets, is what both read; a value the
    cell's environment gives is kept."""
    layout = _torchrun_layout()
    if layout is None or layout[0] < 2 or "ACCELERATE_USE_CPU" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["ACCELERATE_USE_CPU"] = "true"


def adopt_training_arguments(module) -> None:
    """A ``TrainingArguments`` that needs a GPU (``bf16=True`` without ``use_cpu``), made in a rank
    without one, fails saying that the rank has none and what to give instead: a notebook moved from
    a GPU machine to a cell's CPU ranks brings such arguments. On CPU ranks, the arguments train
    across the cell's ranks (``_cpu_ranks_train_together``)."""
    _cpu_ranks_train_together()
    cls = module.TrainingArguments
    if cls.__dict__.get(_ADOPTED):
        return
    original = cls.__post_init__

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except ValueError as exc:
            import torch

            if "gpu" not in str(exc).lower() or torch.cuda.is_available():
                raise
            raise ValueError(
                f"{str(exc).rstrip('.')}. Rank {os.environ.get('RANK', '?')} of this cell has no GPU (its Spark task "
                f"was given none, or its machine has none): on CPU ranks give TrainingArguments use_cpu=True "
                f"(fp16 and, where the CPU supports it, bf16 then run on the CPU); for GPUs, run the cell on Spark "
                f"tasks that get one (spark.task.resource.gpu.amount).") from None

    cls.__post_init__ = __post_init__
    setattr(cls, _ADOPTED, True)


# -- accelerate -----------------------------------------------------------------------


def adopt_accelerator(module) -> None:
    """``Accelerator.log(values, step)`` also logs ``values``' numbers as this rank's metrics; on CPU
    ranks, an ``Accelerator()`` trains across the cell's ranks (``_cpu_ranks_train_together``)."""
    _cpu_ranks_train_together()
    cls = module.Accelerator
    if cls.__dict__.get(_ADOPTED):
        return
    original = cls.log  # accelerate runs it on the main process only: the trackers' half

    @functools.wraps(original)
    def log(self, values, step=None, *args, **kwargs):
        _log(step, values, "Accelerator.log")
        return original(self, values, step, *args, **kwargs)

    cls.log = log
    setattr(cls, _ADOPTED, True)


def adopt_notebook_launcher(module) -> None:
    """``notebook_launcher(function, args, num_processes, ..., num_nodes)`` in a rank runs ``function`` in place.

    It would fork the rank into more processes; the cell's ranks already are the processes it
    means, with ``torch.distributed``'s variables set. Another world size is a mistake said in one
    paragraph, not a silent change of the job's size.
    """
    original = module.notebook_launcher
    if getattr(original, _ADOPTED, False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def notebook_launcher(*args, **kwargs):
        given = signature.bind(*args, **kwargs)
        given.apply_defaults()
        function, arguments = given.arguments["function"], given.arguments["args"]
        layout = _torchrun_layout()
        if layout is None:
            raise RuntimeError(
                "notebook_launcher needs torch.distributed's environment (RANK, WORLD_SIZE, MASTER_ADDR), which "
                "%%torchrun gives its ranks and %%horovod does not: run the cell with %%torchrun --np N, N being "
                "the num_processes you meant.")
        ranks = layout[0]
        processes, nodes = given.arguments["num_processes"], given.arguments["num_nodes"]
        if processes is not None and processes * nodes != ranks:
            raise RuntimeError(
                f"notebook_launcher(..., num_processes={processes}, num_nodes={nodes}) in a cell of {ranks} rank(s): "
                f"the cell's ranks are the processes notebook_launcher would start, so it runs the function in each "
                f"of them. Give the cell --np {processes * nodes} (or num_processes x num_nodes = {ranks}), or call "
                f"the function directly.")
        telemetry.emit(protocol.note(  # once a run, whichever rank says it first
            f"notebook_launcher ran {getattr(function, '__name__', 'the function')} in each of the cell's "
            f"{ranks} rank(s) instead of starting processes of its own", once="notebook_launcher"))
        return function(*arguments)

    setattr(notebook_launcher, _ADOPTED, True)
    module.notebook_launcher = notebook_launcher
    package = sys.modules.get("accelerate")  # imported before install (a template's): it holds the name already
    if package is not None and getattr(package, "notebook_launcher", None) is original:
        package.notebook_launcher = notebook_launcher


# -- torch.multiprocessing -------------------------------------------------------------


def adopt_process_spawning(module) -> None:
    """``torch.multiprocessing.spawn`` and ``start_processes`` called from outside torch fail in a rank.

    Code written for ``mp.spawn(train, nprocs=N)`` would start N more processes inside each of the
    cell's ranks, each waiting for a world that never forms. torch's own helpers (an asynchronous
    checkpoint writer, elastic's agent) spawn for their own reasons and pass.
    """
    parent = sys.modules.get("torch.multiprocessing")  # it may hold the names already (a template's torch)
    for name in ("spawn", "start_processes"):
        original = getattr(module, name, None)
        if original is None or getattr(original, _ADOPTED, False):
            continue
        refusing = _refusing(original, f"torch.multiprocessing.{name}")
        setattr(module, name, refusing)
        if parent is not None and getattr(parent, name, None) is original:
            setattr(parent, name, refusing)


def _refusing(original, called: str):
    @functools.wraps(original)
    def refuse(fn, args=(), nprocs=1, *more, **kwargs):
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller == "torch" or caller.startswith("torch."):
            return original(fn, args, nprocs, *more, **kwargs)
        ranks = os.environ.get("WORLD_SIZE")
        cell = f"each of the cell's {ranks} rank(s)" if ranks else "each of the cell's ranks"
        raise RuntimeError(
            f"{called}({getattr(fn, '__name__', 'fn')}, nprocs={nprocs}) would start {nprocs} more process(es) inside "
            f"{cell}. The cell's ranks are the processes: write the function for one rank (under %%torchrun, "
            f"torch.distributed's RANK and WORLD_SIZE are set), call it once in the cell, and give the cell --np "
            f"{nprocs}. (To start helper processes on purpose, call {called}.__wrapped__.)")

    setattr(refuse, _ADOPTED, True)
    return refuse


def _noting_failure(hook):
    """``hook``, which never fails the user's import: what it could not adopt runs as it would without it."""

    @functools.wraps(hook)
    def adopt(module) -> None:
        try:
            hook(module)
        except Exception as exc:
            _note_once(f"{module.__name__} was not adopted in the ranks; it runs as it would outside hvdmagic", exc)

    return adopt


HOOKS = {name: _noting_failure(hook) for name, hook in {
    "lightning.pytorch.trainer.trainer": adopt_lightning,
    "pytorch_lightning.trainer.trainer": adopt_lightning,
    "transformers.trainer": adopt_transformers,
    "transformers.training_args": adopt_training_arguments,
    "accelerate.accelerator": adopt_accelerator,
    "accelerate.launchers": adopt_notebook_launcher,
    "torch.multiprocessing.spawn": adopt_process_spawning,
}.items()}
