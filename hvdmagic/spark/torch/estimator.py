"""``TorchEstimator``: trains a ``torch.nn.Module`` on a DataFrame; ``TorchModel`` predicts with it.

The training loop each rank runs is ``hvdmagic.rank.estimator_torch``; everything else is the shared
estimator's (``hvdmagic.spark.common.estimator``).
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

from hvdmagic.rank.estimator_data import FitResult
from hvdmagic.spark.common.estimator import FitFailed, HorovodEstimator, HorovodModel
from hvdmagic.spark.common.params import add_accessors, keyword_signature
from hvdmagic.spark.common.persistence import Persistent


@keyword_signature
@add_accessors
class TorchEstimator(HorovodEstimator, Persistent):
    """Spark ML estimator for a PyTorch model, with horovod.spark.torch.TorchEstimator's params.

    Example::

        from hvdmagic.spark.common.store import Store
        from hvdmagic.spark.torch import TorchEstimator

        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        estimator = TorchEstimator(num_proc=2, store=Store.create("/tmp/runs"), model=model,
                                   optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
                                   loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["y"],
                                   batch_size=32, epochs=5, validation=0.1)
        fitted = estimator.fit(train_df)            # the dashboard shows the ranks while it trains
        predictions = fitted.transform(test_df)     # column y__output
    """

    framework = "torch"

    def _fit_function(self):
        from hvdmagic.rank.estimator_torch import fit

        return fit

    def _check_model(self) -> None:
        import torch

        model = self.getOrDefault("model") if self.isDefined("model") else None
        if not isinstance(model, torch.nn.Module):
            raise FitFailed(f"TorchEstimator's model must be a torch.nn.Module, not {type(model).__name__}.")
        if not isinstance(self.getOrDefault("optimizer"), torch.optim.Optimizer):
            raise FitFailed("TorchEstimator needs an optimizer over the model's parameters "
                            "(optimizer=torch.optim.SGD(model.parameters(), lr=0.01)).")
        owned = {id(p) for p in model.parameters()}
        for group in self.getOrDefault("optimizer").param_groups:
            if any(id(p) not in owned for p in group["params"]):
                raise FitFailed("the optimizer holds parameters that are not the model's: build it from this "
                                "model (torch.optim.SGD(model.parameters(), ...)).")
        if self.getOrDefault("loss") is None and not self.getOrDefault("loss_constructors"):
            raise FitFailed("TorchEstimator needs a loss (loss=torch.nn.MSELoss(), or one per label column).")

    def _model_from(self, result: FitResult, df, spec, num_proc: int, seconds: float) -> TorchModel:
        model, optimizer = copy.deepcopy((spec.model, spec.optimizer))
        model.load_state_dict(result.weights)
        optimizer.load_state_dict(result.optimizer_state)
        return self._fitted(TorchModel, result, df, spec, num_proc, seconds, model=model, optimizer=optimizer)


@add_accessors
class TorchModel(HorovodModel, Persistent):
    """A fitted TorchEstimator: ``transform`` adds ``<label>__output`` columns (``setOutputCols`` renames
    them); ``getModel()`` is the trained ``torch.nn.Module``, ``getHistory()`` its per-epoch metrics."""

    framework = "torch"
    saved_by_framework = ("model", "optimizer")

    def _extra_metadata(self) -> dict:
        return {"history": self.history, "output_sizes": self.output_sizes, "fit_info": self.fit_info,
                "label_types": [t.json() for t in self.label_types]}

    def _save_weights(self, root: Path) -> None:
        import cloudpickle
        import torch

        model, optimizer = self.getOrDefault("model"), self.getOrDefault("optimizer")
        torch.save(model.state_dict(), root / "model.pt")
        # The architecture without its weights (on torch's meta device): the weights are model.pt's. The
        # copy takes each tensor's meta twin from the memo, so the weights are never copied in memory.
        shell = copy.deepcopy(model, memo={id(tensor): _meta_twin(tensor) for tensor in
                                           itertools.chain(model.parameters(), model.buffers())})
        (root / "architecture.pkl").write_bytes(cloudpickle.dumps(shell))
        if optimizer is not None:
            torch.save({"class": cloudpickle.dumps(type(optimizer)), "state": optimizer.state_dict()},
                       root / "optimizer.pt")

    @classmethod
    def _from_saved(cls, root: Path, extra: dict) -> TorchModel:
        import cloudpickle
        import torch
        from pyspark.sql.types import _parse_datatype_json_string

        # assign: the loaded tensors become the model's own, not copied into weights allocated first.
        model = cloudpickle.loads((root / "architecture.pkl").read_bytes())
        model.load_state_dict(torch.load(root / "model.pt", map_location="cpu"), assign=True)
        fitted = cls(history=extra.get("history"), output_sizes=extra.get("output_sizes"),
                     fit_info=extra.get("fit_info"),
                     label_types=[_parse_datatype_json_string(t) for t in extra.get("label_types", [])])
        fitted._set(model=model)
        if (root / "optimizer.pt").exists():
            saved = torch.load(root / "optimizer.pt", map_location="cpu", weights_only=False)
            optimizer = cloudpickle.loads(saved["class"])(model.parameters(), lr=1.0)
            optimizer.load_state_dict(saved["state"])
            fitted._set(optimizer=optimizer)
        return fitted


def _meta_twin(tensor):
    """``tensor``'s shape and type on torch's meta device, a Parameter if it is one: no storage at all."""
    import torch

    twin = torch.empty_like(tensor, device="meta")
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(twin, requires_grad=tensor.requires_grad)
    return twin
