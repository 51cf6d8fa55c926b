"""What only a GPU shows: NCCL under Horovod and torch.distributed, today's trainers in bf16 (the Hugging
Face Trainer, DeepSpeed ZeRO 2, FSDP2), pinning, CUDA touched in the kernel before a cell, NVML's figures
on a rank's row, torch's NCCL flight recorder, and Spark's own GPU scheduling.

The tier ``gpu`` runs where an NVIDIA GPU and a CUDA torch are (tests/conftest.py leaves it out
elsewhere and says so); scripts/gpu_check.sh builds horovod's NCCL operations first and runs it. The
cells run in an IPython shell with hvdmagic loaded, in local mode, except the last section's, which
run on a standalone Spark worker where Java and pyspark are beside the GPU. A machine with one GPU
runs one NCCL rank: NCCL refuses two ranks on one device (a test says what happens), so the hang is
made with a kernel that spins on the GPU, which the next collective waits behind.
docs/frameworks.md says where the tier last ran and what it gave.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import run

import hvdmagic
from hvdmagic.errors import JobFailed, JobTimeout, LaunchError

pytestmark = pytest.mark.gpu

GIB = 1 << 30


# -- Horovod and torch.distributed on the GPU, from IPython cells ------------------------------------------
def test_horovod_collectives_of_cuda_tensors_run_through_nccl(ip, tmp_path, monkeypatch):
    timeline = tmp_path / "timeline.json"
    monkeypatch.setenv("HOROVOD_TIMELINE", str(timeline))  # the ranks inherit the kernel's environment
    result, error = run(ip, """%%horovod --np -1
import torch, horovod.torch as hvd
hvd.init()
torch.cuda.set_device(hvd.local_rank())
x = torch.arange(4.0, device="cuda") + hvd.rank()
summed = hvd.allreduce(x, op=hvd.Sum, name="sum")
gathered = hvd.allgather(x.unsqueeze(0), name="gather")
sent = hvd.broadcast(torch.full((3,), 7.0, device="cuda"), root_rank=0, name="bcast")
torch.cuda.synchronize()
dict(nccl_built=bool(hvd.nccl_built()), devices={t.device.type for t in (summed, gathered, sent)},
     summed=summed.tolist(), gathered=gathered.shape[0], sent=sent.tolist(), size=hvd.size())
""")
    assert error is None, error
    assert result["nccl_built"], "horovod was built without NCCL: scripts/gpu_check.sh builds it with --gpu"
    assert result["devices"] == {"cuda"}, result
    assert result["summed"] == [float(i) * result["size"] + sum(range(result["size"])) for i in range(4)], result
    assert result["gathered"] == result["size"] and result["sent"] == [7.0] * 3, result
    activities = {event.get("name") for event in _timeline_events(timeline)}
    print("timeline activities:", sorted(name for name in activities if name))
    assert {"NCCL_ALLREDUCE", "NCCL_ALLGATHER", "NCCL_BCAST"} <= activities, \
        f"no NCCL activity in the timeline for each collective: a CPU path ran: {sorted(filter(None, activities))}"


def _timeline_events(path) -> list[dict]:
    """Horovod's timeline is a Chrome trace that a running job leaves without its closing bracket."""
    text = path.read_text().strip().rstrip(",")
    return json.loads(text if text.endswith("]") else text + "]")


CNN = """import torch, torch.nn as nn, torch.nn.functional as F

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 16, 3), nn.Conv2d(16, 32, 3)
        self.fc = nn.Linear(32 * 5 * 5, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))

def digits(seed, n=2048):
    # Ten fixed 28x28 patterns plus noise: a task a small CNN learns in a few dozen steps.
    g = torch.Generator().manual_seed(0)
    patterns = torch.randn(10, 1, 28, 28, generator=g)
    g.manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    return patterns[labels] + 0.5 * torch.randn(n, 1, 28, 28, generator=g), labels
"""

TRAIN_LOOP = """x, y = x.cuda(), y.cuda()
losses = []
for step in range(60):
    batch = slice((step * 64) % 2048, (step * 64) % 2048 + 64)
    opt.zero_grad()
    loss = F.cross_entropy(model(x[batch]), y[batch])
    loss.backward()
    opt.step()
    losses.append(loss.item())
"""


