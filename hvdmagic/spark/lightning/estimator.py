"""Lightning's ``TorchEstimator``: trains a ``LightningModule`` on a DataFrame; ``TorchModel`` predicts with it.

Runs in the notebook kernel (the Spark driver), as horovod.spark.lightning's estimator does: the module's
``training_step``, ``validation_step`` and ``configure_optimizers`` say how it trains, so there is no
``optimizer`` or ``loss`` to give. Each rank runs ``hvdmagic.rank.estimator_lightning``: a Lightning
``Trainer(strategy="ddp")`` on torch.distributed's collectives (the ranks run as a ``%%torchrun`` cell's
do), fed each rank's shard as dict batches. Modules and callbacks written for PyTorch Lightning 1.x (all
that horovod.spark's estimator accepts) train on Lightning 2 unchanged: the ranks bridge the hooks
Lightning 2 removed. Everything else is the shared estimator's (``hvdmagic.spark.common.estimator``),
and the fitted model is ``hvdmagic.spark.torch``'s ``TorchModel`` for the module.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util

from pyspark.ml.param import Param, Params, TypeConverters

from hvdmagic.rank.estimator_data import FitResult
from hvdmagic.rank.estimator_lightning import lightning_package
from hvdmagic.spark.common.estimator import FitFailed, HorovodEstimator
from hvdmagic.spark.common.params import add_accessors, keyword_signature
from hvdmagic.spark.common.persistence import Persistent
from hvdmagic.spark.torch.estimator import TorchModel as _PlainTorchModel

# The oldest Lightning the ranks train with (horovod's example reads this name to skip older ones). Modules and
# callbacks written for PyTorch Lightning 1.x train too: the ranks call their removed hooks (estimator_lightning).
MIN_PL_VERSION = "2.0.0"


def _lightning_installed() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in ("lightning", "pytorch_lightning"))


@keyword_signature
@add_accessors
class TorchEstimator(HorovodEstimator, Persistent):
    """Spark ML estimator for a PyTorch Lightning module, with horovod.spark.lightning.TorchEstimator's params.

    Each batch reaches ``training_step`` and ``validation_step`` as a dict of float32 tensors by column name
    (``batch["features"]``, ``batch["label"]``), features shaped by ``input_shapes``. ``trainer_args`` go to
    Lightning's ``Trainer`` over the estimator's own arguments; ``callbacks``, ``profiler`` and ``logger`` are
    Lightning's. Unless ``logger`` says otherwise, a CSVLogger keeps what the module logs in the store's
    ``runs/<run_id>/logs`` (horovod.spark's TensorBoardLogger would import TensorFlow in rank 0 where it is installed).

    Example::

        from hvdmagic.spark.common.store import Store
        from hvdmagic.spark.lightning import TorchEstimator

        estimator = TorchEstimator(num_proc=2, store=Store.create("/tmp/runs"), model=MyLightningModule(),
                                   feature_cols=["features"], label_cols=["label"], input_shapes=[[-1, 1, 28, 28]],
                                   batch_size=64, epochs=5, validation=0.1)
        fitted = estimator.fit(train_df)            # the dashboard shows the ranks while it trains
        predictions = fitted.transform(test_df)     # column label__output
    """

    framework = "lightning"

    # horovod.spark.lightning's own params (the shared ones are EstimatorParams').
    profiler = Param(Params._dummy(), "profiler", "Lightning's profiler (\"simple\", \"advanced\" or a Profiler)")
    logger = Param(Params._dummy(), "logger", "a Lightning logger (default: a CSVLogger in the store's logs)")
    log_every_n_steps = Param(Params._dummy(), "log_every_n_steps", "steps between the logger's rows",
                              TypeConverters.toInt)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._setDefault(profiler=None, logger=None, log_every_n_steps=None)

    def _fit_function(self):
        from hvdmagic.rank.estimator_lightning import ENTRY_POINTS

        return ENTRY_POINTS[lightning_package(self.getOrDefault("model"))]

    def _collectives(self) -> str:
        return "torch"  # Lightning's own ddp strategy; Lightning 2 has no Horovod one

    def _check_model(self) -> None:
        model = self.getOrDefault("model") if self.isDefined("model") else None
        package = lightning_package(model)
        if package is None:
            if not _lightning_installed():
                raise FitFailed("hvdmagic.spark.lightning's TorchEstimator trains a LightningModule with PyTorch "
                                f"Lightning {MIN_PL_VERSION} or later, which is not installed here: pip install "
                                "lightning (or pytorch-lightning) where the notebook and the executors run; a plain "
                                "torch.nn.Module trains with hvdmagic.spark.torch.TorchEstimator.")
            raise FitFailed(f"hvdmagic.spark.lightning's TorchEstimator trains a LightningModule (lightning.pytorch "
                            f"or pytorch_lightning), not {type(model).__name__}: its training_step and "
                            "configure_optimizers say how it trains. A plain torch.nn.Module, with an optimizer and a "
                            "loss, trains with hvdmagic.spark.torch.TorchEstimator.")
        from packaging.version import Version

        version = importlib.import_module(package.split(".")[0]).__version__
        if Version(version) < Version(MIN_PL_VERSION):
            raise FitFailed(f"hvdmagic.spark.lightning's TorchEstimator needs Lightning {MIN_PL_VERSION} or later; "
                            f"{package} here is {version}: pip install -U {package.split('.')[0]}. Modules and "
                            "callbacks written for 1.x train on it unchanged.")
        # horovod.spark's rules for a LightningModule: the module says these itself.
        if self.getOrDefault("optimizer") is not None:
            raise FitFailed("optimizer cannot be given with a LightningModule: its configure_optimizers makes the "
                            "optimizer (horovod.spark's rule). Leave optimizer out.")
        if self.getOrDefault("loss") is not None or self.getOrDefault("loss_constructors"):
            raise FitFailed("loss cannot be given with a LightningModule: its training_step computes the loss "
                            "(horovod.spark's rule). Leave loss and loss_constructors out.")
        if self.getOrDefault("loss_weights"):
            raise FitFailed("loss_weights cannot be given with a LightningModule: its training_step weighs its "
                            "losses (horovod.spark's rule). Leave loss_weights out.")

    def _spec(self):
        spec = super()._spec()
        get = self.getOrDefault
        arguments = {}
        if get("store") is not None:  # the logger writes there (horovod.spark's place for logs)
            arguments["default_root_dir"] = spec.logs_dir
        for name in ("profiler", "logger", "log_every_n_steps"):
            if get(name) is not None:
                arguments[name] = get(name)
        spec.trainer_args = {**arguments, **(spec.trainer_args or {})}  # trainer_args over the estimator's own
        unused = [name for name in ("metrics", "gradient_compression", "train_minibatch_fn") if get(name)]
        if unused:
            spec.notes.append(f"hvdmagic: {', '.join(unused)} change nothing with a LightningModule, whose "
                              "training_step and validation_step compute and log what it trains on")
        return spec

    def _model_from(self, result: FitResult, df, spec, num_proc: int, seconds: float) -> TorchModel:
        model = copy.deepcopy(spec.model)
        model.load_state_dict(result.weights)
        model.eval()
        return self._fitted(TorchModel, result, df, spec, num_proc, seconds, model=model)


@add_accessors
class TorchModel(_PlainTorchModel):
    """A fitted Lightning ``TorchEstimator``: ``transform`` adds ``<label>__output`` columns (``setOutputCols``
    renames them), each a forward pass of the module; ``getModel()`` is the trained ``LightningModule``,
    ``getHistory()`` what it logged, per epoch. Saved and loaded as ``hvdmagic.spark.torch``'s ``TorchModel``."""

    framework = "lightning"
