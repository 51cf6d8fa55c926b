"""Today's trainers run unchanged in a ``%%torchrun`` cell, and their own bars and logged values
reach the dashboard with no hvdmagic callback in the cell (``hvdmagic/rank/trainers.py``)."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
from conftest import run
from test_framework_bars import TQDM_TEXT, run_as_rank

import hvdmagic
from hvdmagic.kernel.ui.progress_text import pick_bars

LIGHTNING_CELL = """%%torchrun --np -2
import torch
import lightning.pytorch as pl

class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

torch.manual_seed(0)
x = torch.rand(256, 4)
data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
loader = torch.utils.data.DataLoader(data, batch_size=16)
# devices and num_nodes left out: the cell's layout is given; no logger, the checkpoint callback on.
trainer = pl.Trainer(strategy="ddp", accelerator="cpu", max_epochs=3, log_every_n_steps=2, logger=False,
                     enable_model_summary=False, default_root_dir="lightning-root")
trainer.fit(Regression(), loader, loader)
import os
(trainer.num_devices, trainer.log_dir, sorted(os.listdir("lightning-root")))
"""


def test_lightning_ddp_drives_the_rows_and_its_self_log_values_are_metrics_with_no_callback(ip, tmp_path):
    ip.run_line_magic("cd", str(tmp_path))
    result, error = run(ip, LIGHTNING_CELL)
    assert error is None, error
    # The dashboard's logger moved no folder: as with no logger at all.
    assert result == (2, "lightning-root", ["checkpoints"]), result
    record = hvdmagic.last_run()
    steps = 256 // 2 // 16 * 3  # a DistributedSampler's half of the rows, 16 a batch, 3 epochs
    for rank in record.ranks:
        bars = {desc: (bar.step, bar.total) for desc, bar in rank.bars.items()}
        assert bars == {"fit": (steps, steps)}, f"rank {rank.rank}: {bars}"
        logs = record.logs[rank.rank]
        assert "━" not in logs and not TQDM_TEXT.search(logs), f"Lightning's bar in rank {rank.rank}'s log:\n{logs}"
    rows = record.metrics[record.metrics["rank"] == 0]
    train_loss, val_loss = rows["train_loss"].dropna(), rows["val_loss"].dropna()
    assert len(train_loss) == steps // 2, f"every second step's self.log('train_loss'): {list(train_loss)}"
    assert len(val_loss) == 3, f"one val_loss an epoch: {list(val_loss)}"
    assert train_loss.iloc[-1] < train_loss.iloc[0] / 4, f"the loss should fall: {list(train_loss)}"


HF_CELL = """%%torchrun --np -2
import tempfile
import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

torch.manual_seed(0)
config = GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)  # built from a config: nothing downloaded
# Sequences that count up modulo the vocabulary: learnable, so the losses fall.
ids = ((torch.randint(0, 32, (256, 1)) + torch.arange(16)) % 32).tolist()
train = Dataset.from_dict({"input_ids": ids, "labels": ids})

class Held(torch.utils.data.Dataset):  # a plain torch Dataset for the evaluation
    def __len__(self):
        return 32

    def __getitem__(self, i):
        return {"input_ids": torch.tensor(ids[i]), "labels": torch.tensor(ids[i])}

args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=16, num_train_epochs=2,
                         learning_rate=5e-3, logging_steps=2, eval_strategy="steps", eval_steps=4,
                         save_strategy="no", report_to=[], seed=0)
trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=Held())
trainer.train().training_loss
"""


@pytest.mark.profile
def test_hugging_face_trainer_drives_the_rows_and_its_logs_are_metrics_with_no_callback(ip):
    pytest.importorskip("transformers", reason="the README's set-up installs transformers")
    result, error = run(ip, HF_CELL)
    assert error is None, error
    record = hvdmagic.last_run()
    steps = 256 // 2 // 16 * 2
    for rank in record.ranks:
        bars = {desc: (bar.step, bar.total) for desc, bar in rank.bars.items()}
        # 32 evaluation rows, 8 a batch, half on each rank: 2 batches a rank an evaluation.
        assert bars == {"epoch": (2, 2), "step": (steps, steps), "evaluate": (2, 2)}, f"rank {rank.rank}: {bars}"
        # While it trains (epoch 1 of 2, before any evaluation), the row's bar is the step and its
        # counter the epoch: "epoch 1/2 ... step 5/16".
        training = {desc: dataclasses.replace(bar, step=1) if desc == "epoch" else bar
                    for desc, bar in rank.bars.items() if desc != "evaluate"}  # in the row's own order
        outer, inner = pick_bars(training)
        assert outer and (outer[0], inner[0]) == ("epoch", "step"), training
        logs = record.logs[rank.rank]
        assert "{'loss'" not in logs and not TQDM_TEXT.search(logs), f"the Trainer's text:\n{logs}"
    rows = record.metrics[record.metrics["rank"] == 0]
    loss, eval_loss = rows["loss"].dropna(), rows["eval_loss"].dropna()
    assert len(loss) == steps // 2 and len(eval_loss) == steps // 4, rows.to_string()
    assert rows["learning_rate"].notna().sum() == len(loss) and rows["grad_norm"].notna().sum() == len(loss)
    assert list(rows.dropna(subset=["loss"])["step"]) == list(range(2, steps + 1, 2)), "the Trainer's global steps"
    assert eval_loss.iloc[-1] < eval_loss.iloc[0], f"the evaluation loss should fall: {list(eval_loss)}"
    assert isinstance(result, float) and result == pytest.approx(rows["train_loss"].dropna().iloc[-1])


def test_a_trainer_told_to_run_alone_in_a_cell_of_two_ranks_is_not_shown_as_healthy(ip):
    """The cell's environment says ACCELERATE_USE_CPU=false: hvdmagic keeps it, so each rank's Trainer
    runs NOT_PARALLEL, and a note says that each rank trains its own copy on all the data."""
    pytest.importorskip("transformers", reason="the README's set-up installs transformers")
    cell = HF_CELL.replace("import tempfile\n", "import os, tempfile\nos.environ['ACCELERATE_USE_CPU'] = 'false'\n")
    cell = cell.replace("num_train_epochs=2,", "max_steps=2,").replace('eval_strategy="steps"', 'eval_strategy="no"')
    _, error = run(ip, cell)
    assert error is None, error
    notes = [note for note in hvdmagic.last_run().notes if "runs alone" in note]
    assert len(notes) == 1 and "the Trainer of ranks 0, 1 runs alone" in notes[0], hvdmagic.last_run().notes
    assert "world size 1) in a cell of 2 ranks: each rank trains its own copy" in notes[0], \
        hvdmagic.last_run().notes


LIGHTNING_TRAINERS = """
import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from hvdmagic.callbacks.lightning import HvdmagicCallback

class MyBar(TQDMProgressBar):
    pass

def kinds(trainer):
    return sorted(type(callback).__name__ for callback in trainer.callbacks
                  if isinstance(callback, (HvdmagicCallback, pl.callbacks.ProgressBar)))

print(kinds(pl.Trainer(logger=False)))
print(kinds(pl.Trainer(logger=False, callbacks=[HvdmagicCallback(progress=False)])))
print(kinds(pl.Trainer(logger=False, callbacks=[MyBar()])))
print(kinds(pl.Trainer(logger=False, enable_progress_bar=False)))
"""


def test_a_lightning_trainer_in_a_rank_gets_one_dashboard_callback_and_keeps_a_bar_of_its_own():
    out, _, _ = run_as_rank(LIGHTNING_TRAINERS, timeout=120)
    assert out.splitlines() == ["['HvdmagicCallback']",  # Lightning's own bar (Rich's here) taken out
                                "['HvdmagicCallback']",  # the cell's callback: not a second one
                                "['HvdmagicCallback', 'MyBar']",
                                "['HvdmagicCallback']"], out


ACCELERATE_CELL = """%%torchrun --np -2
import torch
from accelerate import Accelerator, notebook_launcher

