"""Lightning's, Hugging Face's and accelerate's trainers, adopted in a rank: their progress drives
the rank's row and what they log becomes the rank's metrics, with no hvdmagic callback in the cell.

- **Lightning** (``lightning.pytorch`` or ``pytorch_lightning``). A ``Trainer`` built in a rank
  gets ``HvdmagicCallback`` (a ``fit`` bar on every rank, and ``self.log``'s values as metrics
  through ``HvdmagicLogger``), unless the cell gave it one. Lightning's own bar is taken out either
  way: with ``rich`` installed Lightning picks ``RichProgressBar``, whose redrawn text the row
  cannot follow (it left "Epoch 2/2 ━━━ 8/8" lines in rank 0's log), and its tqdm bar exists on
  rank 0 only. A progress bar of the cell's own class stays.
- **Hugging Face's ``Trainer``.** Its default progress callback (a tqdm bar on rank 0 that also
  prints each ``logs`` dict) becomes one that reports on every rank: an ``epoch`` counter and a
  ``step`` bar (``global_step`` of ``max_steps``). A callback added to every Trainer's defaults
  logs the numbers of ``on_log`` (``loss``, ``learning_rate``, ``grad_norm``, ``eval_*``, ...) as
  metrics at ``global_step``, whatever bar the arguments chose (``disable_tqdm`` keeps
  Hugging Face's printer). Its notebook callback is never chosen in a rank: a rank runs no
  IPython kernel, which is what ``is_in_notebook`` looks for.
- **accelerate.** ``Accelerator.log``'s numbers are metrics as well as the trackers' (on every
  rank; accelerate's trackers log the main process's). ``notebook_launcher`` in a rank runs its
  function in place: the cell's ranks are the processes it would have started.
- **Other launchers' habits.** A Lightning ``Trainer`` whose strategy would spawn or fork
  (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``), or whose ``devices`` x ``num_nodes`` is neither
  the cell's rank count nor 1, and ``torch.multiprocessing.spawn`` / ``start_processes``, fail in
  one paragraph that says what to write instead.

Each is adopted when the module that defines the trainer is imported (``framework_bars``'s hook).
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import sys

from hvdmagic import protocol
from hvdmagic.rank import telemetry

_ADOPTED = "_hvdmagic_adopted"

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
        original(self, *args, **kwargs)
        _check_processes(self)
        _join_dashboard(self, package)

    cls.__init__ = __init__
    setattr(cls, _ADOPTED, True)


def _check_processes(trainer) -> None:
    """A Trainer that would start processes inside a rank, or count other processes than the cell's
    ranks, fails in one paragraph here, before ``fit`` forks or waits for peers that never come."""
    start_method = getattr(trainer.strategy, "_start_method", "popen")
    if start_method != "popen":  # ddp_spawn, ddp_fork, ddp_notebook: Lightning's multiprocessing launcher
        raise RuntimeError(
            f"Trainer(strategy=...) with start method {start_method!r} (ddp_spawn, ddp_fork or ddp_notebook) starts "
            f"processes of its own inside each rank, but the cell's ranks already are Lightning's processes: use "
            f"strategy=\"ddp\" in a %%torchrun cell, and --np for the number of processes.")
    if "WORLD_SIZE" not in os.environ:
        return  # a %%horovod cell: HorovodStrategy counts Horovod's ranks
    ranks, devices, nodes = int(os.environ["WORLD_SIZE"]), trainer.num_devices, trainer.num_nodes
    if devices * nodes not in (ranks, 1):  # devices and num_nodes left at 1 (their defaults on CPU) count the ranks
        raise RuntimeError(
            f"Trainer(devices={devices}, num_nodes={nodes}) asks for {devices * nodes} processes, but this %%torchrun "
            f"cell has {ranks} rank(s), each one of Lightning's processes. Give devices x num_nodes = {ranks} "
            f"(devices={ranks} for ranks on one host, or devices=1, num_nodes={ranks} as pyspark's TorchDistributor "
            f"docs write it), or run the cell with --np {devices * nodes}.")


def _join_dashboard(trainer, package: str) -> None:
    # Imported here, when a Trainer is built: while the hook runs, the package is half imported.
    public = "lightning" if package.startswith("lightning") else "pytorch_lightning"
    callback = importlib.import_module(f"hvdmagic.callbacks.{public}").HvdmagicCallback
    bars = importlib.import_module(f"{package}.callbacks.progress")
    lightnings = tuple(getattr(bars, name) for name in ("TQDMProgressBar", "RichProgressBar") if hasattr(bars, name))
    trainer.callbacks[:] = [given for given in trainer.callbacks if type(given) not in lightnings]
    if not any(isinstance(given, callback) for given in trainer.callbacks):  # the cell's own: not a second one
        trainer.callbacks.append(callback())


# -- Hugging Face ---------------------------------------------------------------------


def logged_numbers(logs) -> dict[str, float]:
    """The finite numbers of a trainer's ``logs`` (strings and schedules left out)."""
    numbers = {}
    for name, value in (logs or {}).items():
        if isinstance(value, bool):
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(number):
            numbers[name] = number
    return numbers


