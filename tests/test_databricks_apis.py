"""The distributed APIs Databricks notebooks use today, run here unchanged but for their import (issue 62):
serverless GPU's ``@distributed`` and pyspark's ``DeepspeedTorchDistributor``.

The examples follow the structure of Databricks' published ones (an MLP with DDP, FSDP, DeepSpeed), in
these tests' own words, on the CPU: ``gloo`` where they write ``nccl``, ``useGpu=False`` where pyspark's
docstring writes ``useGpu=True``. Each runs on local processes and on the embedded Spark.
"""

from __future__ import annotations

import json
import sys

import pytest

import hvdmagic
from hvdmagic import DeepspeedTorchDistributor, distributed
from hvdmagic.errors import LaunchError


# -- the MLP with DDP ---------------------------------------------------------------------------------------
def ddp_mlp(epochs: int, lr: float) -> dict:
    """Databricks' DDP example's shape: torchrun's variables, a DistributedSampler, DDP, a result per GPU."""
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    environment = {name: os.environ[name] for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                       "MASTER_PORT")}
    dist.init_process_group("gloo")  # "nccl" on Databricks' GPUs
    torch.manual_seed(0)
    x = torch.randn(1024, 16)
    y = x @ torch.linspace(-1, 1, 16).unsqueeze(1)
    data = DataLoader(TensorDataset(x, y), batch_size=32, sampler=DistributedSampler(TensorDataset(x, y)))
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                                        torch.nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for epoch in range(epochs):
        data.sampler.set_epoch(epoch)
        for features, target in data:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(features), target)
            loss.backward()
            optimizer.step()
        losses.append(loss.item())
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.zeros_like(weights) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, weights)
    dist.destroy_process_group()
    return {"environment": environment, "first": losses[0], "last": losses[-1],
            "same_weights": all(torch.equal(everyone[0], w) for w in everyone)}


