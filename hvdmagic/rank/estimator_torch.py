"""``TorchEstimator.fit``'s training loop, as each rank runs it (``hvdmagic.spark.torch``).

It keeps horovod.spark's meanings: every feature and label as float32, labels reshaped to their
output's shape, one loss per label averaged with ``loss_weights`` (equal by default), the
learning rate scaled by the number of ranks on a fresh run (and unscaled in the model it returns),
rank 0's checkpoint after every epoch, and a resumed run taking up at the epoch after it.

The collectives are Horovod's where the kernel has horovod, else torch.distributed's (DDP over
gloo, or NCCL on GPUs): the estimator works on a runtime without a horovod build.
"""

from __future__ import annotations

import os

from hvdmagic import protocol
from hvdmagic.protocol import CUDA_DEVICE_ENV
from hvdmagic.rank import telemetry, training
from hvdmagic.rank.estimator_data import FitResult, FitSpec, ShardRows, as_float32
from hvdmagic.rank.estimator_fit import RankFit
from hvdmagic.rank.shards import shard


class _Horovod:
    """Horovod's collectives over torch tensors: the skeleton's reductions (``RankGroup``) and the step's."""

    name = "horovod"

    def __init__(self, torch):
        import horovod.torch as hvd
        hvd.init()
        self.hvd, self.torch = hvd, torch
        self.rank, self.size, self.local_rank = hvd.rank(), hvd.size(), hvd.local_rank()

    def largest(self, values: list[int]) -> list[int]:
        return self.hvd.allreduce(self.torch.tensor(values), op=self.hvd.Max, name="hvdmagic.rows").tolist()

    def mean(self, metrics: dict[str, float]) -> dict[str, float]:
        tensor = self.torch.tensor(list(metrics.values()), dtype=self.torch.float64)
        return dict(zip(metrics, self.hvd.allreduce(tensor, op=self.hvd.Average, name="hvdmagic.metrics").tolist()))

    def distribute(self, model, optimizer, spec: FitSpec):
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        options = {"compression": spec.gradient_compression} if spec.gradient_compression is not None else {}
        optimizer = self.hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                                  backward_passes_per_step=spec.backward_passes_per_step, **options)
        return model, optimizer

    def quietly(self, model, last: bool):
        import contextlib

        return contextlib.nullcontext()  # DistributedOptimizer counts the passes itself


class _TorchDistributed:
    """torch.distributed's collectives (DDP's gradients): the skeleton's reductions (``RankGroup``) and the step's."""

    name = "torch.distributed"

    def __init__(self, torch, device):
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        self.dist, self.torch, self.device = dist, torch, device
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))

    def largest(self, values: list[int]) -> list[int]:
        tensor = self.torch.tensor(values, device=self.device)
        self.dist.all_reduce(tensor, op=self.dist.ReduceOp.MAX)
        return tensor.tolist()

    def mean(self, metrics: dict[str, float]) -> dict[str, float]:
        tensor = self.torch.tensor(list(metrics.values()), dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(tensor)
        return dict(zip(metrics, (tensor / self.size).tolist()))

    def distribute(self, model, optimizer, spec: FitSpec):
        from torch.nn.parallel import DistributedDataParallel

        if spec.gradient_compression is not None and self.rank == 0:
            telemetry.emit(protocol.note("hvdmagic: gradient_compression is Horovod's; this fit runs on "
                                         "torch.distributed (no horovod here), which sends gradients uncompressed"))
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids), optimizer

    def quietly(self, model, last: bool):
        import contextlib

        return contextlib.nullcontext() if last else model.no_sync()  # gradients summed locally until the last pass


