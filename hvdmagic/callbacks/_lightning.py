"""The Lightning integration, written once for both of Lightning's package names.

Lightning ships the same classes as ``lightning.pytorch`` and as
``pytorch_lightning``, and a Trainer accepts only callbacks, loggers and
strategies built on its own package's base classes. ``define(pl)`` therefore
builds the classes on the bases of the namespace it is given; the public
modules ``hvdmagic.callbacks.lightning`` and ``hvdmagic.callbacks.pytorch_lightning``
each call it once.

Lightning 2.x dropped its Horovod strategy, so ``HorovodStrategy`` brings the
essentials back: Horovod's rank and size, a ``DistributedSampler`` per
dataloader, ``hvd.DistributedOptimizer`` with one gradient average per step,
rank 0's parameters and optimizer state broadcast before training, and
collectives (``self.log(..., sync_dist=True)``, ``all_gather``) over Horovod.
"""

from __future__ import annotations

import importlib
import math
from contextlib import ExitStack
from types import ModuleType

from hvdmagic.rank.telemetry import log_metrics, progress

_OPERATIONS = {"mean": "Average", "avg": "Average", "average": "Average", "sum": "Sum", "max": "Max", "min": "Min"}


def horovod_operation(hvd, reduce_op):
    """Horovod's reduction for Lightning's ``reduce_op`` ("mean", "sum", or torch's ReduceOp)."""
    if reduce_op is None:
        name = "mean"
    elif isinstance(reduce_op, str):
        name = reduce_op.lower()
    else:
        name = str(reduce_op).rsplit(".", 1)[-1].lower()  # torch's ReduceOp.SUM prints as "RedOpType.SUM"
    if name not in _OPERATIONS:
        raise ValueError(f"HorovodStrategy cannot reduce with {reduce_op!r}: Horovod offers "
                         f"{', '.join(sorted(_OPERATIONS))}.")
    return getattr(hvd, _OPERATIONS[name])