def test_a_cnn_trains_on_the_gpu_with_horovods_distributed_optimizer(ip):
    ip.run_cell(CNN)
    result, error = run(ip, """%%horovod --np -1
import horovod.torch as hvd
hvd.init()
torch.cuda.set_device(hvd.local_rank())
model = Net().cuda()
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x, y = digits(hvd.rank())
""" + TRAIN_LOOP + """
dict(first=losses[0], last=sum(losses[-5:]) / 5, device=str(next(model.parameters()).device))
""")
    assert error is None, error
    print("horovod CNN:", result)
    assert result["device"] == "cuda:0", result
    assert result["last"] < result["first"] / 4, f"the loss did not fall: {result}"


def test_torchrun_cell_trains_the_cnn_with_ddp_over_nccl(ip):
    ip.run_cell(CNN)
    result, error = run(ip, """%%torchrun --np -1
import os, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group("nccl")
model = DDP(Net().cuda(), device_ids=[local_rank])
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
x, y = digits(dist.get_rank())
""" + TRAIN_LOOP + """
t = torch.ones(2, device="cuda")
dist.all_reduce(t)
dict(backend=dist.get_backend(), first=losses[0], last=sum(losses[-5:]) / 5, reduced=t.tolist(),
     world=dist.get_world_size())
""")
    assert error is None, error
    print("DDP CNN:", result)
    assert result["backend"] == "nccl", result
    assert result["reduced"] == [float(result["world"])] * 2, result
    assert result["last"] < result["first"] / 4, f"the loss did not fall: {result}"


# -- Today's trainers on the GPU, unchanged in a %%torchrun cell (tests/test_trainers.py runs them on CPUs) ------
HF_BF16 = """%%torchrun --np -1
import tempfile, torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

torch.manual_seed(0)
config = GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)  # built from a config: nothing downloaded
ids = (torch.randint(0, 64, (512, 1)) + torch.arange(32)) % 64  # sequences that count up: learnable

class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return len(ids)

    def __getitem__(self, i):
        return {"input_ids": ids[i], "labels": ids[i]}

logits = set()  # the dtypes the head computed in: bf16 under the Trainer's autocast
model.lm_head.register_forward_hook(lambda module, args, out: logits.add(str(out.dtype)))
args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=32, num_train_epochs=4,
                         learning_rate=5e-3, logging_steps=4, bf16=True, save_strategy="no", report_to=[], seed=0)
trainer = Trainer(model=model, args=args, train_dataset=Rows())
trainer.train()
dict(device=str(next(model.parameters()).device), mixed=str(trainer.accelerator.mixed_precision),
     logits=sorted(logits), steps=trainer.state.global_step)
"""


def test_hugging_face_trainer_trains_in_bf16_on_the_gpu_and_its_logs_reach_the_dashboard(ip):
    pytest.importorskip("transformers", reason="the Hugging Face Trainer")
    result, error = run(ip, HF_BF16)
    assert error is None, error
    print("HF Trainer bf16:", result)
    assert result["device"] == "cuda:0" and result["mixed"] == "bf16", result
    assert result["logits"] == ["torch.bfloat16"], f"the head should compute in bf16 under autocast: {result}"
    steps = 512 // 32 * 4
    rank = hvdmagic.last_run().ranks[0]
    bars = {desc: (bar.step, bar.total) for desc, bar in rank.bars.items()}
    assert bars.get("step") == (steps, steps) and bars.get("epoch") == (4, 4), f"the Trainer's bars: {bars}"
    loss = hvdmagic.last_run().metrics["loss"].dropna()
    assert len(loss) == steps // 4, f"a loss every 4 steps: {list(loss)}"
    assert loss.iloc[-1] < loss.iloc[0] / 2, f"the loss should fall: {list(loss)}"


DEEPSPEED_ZERO2 = """%%torchrun --np -1
import torch, deepspeed

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
config = {"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
          "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True}
# torch's AdamW: DeepSpeed's own Adam would compile a CUDA op first, which is not what this checks.
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                       config=config)
x = torch.randn(1920, 8, device=engine.device)
y = x.sum(dim=1, keepdim=True)
losses = []
for step in range(60):
    rows = slice(step * 32, step * 32 + 32)
    loss = torch.nn.functional.mse_loss(engine(x[rows].bfloat16()).float(), y[rows])
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
dict(stage=engine.zero_optimization_stage(), world=engine.world_size, device=str(engine.device),
     dtype=str(next(engine.module.parameters()).dtype), optimizer=type(engine.optimizer).__name__,
     first=losses[0], last=sum(losses[-5:]) / 5)
"""