def training_function():
    accelerator = Accelerator()
    torch.manual_seed(0)
    x = torch.rand(128, 4)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(4):
        for step, (inputs, targets) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses = accelerator.gather(loss.detach().reshape(1))
        accelerator.log({"loss": losses.mean().item(), "step": epoch}, step=epoch)  # "step": a common habit
        accelerator.print(f"epoch {epoch}: {len(losses)} losses gathered")
    return accelerator.num_processes

# Pasted from a notebook that used accelerate's own launcher: the cell's ranks are its processes.
notebook_launcher(training_function, num_processes=1, num_nodes=2)
"""


@pytest.mark.profile
def test_an_accelerate_loop_through_notebook_launcher_runs_in_the_ranks_and_logs_metrics(ip):
    pytest.importorskip("accelerate", reason="the README's set-up installs accelerate")
    result, error = run(ip, ACCELERATE_CELL)
    assert error is None, error
    assert result == 2, "every rank is one of accelerate's processes"
    record = hvdmagic.last_run()
    assert record.logs[0].count("losses gathered") == 4 and "2 losses gathered" in record.logs[0], record.logs[0]
    assert "losses gathered" not in record.logs[1], "accelerator.print prints on the main process only"
    assert any("notebook_launcher ran training_function in each of the cell's 2 rank(s)" in note
               for note in record.notes), record.notes
    for rank in (0, 1):
        loss = record.metrics[record.metrics["rank"] == rank].dropna(subset=["loss"])
        assert list(loss["step"]) == [0, 1, 2, 3], loss.to_string()
        assert loss["loss"].iloc[-1] < loss["loss"].iloc[0], f"the loss should fall: {list(loss['loss'])}"


@pytest.mark.profile
def test_notebook_launcher_asking_for_other_processes_than_the_cells_fails_in_one_paragraph(ip):
    pytest.importorskip("accelerate", reason="the README's set-up installs accelerate")
    _, error = run(ip, "%%torchrun --np -2\nfrom accelerate import notebook_launcher\n"
                       "notebook_launcher(print, num_processes=4)")
    assert error is not None
    assert "num_processes=4, num_nodes=1) in a cell of 2 rank(s)" in str(error) and "--np 4" in str(error), str(error)


FSDP2_TRAIN = """%%torchrun --np -2
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
torch.manual_seed(1 + dist.get_rank())  # each rank its own batches
for step in range(60):
    x = torch.rand(32, 8)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
dcp.save({"model": model.state_dict()}, checkpoint_id=checkpoint)  # each rank writes its shards
shard = model[0].weight.to_local()
(type(model[0].weight).__name__, tuple(shard.shape), loss.item())
"""

FSDP2_LOAD = """%%torchrun --np -2
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
torch.manual_seed(5)  # other initial weights: only the checkpoint can make them right
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
state = {"model": model.state_dict()}
dcp.load(state, checkpoint_id=checkpoint)
model.load_state_dict(state["model"])
torch.manual_seed(99)
x = torch.rand(256, 8)
torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).item()
"""


def test_fsdp2_trains_sharded_and_a_later_cell_loads_its_distributed_checkpoint(ip, tmp_path):
    ip.user_ns["checkpoint"] = str(tmp_path / "fsdp2-checkpoint")
    trained, error = run(ip, FSDP2_TRAIN)
    assert error is None, error
    kind, shard, last_loss = trained
    assert kind == "DTensor" and shard == (16, 8), f"each rank holds half of the first layer: {kind} {shard}"
    assert last_loss < 0.5, f"the sharded model should learn the sum: {last_loss}"
    assert len(list((tmp_path / "fsdp2-checkpoint").glob("*.distcp"))) == 2, "a shard file per rank"
    loaded, error = run(ip, FSDP2_LOAD)
    assert error is None, error
    assert loaded < 0.5, f"the loaded weights should predict as the trained ones did, not from scratch: {loaded}"


@pytest.mark.profile
def test_notebook_launcher_in_a_horovod_cell_says_to_use_torchrun(ip):
    pytest.importorskip("accelerate", reason="the README's set-up installs accelerate")
    _, error = run(ip, "%%horovod --np -2\nfrom accelerate import notebook_launcher\nnotebook_launcher(print)")
    assert error is not None and "run the cell with %%torchrun --np N" in str(error), str(error)


MISTAKES_CELL = """%%torchrun --np -2
import torch.multiprocessing as mp
import lightning.pytorch as pl