def fit(spec: FitSpec) -> FitResult | None:
    """Train ``spec.model`` on this rank's shard; rank 0 returns the weights, optimizer state and history."""
    import torch
    import torch._dynamo  # the optimizer's first call imports it (2 s here): named, the host's template imports it

    if spec.collectives == "horovod":
        import horovod.torch  # noqa: F401  (named in fit itself, so that the host's template imports it ahead)
    device = _device(torch, spec)
    group = _Horovod(torch) if spec.collectives == "horovod" else _TorchDistributed(torch, device)
    run = RankFit(spec, group, str(device), torch.manual_seed)
    model, optimizer = spec.model, spec.optimizer
    if optimizer is None:
        raise ValueError("TorchEstimator needs an optimizer (optimizer=torch.optim.SGD(model.parameters(), lr=...))")
    model.to(device)
    optimizer.load_state_dict(optimizer.state_dict())  # its state onto the parameters' device
    if spec.checkpoint_dir:
        state, epoch = training.load_checkpoint(spec.checkpoint_dir, spec.store_options)
        if state is not None:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            run.resumed(epoch, state["history"])
    if run.start == 0:
        _scale_lr(optimizer.param_groups, group.size)
    model, optimizer = group.distribute(model, optimizer, spec)

    rows = ShardRows(shard(), spec)
    steps = run.epoch_steps(rows)
    step = _Step(spec, model, optimizer, group, device)
    with run.training():
        for epoch in range(run.start, spec.epochs):
            run.epoch_started(epoch)
            model.train()
            sums = _Sums(spec)
            for batch, arrays in enumerate(rows.batches(rows.train, spec.batch_size, steps.train, run.shuffles)):
                sums.add(*step.train(batch, steps.train, arrays))
                run.batch_done(batch)
            step.epoch_done()
            metrics = dict(zip(sums.names(""), sums.averages()))
            if steps.val:
                model.eval()
                sums = _Sums(spec)
                with torch.no_grad():
                    for arrays in rows.batches(rows.val, steps.val_batch_size, steps.val):
                        sums.add(*step.evaluate(arrays))
                metrics.update(zip(sums.names("val_"), sums.averages()))
            run.epoch_done(epoch, metrics)
            if spec.checkpoint_dir:
                training.save_checkpoint({"model": _plain(model).state_dict(), "optimizer": optimizer.state_dict(),
                                          "history": run.history}, spec.checkpoint_dir, step=epoch, keep=1,
                                          storage_options=spec.store_options)
    if group.rank != 0:
        return None
    plain = _plain(model)
    plain.eval()
    with torch.no_grad():  # what one row gives out: the prediction columns' sizes and types, known in advance
        inputs, _, _ = step.tensors(next(rows.batches(rows.train, 1, 1)))
        outputs, _ = _match_outputs(plain(*inputs), [])
    plain.to("cpu")
    state = optimizer.state_dict()
    _scale_lr(state["param_groups"], 1 / group.size)  # as the user gave it: a refit on another size scales it anew
    return run.result(plain.state_dict(), state, [int(output[0].numel()) for output in outputs])


class _Step:
    """A batch's tensors, the loss over the labels, and one training or validation step on them."""

    def __init__(self, spec: FitSpec, model, optimizer, group, device):
        self.spec, self.model, self.optimizer, self.group, self.device = spec, model, optimizer, group, device
        self.losses = _losses(spec)
        self.weights = spec.loss_weights or [1.0 / len(spec.label_cols)] * len(spec.label_cols)
        # horovod.spark's hook: the step function itself, called with train's arguments. Since horovod 0.26 they are
        # 9, backward_passes_per_step and the batch's index last, and the function steps the optimizer at the start of
        # each group of passes (the loop steps it once more after each epoch); before, 7, and a whole step each call.
        self.custom = spec.train_minibatch_fn
        self.custom_passes = self.custom is not None and _takes(self.custom, 9)

    def tensors(self, arrays):
        """(inputs, labels, sample weights) of a batch, float32 as horovod.spark gives every column."""
        import torch

        spec = self.spec
        shapes = spec.input_shapes or [None] * len(spec.feature_cols)
        inputs = [torch.from_numpy(as_float32(arrays[c], shape)).to(self.device)
                  for c, shape in zip(spec.feature_cols, shapes)]
        labels = [torch.from_numpy(as_float32(arrays[c])).to(self.device) for c in spec.label_cols]
        sample_weights = torch.from_numpy(as_float32(arrays[spec.sample_weight_col])).to(self.device) \
            if spec.sample_weight_col else None
        return inputs, labels, sample_weights

    def loss(self, outputs, labels, sample_weights):
        total = 0
        for output, label, loss, weight in zip(outputs, labels, self.losses, self.weights):
            if sample_weights is None:
                total = total + loss(output, label) * weight
            else:  # per-row losses, each weighted, then their mean (horovod.spark's rule)
                total = total + (loss(output, label, reduction="none").flatten() * sample_weights).mean() * weight
        return total

    def train(self, batch: int, steps: int, arrays):
        """One training step on the ``batch``-th batch of ``steps``: (loss, outputs, labels) for the epoch's sums;
        the optimizer steps every ``backward_passes_per_step`` batches."""
        inputs, labels, sample_weights = self.tensors(arrays)
        passes = self.spec.backward_passes_per_step
        last = (batch + 1) % passes == 0 or batch + 1 == steps
        with self.group.quietly(self.model, last):
            if self.custom is not None:
                outputs, loss = self.custom(self.model, self.optimizer, self.match, self.loss, inputs, labels,
                                            sample_weights, *((passes, batch) if self.custom_passes else ()))
            else:
                if batch % passes == 0:
                    self.optimizer.zero_grad()
                outputs, labels = self.match(self.model(*inputs), labels)
                loss = self.loss(outputs, labels, sample_weights)
                (loss / passes if passes > 1 else loss).backward()
                if (batch + 1) % passes == 0:
                    self.optimizer.step()
        return (loss, *self.match(outputs, labels))

    def epoch_done(self) -> None:
        """After an epoch's batches: the last group's step of a ``train_minibatch_fn`` that steps at the start of
        each group (horovod.spark's loop makes it)."""
        if self.custom_passes:
            self.optimizer.step()

    def evaluate(self, arrays):
        """(loss, outputs, labels) of a validation batch (under torch.no_grad)."""
        inputs, labels, sample_weights = self.tensors(arrays)
        outputs, labels = self.match(self.model(*inputs), labels)
        return self.loss(outputs, labels, sample_weights), outputs, labels

    def match(self, outputs, labels):
        """``_match_outputs`` with the fit's ``label_shapes``."""
        return _match_outputs(outputs, labels, self.spec.label_shapes)