@pytest.mark.timeout(600)  # DeepSpeed's import and its first initialize take a while
def test_deepspeed_zero_2_trains_in_bf16_on_the_gpu_as_written(ip):
    pytest.importorskip("deepspeed", reason="scripts/gpu_check.sh installs DeepSpeed")
    result, error = run(ip, DEEPSPEED_ZERO2)
    assert error is None, error
    print("DeepSpeed ZeRO-2:", result)
    assert (result["stage"], result["world"], result["device"]) == (2, 1, "cuda:0"), result
    assert result["dtype"] == "torch.bfloat16", f"bf16 enabled: the module's weights are bf16: {result}"
    assert result["last"] < result["first"] / 4, f"the loss should fall: {result}"


FSDP2_NCCL = """%%torchrun --np -1
import os, torch, torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).cuda()
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in (model[0], model[2]):
    fully_shard(layer, mp_policy=policy)
fully_shard(model, mp_policy=policy)
outputs = set()
model.register_forward_hook(lambda module, args, out: outputs.add(str(out.dtype)))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
losses = []
for step in range(80):
    x = torch.rand(64, 8, device="cuda")
    loss = torch.nn.functional.mse_loss(model(x).float(), x.sum(dim=1, keepdim=True))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
weight = model[0].weight
dict(kind=type(weight).__name__, device=weight.to_local().device.type, stored=str(weight.dtype),
     backend=dist.get_backend(), outputs=sorted(outputs), first=losses[0], last=sum(losses[-5:]) / 5)
"""


def test_fsdp2_trains_with_nccl_and_bf16_compute_on_the_gpu(ip):
    result, error = run(ip, FSDP2_NCCL)
    assert error is None, error
    print("FSDP2:", result)
    assert (result["kind"], result["device"], result["backend"]) == ("DTensor", "cuda", "nccl"), result
    assert result["stored"] == "torch.float32" and result["outputs"] == ["torch.bfloat16"], \
        f"fp32 shards, bf16 compute (MixedPrecisionPolicy): {result}"
    assert result["last"] < result["first"] / 4, f"the loss should fall: {result}"