said = []
for attempt in (lambda: pl.Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2),
                lambda: pl.Trainer(strategy="ddp_notebook", accelerator="cpu", devices=2),
                lambda: pl.Trainer(strategy="ddp", accelerator="cpu", devices=4),
                lambda: pl.Trainer(strategy="ddp", accelerator="cpu", devices=1, num_nodes=2),
                lambda: mp.spawn(print, nprocs=2),
                # what `!deepspeed ...` and `!python -m torch.distributed.run ...` lines in the cell run
                lambda: get_ipython().system("deepspeed --num_gpus 2 train.py --deepspeed ds_config.json"),
                lambda: get_ipython().system("python3 -m torch.distributed.run --nproc-per-node 2 train.py"),
                # arguments from a GPU machine's notebook
                lambda: __import__("transformers").TrainingArguments(output_dir="hf-out", bf16=True)):
    try:
        attempt()
        said.append(None)
    except (RuntimeError, ValueError) as error:
        said.append(str(error))
fine = [(trainer.num_devices, trainer.num_nodes, trainer.world_size)
        for trainer in (pl.Trainer(strategy="ddp", accelerator="cpu"), pl.Trainer(accelerator="cpu", devices=2))]
# torch's own helpers still spawn: what elastic's and the async checkpoint writer's calls look like.
exec("import torch.multiprocessing as mp\\nhelper = mp.start_processes(print, ('from torch',), nprocs=1, "
     "start_method='fork')", {"__name__": "torch.distributed.elastic.multiprocessing.api"})
said, fine, get_ipython().getoutput("echo deepspeed is a word, not a launcher, here")
"""


def test_other_launchers_habits_fail_in_one_paragraph_in_a_rank(ip):
    result, error = run(ip, MISTAKES_CELL)
    assert error is None, error
    said, fine, echoed = result
    spawn, notebook, devices, one_a_node, mp_spawn, deepspeed_line, torch_run_line, gpu_arguments = said
    assert spawn and "'spawn'" in spawn and 'use strategy="ddp"' in spawn, spawn
    assert notebook and "'fork'" in notebook, notebook
    assert devices and "Trainer(devices=4, num_nodes=1) lays out 4 processes" in devices, devices
    assert "--np 4" in devices and "devices=2, num_nodes=1" in devices, devices
    # pyspark's one-process-a-node idiom, on one host: Lightning would index a device rank 1 does not have.
    assert one_a_node and "Trainer(devices=1, num_nodes=2) lays out 2 processes, 1 a node" in one_a_node, one_a_node
    assert mp_spawn and "torch.multiprocessing.spawn(print, nprocs=2)" in mp_spawn and "--np 2" in mp_spawn, mp_spawn
    assert deepspeed_line and deepspeed_line.startswith("!deepspeed --num_gpus 2") and \
        'TorchDistributor(num_processes=2).run("train.py", ...)' in deepspeed_line, deepspeed_line
    assert torch_run_line and "would start torch.distributed.run" in torch_run_line, torch_run_line
    assert echoed == ["deepspeed is a word, not a launcher, here"], echoed
    assert gpu_arguments and "bf16/gpu" in gpu_arguments and "Rank 0 of this cell has no GPU" in gpu_arguments, \
        gpu_arguments
    assert "use_cpu=True" in gpu_arguments and "spark.task.resource.gpu.amount" in gpu_arguments, gpu_arguments
    assert all("\n" not in text for text in said), "each is one paragraph"
    assert fine == [(2, 1, 2), (2, 1, 2)], "the defaults and devices=2 lay out the cell's 2 ranks on its one host"
    logs = hvdmagic.last_run().logs
    assert all("0 from torch" in logs[rank] for rank in (0, 1)), f"torch's own start_processes should run: {logs}"


DEEPSPEED_CELL = """%%torchrun --np -2
import torch, deepspeed

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "steps_per_print": 20,
          "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                       config=config)