def define(pl: ModuleType) -> dict[str, type]:
    """The Lightning classes, built on ``pl``'s base classes (``lightning.pytorch`` or ``pytorch_lightning``)."""
    import torch

    try:  # HorovodStrategy needs it; the callback and the logger serve %%torchrun's strategy="ddp" too
        import horovod.torch as hvd
    except ImportError:
        hvd = None
    from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only

    rank_zero_only = importlib.import_module(f"{pl.__name__}.utilities.rank_zero").rank_zero_only
    fitting = importlib.import_module(f"{pl.__name__}.trainer.states").TrainerFn.FITTING
    module = f"hvdmagic.callbacks.{'lightning' if pl.__name__.startswith('lightning') else 'pytorch_lightning'}"

    def set_rank_zero(rank: int) -> None:
        # Lightning prints, warns, checkpoints and writes its own logs only where this is 0.
        rank_zero_only.rank = utilities_rank_zero_only.rank = rank

    class HvdmagicLogger(pl.loggers.Logger):
        """Sends what the module logs with ``self.log(...)`` to ``hvdmagic.log_metrics``.

        Every rank logs its own values (rank 0's are charted); log with
        ``sync_dist=True`` under ``HorovodStrategy`` to chart the mean over ranks.
        Lightning calls it every ``log_every_n_steps`` steps and at epoch ends.

        ``save_dir``: where Lightning puts what it would put in a logger's folder. With the
        callback's (the Trainer's ``default_root_dir``) and an empty name and version, a Trainer
        whose only logger this is keeps the folders it has with no logger at all:
        ``trainer.log_dir`` is the root, and checkpoints go to ``<root>/checkpoints``.
        """

        def __init__(self, save_dir: str | None = None):
            super().__init__()
            self._save_dir = save_dir

        @property
        def save_dir(self) -> str | None:
            return self._save_dir

        @property
        def name(self) -> str:
            return ""

        @property
        def version(self) -> str:
            return ""

        def log_hyperparams(self, params, *args, **kwargs) -> None:
            pass  # the dashboard shows metrics only

        def log_metrics(self, metrics, step=None) -> None:
            log_metrics(step=step, **metrics)

    class HvdmagicCallback(pl.Callback):
        """Progress and metrics of a Lightning run in the hvdmagic dashboard.

        ``progress``: one bar per rank over the whole fit, ``trainer.global_step`` of
        ``trainer.estimated_stepping_batches``. ``metrics``: adds an ``HvdmagicLogger``
        to the trainer's loggers (unless one is there), so that everything logged with
        ``self.log`` reaches ``hvdmagic.log_metrics`` with Lightning's step. Outside a
        ``%%horovod`` run both are no-ops, so the same Trainer runs on one machine.
        """

        def __init__(self, progress: bool = True, metrics: bool = True, desc: str = "fit"):
            self.progress = progress
            self.metrics = metrics
            self.desc = desc
            self._total: int | None = None

        def setup(self, trainer, pl_module, stage: str) -> None:
            if self.metrics and not any(isinstance(logger, HvdmagicLogger) for logger in trainer.loggers):
                trainer.loggers = [*trainer.loggers, HvdmagicLogger(save_dir=trainer.default_root_dir)]

        def on_train_start(self, trainer, pl_module) -> None:
            total = trainer.estimated_stepping_batches  # inf when neither max_epochs nor max_steps bounds it
            self._total = int(total) if math.isfinite(total) else None
            if self.progress:
                progress(trainer.global_step, self._total, self.desc)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
            if self.progress:
                progress(trainer.global_step, self._total, self.desc)

    class HorovodStrategy(pl.strategies.ParallelStrategy):
        """Lightning on Horovod ranks: ``Trainer(strategy=HorovodStrategy())`` in a ``%%horovod`` cell.

        Each rank is one process with one device. The strategy wraps the module's
        optimizers in ``hvd.DistributedOptimizer`` (keep ``configure_optimizers``
        plain; scale the learning rate with ``hvdmagic.scale_lr``), broadcasts rank
        0's parameters and optimizer state before training, gives each dataloader a
        ``DistributedSampler`` (rank, size) so each rank sees its own part of the data,
        reduces ``self.log(..., sync_dist=True)`` values over the ranks, and lets only
        rank 0 save checkpoints. It calls ``hvd.init()`` itself (a no-op when the cell
        already did); on one machine it is a single rank.
        """

        strategy_name = "hvdmagic_horovod"

        def __init__(self, accelerator=None, checkpoint_io=None, precision_plugin=None):
            super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
            if hvd is None:
                raise ImportError("HorovodStrategy needs horovod (run the README's set-up command); under "
                                  "%%torchrun use Lightning's own strategy='ddp' with HvdmagicCallback")
            hvd.init()
            set_rank_zero(hvd.rank())  # before the Trainer prints its device summary
            self._exit_stack: ExitStack | None = None

        # Lightning's names for Horovod's ranks.
        global_rank = property(lambda self: hvd.rank())
        local_rank = property(lambda self: hvd.local_rank())
        node_rank = property(lambda self: hvd.cross_rank())
        world_size = property(lambda self: hvd.size())

        @property
        def is_distributed(self) -> bool:
            return True  # tells Lightning to add a DistributedSampler to each dataloader

        @property
        def distributed_sampler_kwargs(self) -> dict:
            return {"num_replicas": self.world_size, "rank": self.global_rank}

        @property
        def root_device(self):
            devices = self.parallel_devices or [torch.device("cpu")]
            # Usually one device per rank (hvdmagic pins a rank's GPUs); else the local rank's.
            return devices[self.local_rank] if 1 < len(devices) and self.local_rank < len(devices) else devices[0]

        def setup_environment(self) -> None:
            set_rank_zero(self.global_rank)
            super().setup_environment()

        def model_to_device(self) -> None:
            self.model.to(self.root_device)

        def setup(self, trainer) -> None:
            super().setup(trainer)
            if trainer.state.fn != fitting:
                return
            plain = list(self.optimizers)
            self.optimizers = [self._distributed(optimizer, trainer.accumulate_grad_batches) for optimizer in plain]
            for config in self.lr_scheduler_configs:
                if getattr(config.scheduler, "optimizer", None) in plain:
                    config.scheduler.optimizer = self.optimizers[plain.index(config.scheduler.optimizer)]
            hvd.broadcast_parameters(self.lightning_module.state_dict(), root_rank=0)
            for optimizer in self.optimizers:
                hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            # optimizer_step averages the gradients right after backward; without this,
            # Horovod's step() would allreduce them a second time.
            self._exit_stack = ExitStack()
            for optimizer in self.optimizers:
                self._exit_stack.enter_context(optimizer.skip_synchronize())

        def _distributed(self, optimizer, accumulate_grad_batches: int):
            if hasattr(optimizer, "skip_synchronize"):
                return optimizer  # already a hvd.DistributedOptimizer, from configure_optimizers
            # Only the parameters this optimizer owns, named as in the module.
            owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
            named = [(name, p) for name, p in self.lightning_module.named_parameters() if id(p) in owned]
            return hvd.DistributedOptimizer(optimizer, named_parameters=named,
                                            backward_passes_per_step=accumulate_grad_batches)

        def optimizer_step(self, optimizer, closure, model=None, **kwargs):
            def closure_then_average():
                # Lightning runs backward inside the closure; the average must land
                # before clipping, on_before_optimizer_step and the update.
                loss = closure()
                if hasattr(optimizer, "synchronize"):
                    optimizer.synchronize()
                return loss

            return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)

        def reduce(self, tensor, group=None, reduce_op="mean"):
            if not isinstance(tensor, torch.Tensor):
                return tensor
            return hvd.allreduce(tensor, op=horovod_operation(hvd, reduce_op))

        def all_gather(self, tensor, group=None, sync_grads: bool = False):
            # Lightning's contract: a new leading dimension of size world_size.
            return hvd.allgather(tensor.unsqueeze(0))

        def barrier(self, name=None) -> None:
            hvd.barrier()

        def broadcast(self, obj, src: int = 0):
            return hvd.broadcast_object(obj, root_rank=src)

        def teardown(self) -> None:
            if self._exit_stack is not None:
                self._exit_stack.close()
                self._exit_stack = None
            super().teardown()

    classes = {"HvdmagicLogger": HvdmagicLogger, "HvdmagicCallback": HvdmagicCallback,
               "HorovodStrategy": HorovodStrategy}
    for name, cls in classes.items():
        # Importable names, so pickle (and Lightning's checkpoints) find them by reference.
        cls.__module__, cls.__qualname__ = module, name
    return classes


def load(package: str, install: str) -> tuple[type, type, type]:
    """``(HorovodStrategy, HvdmagicCallback, HvdmagicLogger)`` on ``package``'s base classes.

    ``install`` finishes the one-paragraph error for a missing package.
    """
    try:
        pl = importlib.import_module(package)
    except ImportError as exc:
        public = "lightning" if package.startswith("lightning") else "pytorch_lightning"
        raise ImportError(f"hvdmagic.callbacks.{public} needs PyTorch Lightning 2.x, imported as {package}, in "
                          f"the notebook's and every rank's environment: {install}") from exc
    classes = define(pl)
    return classes["HorovodStrategy"], classes["HvdmagicCallback"], classes["HvdmagicLogger"]