def _driver_gpu_indices() -> list[str]:
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    return [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU ")]


@pytest.mark.parametrize("magic", ["horovod", "torchrun"])
def test_one_rank_sees_only_its_gpu(ip, magic, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    result, error = run(ip, f"""%%{magic} --np -1
import os, torch
(os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("HVDMAGIC_CUDA_DEVICE"), torch.cuda.device_count(),
 torch.cuda.get_device_name(0))
""")
    assert error is None, error
    visible, index, count, name = result
    print(f"%%{magic} --np -1: CUDA_VISIBLE_DEVICES={visible} HVDMAGIC_CUDA_DEVICE={index} count={count} {name}")
    assert visible == _driver_gpu_indices()[0] and index == "0" and count == 1, result


def test_cuda_touched_in_the_kernel_before_a_cell_leaves_the_ranks_working(ip):
    """Fork-based launchers fail here ("Cannot re-initialize CUDA in forked subprocess"); hvdmagic's
    ranks are new interpreters, so the kernel's CUDA context is not theirs."""
    ip.run_cell("import torch\nkernel_side = torch.zeros(1).cuda()\nkernel_cuda = torch.cuda.is_initialized()")
    assert ip.user_ns["kernel_cuda"] is True
    result, error = run(ip, """%%horovod --np -1
import torch, horovod.torch as hvd
hvd.init()
torch.cuda.set_device(hvd.local_rank())
hvd.allreduce(torch.ones(2, device="cuda"), op=hvd.Sum).tolist()
""")
    assert error is None, error
    assert result == [1.0, 1.0], result


def test_a_cuda_tensor_of_the_kernel_reaches_the_rank_on_its_gpu(ip):
    ip.run_cell("import torch\nweights = torch.arange(6.0).cuda()")
    result, error = run(ip, """%%horovod --np -1
import torch
(str(weights.device), (weights * 2).sum().item())
""")
    assert error is None, error
    assert result == ("cuda:0", 30.0), result


def test_two_ranks_on_one_gpu_are_told_why_before_launch_then_fail_in_nccl_at_once(ip, monkeypatch):
    devices = _driver_gpu_indices()
    if len(devices) != 1:
        pytest.skip(f"this checks a machine with one GPU; this one has {len(devices)}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    result, error = run(ip, """%%horovod --np -2 --timeout 30
import torch, horovod.torch as hvd
hvd.init()
torch.cuda.set_device(0)
hvd.allreduce(torch.ones(2, device="cuda"), op=hvd.Sum).tolist()
""")
    note = hvdmagic.last_run().notes[0]
    print("note before launch:", note)
    print("outcome:", result if error is None else f"{type(error).__name__}: {error}")
    assert note.startswith("2 ranks on 1 GPU: NCCL needs one GPU per rank"), note
    # What NCCL 2.28 did on the H200 (docs/frameworks.md): both ranks fail at once, neither hangs.
    assert isinstance(error, JobFailed) and "ncclCommInitRank failed: invalid usage" in str(error), error


# -- NVML on a rank's row, and torch's flight recorder ---------------------------------------------------

def _busy_gpu(seconds: float) -> float:
    import time

    import torch

    x = torch.randn(8192, 8192, device="cuda")  # 256 MiB, held by this rank
    end = time.monotonic() + seconds
    flops = 0.0
    while time.monotonic() < end:
        for _ in range(20):
            x = torch.tanh(x @ x)
        torch.cuda.synchronize()
        flops += 20 * 2 * 8192 ** 3
    return flops


def test_a_rank_row_shows_the_gpu_it_was_given_and_uses():
    flops = hvdmagic.TorchDistributor(num_processes=1, local_mode=True, use_gpu=True).run(_busy_gpu, 5.0)
    assert flops > 0
    gpus = hvdmagic.last_run().ranks[0].gpus
    print("NVML sample of rank 0:", gpus)
    assert len(gpus) == 1, f"rank 0 was given one GPU; its last sample names {gpus}"
    gpu = gpus[0]
    assert gpu["total"] > 10 * GIB, gpu
    assert gpu["util"] > 0, f"the GPU was busy with matrix products, yet NVML read {gpu['util']} %"
    assert isinstance(gpu["rank_used"], int) and gpu["rank_used"] >= 256 << 20, \
        f"the rank holds a 256 MiB tensor; NVML's per-process figure read {gpu['rank_used']}"
    assert gpu["used"] >= gpu["rank_used"], gpu


def _hang_in_allreduce(pg_timeout: float):
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=pg_timeout))
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)  # completes: the recorder's entry before the hang
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 40)  # spins on the GPU for minutes: the next collective queues behind it
    dist.all_reduce(torch.ones(1024, device="cuda"))
    torch.cuda.synchronize()


def _flight_lines(exc: JobFailed) -> str:
    text = "\n".join(exc._render_traceback_())
    print(text)
    return text


def test_nccl_watchdog_timeout_shows_each_ranks_last_collectives():
    with pytest.raises(JobFailed) as caught:
        hvdmagic.run(_hang_in_allreduce, -1, 5.0, backend="torch", timeout=180)
    text = _flight_lines(caught.value)
    assert "flight recorder: each rank's last collectives" in text, text
    digest = hvdmagic.last_run().flight_records[0]
    first, last = digest["entries"][-2], digest["entries"][-1]
    assert first["op"] == last["op"] == "nccl:all_reduce", digest
    assert first["state"] == "completed" and last["state"] != "completed", digest
    assert last["sizes"] == [[1024]], digest
    assert "_hang_in_allreduce" in last["where"], digest
    assert digest["path"] and digest["path"] in text


def test_hvdmagic_timeout_asks_torch_for_its_flight_record_before_stopping_the_rank():
    with pytest.raises(JobTimeout) as caught:
        hvdmagic.run(_hang_in_allreduce, -1, 600.0, backend="torch", timeout=25)
    text = _flight_lines(caught.value)
    assert "flight recorder: each rank's last collectives" in text, text
    last = hvdmagic.last_run().flight_records[0]["entries"][-1]
    assert last["op"] == "nccl:all_reduce" and last["state"] != "completed", last


# -- Spark's own GPU scheduling: a standalone worker that finds its GPUs with nvidia-smi -----------------
# HorovodRunner's users get their GPU from the task's resources. These run where Java and pyspark are beside
# the GPU; the last GPU machine had neither, and its calls could not carry them (docs/gpu-run.md).
@pytest.fixture(scope="module")
def gpu_cluster(shell, tmp_path_factory):
    """A master and one worker on 127.0.0.1 whose GPUs come from scripts/gpu_discovery.sh; the executor takes
    them all and each task one (spark.task.resource.gpu.amount=1): one slot a GPU."""
    if shutil.which("java") is None or importlib.util.find_spec("pyspark") is None:
        pytest.skip("Spark's GPU scheduling needs Java and pyspark on the GPU machine (docs/gpu-run.md)")
    from helpers import spark_cluster

    with spark_cluster(tmp_path_factory.mktemp("gpu-cluster"), workers=1, cores=len(_driver_gpu_indices()) + 1,
                       gpus=len(_driver_gpu_indices()), task_gpus=1, app="hvdmagic-gpu-test",
                       discovery=Path(__file__).resolve().parent.parent / "scripts" / "gpu_discovery.sh"):
        yield shell


SPARK_GPU_CELLS = {
    "horovod": """%%horovod --np 1
import os, torch, horovod.torch as hvd
hvd.init()
torch.cuda.set_device(hvd.local_rank())
total = hvd.allreduce(torch.ones(2, device="cuda"), op=hvd.Sum, name="ones")
(os.environ["CUDA_VISIBLE_DEVICES"], os.environ["HVDMAGIC_TASK_GPUS"], torch.cuda.device_count(), str(total.device),
 bool(hvd.nccl_built()))
""",
    "torchrun": """%%torchrun --np 1
import os, torch, torch.distributed as dist
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
total = torch.ones(2, device="cuda")
dist.all_reduce(total)
(os.environ["CUDA_VISIBLE_DEVICES"], os.environ["HVDMAGIC_TASK_GPUS"], torch.cuda.device_count(), str(total.device),
 dist.get_backend() == "nccl")
""",
}


@pytest.mark.parametrize("magic", sorted(SPARK_GPU_CELLS))
def test_a_cell_on_spark_gets_its_tasks_gpu_and_runs_nccl_on_it(gpu_cluster, magic):
    result, error = run(gpu_cluster, SPARK_GPU_CELLS[magic])
    assert error is None, error
    print(f"%%{magic} --np 1 on Spark's GPU:", result)
    visible, task_gpus, count, device, nccl = result
    assert visible == task_gpus == _driver_gpu_indices()[0], f"the task's GPU, from nvidia-smi through Spark: {result}"
    assert (count, device, nccl) == (1, "cuda:0", True), result


def test_the_torch_distributor_on_spark_trains_on_the_tasks_gpu_and_its_row_shows_it(gpu_cluster):
    flops = hvdmagic.TorchDistributor(num_processes=1, local_mode=False, use_gpu=True).run(_busy_gpu, 5.0)
    assert flops > 0
    record = hvdmagic.last_run()
    assert record.mode != "local", record.mode
    gpus = record.ranks[0].gpus
    print("NVML sample of the distributor's rank on Spark:", gpus)
    assert len(gpus) == 1 and gpus[0]["index"] == _driver_gpu_indices()[0] and gpus[0]["util"] > 0, gpus


def test_a_warm_session_on_spark_keeps_its_gpu_between_cells(gpu_cluster):
    try:
        assert gpu_cluster.run_cell("%horovod start --np 1").error_in_exec is None
        first, error = run(gpu_cluster, """%%horovod
import os, torch, horovod.torch as hvd
hvd.init()
torch.cuda.set_device(hvd.local_rank())
kept = torch.full((4,), 2.0, device="cuda")
(os.getpid(), os.environ["CUDA_VISIBLE_DEVICES"])
""")
        assert error is None, error
        second, error = run(gpu_cluster, "%%horovod\n(os.getpid(), hvd.allreduce(kept, op=hvd.Sum).sum().item())")
        assert error is None, error
    finally:
        gpu_cluster.run_cell("%horovod stop")
    assert first[1] == _driver_gpu_indices()[0], first
    assert second == (first[0], 8.0), f"the same warm rank, its CUDA tensor kept: {first} then {second}"


def test_asking_for_more_gpus_than_the_cluster_has_gets_the_slot_paragraph_at_once(gpu_cluster):
    many = len(_driver_gpu_indices()) + 1
    _, error = run(gpu_cluster, f"%%horovod --np {many}\n1")
    assert isinstance(error, LaunchError), error
    assert f"--np {many} needs {many} barrier task slots at once, but this Spark cluster offers {many - 1}" \
        in str(error), error


ESTIMATOR_ON_GPU = """
import torch
from pyspark.ml.feature import VectorAssembler
from pyspark.sql import SparkSession
from hvdmagic.spark.common.store import Store
from hvdmagic.spark.torch import TorchEstimator

class DeviceMarked(torch.nn.Linear):
    # Predicts as a Linear does, plus 1000 when it predicts on a GPU: transform's device shows in its output.
    def forward(self, x):
        out = super().forward(x)
        return out if self.training else out + 1000.0 * x.is_cuda

torch.manual_seed(0)
rows = [(a, b, 2 * a - 3 * b + 0.5) for a, b in torch.randn(512, 2).tolist()]
frame = SparkSession.builder.getOrCreate().createDataFrame(rows, ["x0", "x1", "y"])
frame = VectorAssembler(inputCols=["x0", "x1"], outputCol="features").transform(frame)
model = DeviceMarked(2, 1)
fitted = TorchEstimator(num_proc=1, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                        loss=torch.nn.MSELoss(), feature_cols=["features"], label_cols=["y"], batch_size=16,
                        epochs=8, verbose=0, store=Store.create(store_path)).fit(frame)
shifts = fitted.transform(frame).selectExpr("min(y__output - y)", "max(y__output - y)").first()
(fitted.fit_info["device"], fitted.getHistory()["loss"][-1], tuple(shifts))
"""


def test_the_torch_estimator_fits_and_transforms_on_the_tasks_gpu(gpu_cluster, tmp_path):
    gpu_cluster.user_ns["store_path"] = str(tmp_path)
    outcome = gpu_cluster.run_cell(ESTIMATOR_ON_GPU)
    assert outcome.error_in_exec is None, outcome.error_in_exec
    device, last_loss, (low, high) = outcome.result
    print("TorchEstimator on Spark's GPU:", outcome.result)
    assert device == "cuda:0" and last_loss < 0.05, outcome.result
    assert 999.8 < low <= high < 1000.2, f"every prediction made on the GPU (+1000) and close: {outcome.result}"


# -- Databricks' serverless @distributed and pyspark's DeepspeedTorchDistributor, on the GPU (issue 62) ---------
def _nccl_on_the_gpu() -> tuple:
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")  # as Databricks' examples write it: no gloo here
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    total = torch.ones(1, device="cuda")
    dist.all_reduce(total)
    return dist.get_backend(), str(total.device), total.item(), torch.cuda.get_device_name()


def test_distributed_as_databricks_writes_it_runs_nccl_on_this_machines_gpu_and_names_another_type(capsys):
    results = hvdmagic.distributed(gpus=1, gpu_type="A10", remote=False)(_nccl_on_the_gpu).distributed()
    print("@distributed(gpus=1) on the GPU:", results)
    [(backend, device, total, name)] = results
    assert (backend, device, total) == ("nccl", "cuda:0", 1.0), results
    logs = hvdmagic.last_run().logs[0]
    if "A10" not in name:  # the type asked for is not this machine's: one line says so, the run goes on
        assert f"gpu_type='A10' was asked for; this run's GPUs are {name}." in logs, logs
    assert "run on the CPU" not in capsys.readouterr().out


def test_distributed_on_spark_gets_the_tasks_gpu(gpu_cluster):
    results = hvdmagic.distributed(num_accelerators=1)(_nccl_on_the_gpu).distributed()
    assert results[0][:3] == ("nccl", "cuda:0", 1.0) and hvdmagic.last_run().mode != "local", results


@pytest.mark.timeout(600)  # DeepSpeed's import and its first initialize take a while
def test_the_deepspeed_distributor_trains_zero_2_on_the_gpu_as_pyspark_writes_it():
    pytest.importorskip("deepspeed", reason="scripts/gpu_check.sh installs DeepSpeed")
    from test_databricks_apis import DEEPSPEED_CONFIG, deepspeed_train

    stage, _, first, last, device = hvdmagic.DeepspeedTorchDistributor(numGpus=1, useGpu=True).run(
        deepspeed_train, 1e-2, {**DEEPSPEED_CONFIG, "bf16": {"enabled": True}})
    assert device.startswith("cuda") and stage == 2 and last < first / 4, (device, stage, first, last)