torch.manual_seed(engine.global_rank)  # each rank its own rows
x = torch.randn(640, 8)
y = x.sum(dim=1, keepdim=True)
losses = []
for step in range(40):
    rows = slice(step * 16, step * 16 + 16)
    loss = torch.nn.functional.mse_loss(engine(x[rows]), y[rows])
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
weights = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
everyone = [torch.zeros_like(weights) for _ in range(engine.world_size)]
torch.distributed.all_gather(everyone, weights)
(engine.zero_optimization_stage(), engine.world_size, losses[0], losses[-1],
 all(torch.equal(everyone[0], w) for w in everyone))
"""


@pytest.mark.timeout(600)  # each rank imports DeepSpeed (20 s under load), and compiles its op if the set-up did not
def test_deepspeed_zero_2_trains_on_two_cpu_ranks_with_gloo_as_written(ip):
    pytest.importorskip("deepspeed", reason="the README's set-up installs DeepSpeed")
    result, error = run(ip, DEEPSPEED_CELL)
    assert error is None, error
    stage, world, first, last, agree = result
    assert (stage, world) == (2, 2), result
    assert last < first / 4, f"the loss should fall: {first} -> {last}"
    assert agree, "ZeRO 2 averages the gradients: every rank must hold the same weights"


def _hugging_face_function_cell() -> str:
    """HF_CELL's body as a notebook function, run through the TorchDistributor drop-in."""
    body = HF_CELL.split("\n", 1)[1].strip()
    body = body.replace("trainer.train().training_loss", "return trainer.train().training_loss")
    return ("def hf_train():\n" + textwrap.indent(body, "    ") + "\n\n"
            "from hvdmagic import TorchDistributor\n"
            "TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(hf_train)\n")


def test_hugging_face_trainer_on_spark_in_a_cell_and_through_the_torch_distributor_drop_in(ip, spark_kind):
    pytest.importorskip("transformers", reason="the README's set-up installs transformers")
    for cell in (HF_CELL.replace("%%torchrun --np -2", "%%torchrun --np 2"), _hugging_face_function_cell()):
        result, error = run(ip, cell)
        assert error is None, error
        record = hvdmagic.last_run()
        assert isinstance(result, float) and result < 3.0, f"rank 0's training loss: {result!r}"
        for rank in record.ranks:
            assert rank.bars["step"].step == rank.bars["step"].total == 16, f"rank {rank.rank}: {rank.bars}"
        assert record.metrics[record.metrics["rank"] == 0]["eval_loss"].notna().sum() == 4, record.metrics.to_string()


def test_a_torchrun_session_on_spark_runs_lightning_then_an_accelerate_loop_on_the_same_warm_ranks(ip, tmp_path):
    """The cells above, unchanged but for their first line, on a %torchrun session's two ranks on Spark:
    Lightning finds the session's process group, and accelerate's loop after it finds the same one."""
    pytest.importorskip("accelerate", reason="the README's set-up installs accelerate")
    ip.run_line_magic("torchrun", "start --np 2")
    try:
        cell = LIGHTNING_CELL.replace("%%torchrun --np -2", "%%torchrun")
        result, error = run(ip, cell.replace('"lightning-root"', repr(str(tmp_path / "lightning-root"))))
        assert error is None, error
        record = hvdmagic.last_run()
        assert record.mode == "spark" and result[0] == 2, (record.mode, result)
        steps = 256 // 2 // 16 * 3
        assert [rank.bars["fit"].step for rank in record.ranks] == [steps, steps], [r.bars for r in record.ranks]
        train_loss = record.metrics[record.metrics["rank"] == 0]["train_loss"].dropna()
        assert train_loss.iloc[-1] < train_loss.iloc[0] / 4, f"the loss should fall: {list(train_loss)}"

        result, error = run(ip, ACCELERATE_CELL.replace("%%torchrun --np -2", "%%torchrun"))
        assert error is None and result == 2, (result, error)
        record = hvdmagic.last_run()
        loss = record.metrics[record.metrics["rank"] == 0].dropna(subset=["loss"])
        assert list(loss["step"]) == [0, 1, 2, 3] and loss["loss"].iloc[-1] < loss["loss"].iloc[0], loss.to_string()
    finally:
        ip.run_line_magic("torchrun", "stop")