@pytest.mark.parametrize("remote", [False, True], ids=["local", "spark"])
def test_the_ddp_example_runs_with_only_its_import_changed(remote, capsys, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a folder store otherwise
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    train = distributed(gpus=2, gpu_type="A10", remote=remote)(ddp_mlp)
    results = train.distributed(epochs=3, lr=0.05)
    assert len(results) == 2, results
    for rank, result in enumerate(results):  # every GPU's value, in rank order
        environment = result["environment"]
        assert (environment["RANK"], environment["LOCAL_RANK"], environment["WORLD_SIZE"]) == (str(rank), str(rank),
                                                                                               "2"), environment
        assert environment["MASTER_ADDR"] and environment["MASTER_PORT"].isdigit(), environment
        assert result["same_weights"], "DDP averages the gradients: every rank must hold the same weights"
        assert result["last"] < result["first"] / 2, f"rank {rank}'s loss should fall: {result}"
    assert hvdmagic.last_run().mode == ("spark" if remote else "local")
    assert "the 2 processes run on the CPU" in capsys.readouterr().out
    logged = mlflow.search_runs(search_all_experiments=True, filter_string="tags.mlflow.runName = 'ddp_mlp'",
                                output_format="list")
    assert len(logged) == 1 and logged[0].info.status == "FINISHED", logged


# -- FSDP ---------------------------------------------------------------------------------------------------
def fsdp_train(steps: int) -> tuple:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(steps):
        x = torch.rand(32, 8)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    shard = tuple(model[0].weight.to_local().shape)
    dist.destroy_process_group()
    return type(model[0].weight).__name__, shard, loss.item()


@pytest.mark.parametrize("remote", [False, True], ids=["local", "spark"])
def test_the_fsdp_example_runs_sharded(remote):
    results = distributed(num_accelerators=2, remote=remote)(fsdp_train).distributed(60)
    assert hvdmagic.last_run().mode == ("spark" if remote else "local")
    assert [(kind, shard) for kind, shard, _ in results] == [("DTensor", (16, 8))] * 2, "each rank holds half"
    assert all(loss < 0.5 for *_, loss in results), results


# -- DeepSpeed ------------------------------------------------------------------------------------------------
DEEPSPEED_CONFIG = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "steps_per_print": 100,
                    "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}


def deepspeed_train(learning_rate: float, config: dict | None = None) -> tuple:
    """pyspark's docstring example's shape (``import deepspeed``, train, return), ZeRO stage 2 by default;
    tests/test_gpu.py runs it in bf16 on the GPU."""
    import deepspeed
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, config=config or DEEPSPEED_CONFIG,
                                           optimizer=torch.optim.AdamW(model.parameters(), lr=learning_rate))
    torch.manual_seed(engine.global_rank)
    x = torch.randn(640, 8).to(engine.device, next(engine.module.parameters()).dtype)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for step in range(40):
        rows = slice(step * 16, step * 16 + 16)
        loss = torch.nn.functional.mse_loss(engine(x[rows]), y[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine.zero_optimization_stage(), engine.world_size, losses[0], losses[-1], str(engine.device)


DEEPSPEED_SCRIPT = """
import argparse, json, os
import deepspeed, torch

parser = argparse.ArgumentParser()
parser.add_argument("--out")
parser = deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config
args = parser.parse_args()
model = torch.nn.Linear(4, 1)
engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                       optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
loss = engine(torch.ones(8, 4)).sum()
engine.backward(loss)
engine.step()
with open(os.path.join(args.out, f"rank{engine.global_rank}.json"), "w") as file:
    json.dump({"deepspeed": args.deepspeed, "micro_batch": engine.train_micro_batch_size_per_gpu(),
               "stage": engine.zero_optimization_stage(), "world": engine.world_size}, file)
"""


@pytest.mark.timeout(600)  # each rank imports DeepSpeed (20 s under load), three runs
def test_deepspeed_through_distributed_and_the_deepspeed_distributor_on_local_processes_and_spark(tmp_path):
    pytest.importorskip("deepspeed", reason="the README's set-up installs DeepSpeed")
    results = distributed(gpus=2)(deepspeed_train).distributed(1e-2)
    assert [result[:2] for result in results] == [(2, 2), (2, 2)], results
    assert all(last < first / 4 for _, _, first, last, _ in results), results

    # pyspark's docstring example, on Spark's executors (numGpus × nnodes processes).
    distributor = DeepspeedTorchDistributor(numGpus=2, nnodes=1, localMode=False, useGpu=False,
                                            deepspeedConfig=DEEPSPEED_CONFIG)
    stage, world, first, last, _ = distributor.run(deepspeed_train, 1e-2)
    assert (stage, world) == (2, 2) and last < first / 4 and hvdmagic.last_run().mode == "spark"

    # A script gets --deepspeed and --deepspeed_config, a dict config written to a file on the rank's host.
    script, out = tmp_path / "train.py", tmp_path / "out"
    script.write_text(DEEPSPEED_SCRIPT)
    out.mkdir()
    config = {**DEEPSPEED_CONFIG, "train_micro_batch_size_per_gpu": 4}
    assert DeepspeedTorchDistributor(numGpus=2, useGpu=False, deepspeedConfig=config).run(
        str(script), "--out", str(out)) is None
    said = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert said == [{"deepspeed": True, "micro_batch": 4, "stage": 2, "world": 2}] * 2, said


# -- mistakes, and the unchanged imports ------------------------------------------------------------------------
def nccl_only():
    import torch.distributed as dist

    dist.init_process_group("nccl")


def nccl_or_gloo():
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


@pytest.mark.unit
def test_nccl_without_gpus_is_one_paragraph_before_any_rank_starts(monkeypatch):
    from hvdmagic.kernel import serverless_gpu

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(serverless_gpu, "execute", lambda *args, **kwargs: pytest.fail("a rank was started"))
    with pytest.raises(LaunchError) as raised:
        distributed(gpus=2)(nccl_only).distributed()
    message = str(raised.value)
    assert message.startswith('nccl_only asks for NCCL (init_process_group("nccl")), which needs a GPU in every '
                              "process, and this machine has none: write \"gloo\""), message
    assert serverless_gpu._asks_for_nccl(nccl_only) and not serverless_gpu._asks_for_nccl(nccl_or_gloo)


@pytest.mark.unit
def test_the_decorators_arguments_are_checked():
    with pytest.raises(TypeError, match=r"gpus= .* or num_accelerators="):
        distributed()
    with pytest.raises(TypeError, match="one of the two"):
        distributed(gpus=2, num_accelerators=2)
    with pytest.raises(ValueError, match="positive number of GPUs, not 0"):
        distributed(gpus=0)
    assert distributed(gpus=2)(lambda x: x + 1)(1) == 2, "called as ever, the function runs in this process"
    with pytest.raises(ValueError, match="numGpus must be a positive integer"):
        DeepspeedTorchDistributor(numGpus=0)
    with pytest.raises(TypeError, match="deepspeedConfig must be a dict"):
        DeepspeedTorchDistributor(deepspeedConfig=3)
    with pytest.raises(ValueError, match="command-line arguments only"):
        DeepspeedTorchDistributor(useGpu=False).run("train.py", lr=0.1)


@pytest.mark.unit
def test_the_unchanged_imports_work_where_databricks_package_is_not_installed_and_never_shadow_it(
        tmp_path, monkeypatch):
    for name in ("serverless_gpu", "databricks.air"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert hvdmagic.install_serverless_gpu() == ["serverless_gpu", "databricks.air"]
    from databricks.air import distributed as newer
    from serverless_gpu import distributed as older

    assert older is distributed and newer is distributed
    assert hvdmagic.install_serverless_gpu() == [], "a second call provides nothing new"

    # Databricks' own package, installed: left alone.
    for name in ("serverless_gpu", "databricks.air"):
        monkeypatch.delitem(sys.modules, name)
    (tmp_path / "serverless_gpu").mkdir()
    (tmp_path / "serverless_gpu" / "__init__.py").write_text("def distributed(**kwargs):\n    return 'databricks'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert hvdmagic.install_serverless_gpu() == ["databricks.air"]
    import serverless_gpu

    assert serverless_gpu.distributed() == "databricks"