def adopt_transformers(module) -> None:
    """Swap ``transformers.trainer``'s default progress callback for the dashboard's, and add its metrics."""
    if getattr(module, _ADOPTED, False):
        return
    from transformers.trainer_callback import TrainerCallback

    class DashboardProgress(TrainerCallback):
        """Every rank's ``epoch`` counter and ``step`` bar (Hugging Face draws rank 0's only)."""

        def on_epoch_begin(self, args, state, control, **kwargs):
            telemetry.progress(int(state.epoch or 0), math.ceil(state.num_train_epochs), "epoch")

        def on_step_end(self, args, state, control, **kwargs):
            telemetry.progress(state.global_step, state.max_steps, "step")

        def on_train_end(self, args, state, control, **kwargs):
            telemetry.progress(math.ceil(state.epoch or 0), math.ceil(state.num_train_epochs), "epoch")

    class DashboardMetrics(TrainerCallback):
        """``logs``' numbers as this rank's metrics, at the trainer's global step."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if numbers := logged_numbers(logs):
                telemetry.log_metrics(step=state.global_step, **numbers)

    module.DEFAULT_PROGRESS_CALLBACK = DashboardProgress
    module.DEFAULT_CALLBACKS = [*module.DEFAULT_CALLBACKS, DashboardMetrics]
    setattr(module, _ADOPTED, True)


# -- accelerate -----------------------------------------------------------------------


def adopt_accelerator(module) -> None:
    """``Accelerator.log(values, step)`` also logs ``values``' numbers as this rank's metrics."""
    cls = module.Accelerator
    if cls.__dict__.get(_ADOPTED):
        return
    original = cls.log  # accelerate runs it on the main process only: the trackers' half

    @functools.wraps(original)
    def log(self, values, step=None, *args, **kwargs):
        if numbers := logged_numbers(values):
            telemetry.log_metrics(step=step, **numbers)
        return original(self, values, step, *args, **kwargs)

    cls.log = log
    setattr(cls, _ADOPTED, True)


def adopt_notebook_launcher(module) -> None:
    """``notebook_launcher(function, args, num_processes)`` in a rank runs ``function`` in place.

    It would fork the rank into more processes; the cell's ranks already are the processes it
    means, with ``torch.distributed``'s variables set. A different ``num_processes`` is a mistake
    said in one paragraph, not a silent change of the job's size.
    """
    original = module.notebook_launcher
    if getattr(original, _ADOPTED, False):
        return

    @functools.wraps(original)
    def notebook_launcher(function, args=(), num_processes=None, *more, **kwargs):
        if "WORLD_SIZE" not in os.environ:
            raise RuntimeError(
                "notebook_launcher needs torch.distributed's environment (RANK, WORLD_SIZE, MASTER_ADDR), which "
                "%%torchrun gives its ranks and %%horovod does not: run the cell with %%torchrun --np N, N being "
                "the num_processes you meant.")
        ranks = int(os.environ["WORLD_SIZE"])
        if num_processes not in (None, ranks):
            raise RuntimeError(
                f"notebook_launcher(..., num_processes={num_processes}) in a cell of {ranks} rank(s): the cell's "
                f"ranks are the processes notebook_launcher would start, so it runs the function in each of them. "
                f"Give the cell --np {num_processes} (or num_processes={ranks}), or call the function directly.")
        telemetry.emit(protocol.note(  # once a run, whichever rank says it first
            f"notebook_launcher ran {getattr(function, '__name__', 'the function')} in each of the cell's "
            f"{ranks} rank(s) instead of starting processes of its own", once="notebook_launcher"))
        return function(*args)

    setattr(notebook_launcher, _ADOPTED, True)
    module.notebook_launcher = notebook_launcher


# -- torch.multiprocessing -------------------------------------------------------------


def adopt_process_spawning(module) -> None:
    """``torch.multiprocessing.spawn`` and ``start_processes`` in a rank fail in one paragraph.

    Code written for ``mp.spawn(train, nprocs=N)`` would start N more processes inside each of the
    cell's ranks, each waiting for a world that never forms.
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
        ranks = os.environ.get("WORLD_SIZE")
        cell = f"each of the cell's {ranks} rank(s)" if ranks else "each of the cell's ranks"
        raise RuntimeError(
            f"{called}({getattr(fn, '__name__', 'fn')}, nprocs={nprocs}) would start {nprocs} more process(es) inside "
            f"{cell}. The cell's ranks are the processes: write the function for one rank (under %%torchrun, "
            f"torch.distributed's RANK and WORLD_SIZE are set), call it once in the cell, and give the cell --np "
            f"{nprocs}.")

    setattr(refuse, _ADOPTED, True)
    return refuse


HOOKS = {
    "lightning.pytorch.trainer.trainer": adopt_lightning,
    "pytorch_lightning.trainer.trainer": adopt_lightning,
    "transformers.trainer": adopt_transformers,
    "accelerate.accelerator": adopt_accelerator,
    "accelerate.launchers": adopt_notebook_launcher,
    "torch.multiprocessing.spawn": adopt_process_spawning,
}