def _device(torch, spec: FitSpec):
    if spec.use_gpu is not False and torch.cuda.is_available():
        index = int(os.environ.get(CUDA_DEVICE_ENV, os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if spec.use_gpu:
        raise RuntimeError("use_gpu=True, but torch sees no CUDA device in this rank: give the tasks GPUs "
                           "(spark.task.resource.gpu.amount) or pass use_gpu=False")
    return torch.device("cpu")


def _losses(spec: FitSpec) -> list:
    if spec.loss_constructors:
        return [make() for make in spec.loss_constructors]
    if spec.loss is None:
        raise ValueError("TorchEstimator needs a loss (loss=torch.nn.MSELoss(), or one per label column)")
    losses = list(spec.loss) if isinstance(spec.loss, (list, tuple)) else [spec.loss] * len(spec.label_cols)
    if len(losses) != len(spec.label_cols):
        raise ValueError(f"{len(losses)} losses for {len(spec.label_cols)} label columns {spec.label_cols}: give "
                         "one loss, or one per label column")
    return losses


def _match_outputs(outputs, labels, label_shapes=None):
    """The model's outputs as a list, each label reshaped to its ``label_shapes`` entry where one is given (-1 for
    the batch, as horovod.spark reshapes it), else to its output's shape where the sizes agree."""
    if not isinstance(outputs, (tuple, list)):
        outputs = [outputs]
    shapes = list(label_shapes or [])
    shapes += [None] * (len(labels) - len(shapes))
    labels = [label.reshape(shape) if shape is not None
              else label.reshape(output.shape) if hasattr(output, "shape") and output.shape.numel() == label.numel()
              else label for output, label, shape in zip(outputs, labels, shapes)]
    return list(outputs), labels


def _takes(function, count: int) -> bool:
    """Whether ``function`` can be called with ``count`` positional arguments (True where Python cannot tell)."""
    import inspect

    try:
        inspect.signature(function).bind(*range(count))
    except TypeError:
        return False
    except ValueError:
        return True
    return True


class _Sums:
    """The loss and the metrics over an epoch's batches on this rank."""

    def __init__(self, spec: FitSpec):
        self.spec = spec
        self.metrics = list(spec.metrics or [])
        self.totals = [0.0] * (1 + len(self.metrics) * len(spec.label_cols))
        self.count = 0

    def add(self, loss, outputs, labels) -> None:
        values = [_number(loss)]
        for metric in self.metrics:
            values.extend(_number(metric(output, label)) for output, label in zip(outputs, labels))
        self.totals = [total + value for total, value in zip(self.totals, values)]
        self.count += 1

    def averages(self) -> list[float]:
        return [total / max(self.count, 1) for total in self.totals]

    def names(self, prefix: str) -> list[str]:
        one_label = len(self.spec.label_cols) == 1
        return [f"{prefix}loss"] + [f"{prefix}{getattr(metric, '__name__', type(metric).__name__)}"
                                    + ("" if one_label else f"_{label}")
                                    for metric in self.metrics for label in self.spec.label_cols]


def _number(value) -> float:
    return float(value.detach()) if hasattr(value, "detach") else float(value)


def _plain(model):
    return getattr(model, "module", model)  # DDP's wrapped module


def _scale_lr(param_groups: list[dict], factor: float) -> None:
    """An optimizer's learning rates (its ``param_groups``, or its state's) times ``factor``."""
    for group in param_groups:
        if "lr" in group:
            group["lr"] = group["lr"] * factor
