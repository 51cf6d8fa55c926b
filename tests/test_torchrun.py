"""torch.distributed beside Horovod: %%torchrun, hvdmagic.run(backend="torch") and the TorchDistributor drop-in."""

from __future__ import annotations

import re
import threading
import time

import pytest
from conftest import run
from helpers import execute, wait_until
from procs import inet_sockets, rank_processes

import hvdmagic
from hvdmagic.errors import JobFailed, JobTimeout, LaunchError

DDP_CELL = """%%torchrun --np {np} --out result
import os, torch, torch.distributed as dist, hvdmagic
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)  # different initial weights: DDP must broadcast rank 0's
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(64, 4) + rank  # different data per rank: only averaged gradients keep the ranks equal
y = X.sum(dim=1, keepdim=True)
for step in hvdmagic.track(range(20), desc="step"):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(X), y)
    loss.backward()
    opt.step()
    hvdmagic.log_metrics(loss=loss.item())
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.zeros_like(weights) for _ in range(size)]
dist.all_gather(gathered, weights)
env = {{k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")}}
all_envs = [None] * size
dist.all_gather_object(all_envs, env)
(max((g - gathered[0]).abs().max().item() for g in gathered), all_envs, "horovod" in __import__("sys").modules)
"""


@pytest.mark.profile
@pytest.mark.parametrize("np, spark_kind", [(2, "classic"), (2, "connect"), (-2, "classic")],
                         ids=["spark", "spark-connect", "local"], indirect=["spark_kind"])
def test_ddp_ranks_end_with_identical_weights_and_torchruns_environment(ip, np, spark_kind):
    result, error = run(ip, DDP_CELL.format(np=np))
    assert error is None, error
    spread, envs, imported_horovod = result
    assert spread == 0.0, f"the ranks' weights differ by {spread}: DDP did not average"
    assert not imported_horovod, "a %%torchrun rank imported horovod"
    n = abs(np)
    assert [e["RANK"] for e in envs] == [str(r) for r in range(n)]
    for rank, env in enumerate(envs):
        assert env["WORLD_SIZE"] == str(n) and env["LOCAL_RANK"] == str(rank) and env["LOCAL_WORLD_SIZE"] == str(n)
        assert env["GROUP_RANK"] == "0" and env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == envs[0]["MASTER_PORT"]
        assert env["TORCHELASTIC_RUN_ID"] == envs[0]["TORCHELASTIC_RUN_ID"]
    assert len(hvdmagic.last_run().metrics) == 20 * n
    assert hvdmagic.last_run().command == "%%torchrun"
    assert spark_kind.ranks() == []


def _allreduce_and_port(delay: float):
    import os
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    time.sleep(delay)  # the workload: keeps both jobs' stores alive at once
    t = torch.ones(1)
    dist.all_reduce(t)
    return os.environ["MASTER_PORT"], t.item()


def test_two_jobs_at_once_never_share_a_rendezvous_port():
    results: dict[int, list] = {}
    errors = []

    def job(i: int) -> None:
        try:
            results[i] = hvdmagic.run(_allreduce_and_port, -2, 2.0, backend="torch")
        except Exception as exc:  # reported below, with the other job's outcome
            errors.append(exc)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not errors, errors
    ports = {results[i][0][0] for i in range(2)}
    assert len(ports) == 2, f"both jobs used port {ports}"
    assert all(value == 2.0 for i in range(2) for _, value in results[i])


@pytest.mark.profile
@pytest.mark.unit
def test_the_store_listens_on_the_driver_address_only(capfd):
    """TCPStore alone would listen on every interface; hvdmagic hands it a socket bound to the
    driver address, which the store closes when it goes. On every profile's torch (docs/runtimes.md)
    the first server asked takes the socket: no refusal reaches the cell's stderr."""
    import psutil

    from hvdmagic.launch.torch_store import TorchStore

    store = TorchStore("127.0.0.1", 2)
    listening = [c.laddr for c in inet_sockets() if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port]
    store.stop()
    assert [address.ip for address in listening] == ["127.0.0.1"], listening
    wait_until(lambda: not any(c.laddr.port == store.port for c in inet_sockets() if c.status == psutil.CONN_LISTEN),
               10, "the store's socket outlived it")
    assert "listen fd" not in capfd.readouterr().err, "torch refused the socket first: the cell would show it"


@pytest.mark.parametrize("how, summary", [("raise ValueError('rank one is broken')", "ValueError: rank one is broken"),
                                          ("os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL")])
def test_a_rank_failing_while_the_other_waits_in_all_reduce_fails_the_cell_fast(ip, tmp_path, how, summary):
    stamp = tmp_path / "failed_at"
    ip.user_ns["answer"] = "untouched"
    _, error = run(ip, f"""%%torchrun --np 2 --out answer
import os, signal, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
if dist.get_rank() == 1:
    open({str(stamp)!r}, "w").write(repr(time.time()))
    {how}
dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that is gone
""")
    returned = time.time()
    assert isinstance(error, JobFailed), error
    assert error.failures[0].rank == 1 and summary in error.failures[0].summary, error
    rendered = "\n".join(error._render_traceback_())
    assert "Java" not in rendered and "at org.apache" not in rendered
    assert returned - float(stamp.read_text()) < 5, "the cell took too long to fail"
    assert ip.user_ns["answer"] == "untouched"
    assert rank_processes() == []


def test_a_rank_stuck_in_a_collective_is_caught_by_the_stall_timeout(ip):
    started = time.monotonic()
    _, error = run(ip, """%%torchrun --np 2 --stall-timeout 6
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
print("ready", flush=True)
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(1))  # rank 1 never joins: the default process-group timeout is 30 minutes
else:
    while True:
        print("rank 1 busy", flush=True)
        time.sleep(0.5)
""")
    assert isinstance(error, JobTimeout), error
    assert re.search(r"rank\(s\) 0 made no progress for 6 s", str(error)), error
    assert time.monotonic() - started < 120
    assert rank_processes() == []


def _train_and_report(scale):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    import torch

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item() * scale


@pytest.mark.profile
@pytest.mark.parametrize("local_mode, spark_kind", [(True, "classic"), (False, "classic"), (False, "connect")],
                         ids=["local", "spark", "spark-connect"], indirect=["spark_kind"])
def test_torch_distributor_drop_in_runs_a_function(local_mode, spark_kind):
    from hvdmagic import TorchDistributor

    value = TorchDistributor(num_processes=2, local_mode=local_mode, use_gpu=False).run(_train_and_report, 10)
    assert value == 30.0
    assert hvdmagic.last_run().results[1] is None  # only rank 0's value travels back


def test_torch_distributor_drop_in_runs_a_script_with_its_arguments(tmp_path):
    from hvdmagic import TorchDistributor

    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "train.py"
    script.write_text("""
import argparse, os, torch, torch.distributed as dist
parser = argparse.ArgumentParser()
parser.add_argument("--out")
parser.add_argument("--scale", type=float)
args = parser.parse_args()
assert __name__ == "__main__"
dist.init_process_group("gloo")
t = torch.tensor([args.scale])
dist.all_reduce(t)
open(os.path.join(args.out, f"rank{dist.get_rank()}"), "w").write(str(t.item()))
""")
    value = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(
        str(script), "--out", str(out), "--scale", 1.5)
    assert value is None
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1"]
    assert {p.read_text() for p in out.iterdir()} == {"3.0"}


@pytest.mark.unit
def test_use_gpu_without_gpus_fails_before_starting(monkeypatch):
    from hvdmagic import TorchDistributor

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(LaunchError, match="need 2 GPUs on the driver, and it has 0"):
        TorchDistributor(num_processes=2, local_mode=True, use_gpu=True).run(_train_and_report, 1)
    with pytest.raises(LaunchError, match=r"spark\.task\.resource\.gpu\.amount"):
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=True).run(_train_and_report, 1)


def test_checkpoints_broadcast_over_the_torch_process_group(ip, tmp_path):
    result, error = run(ip, f"""%%torchrun --np -2
import torch, torch.distributed as dist, hvdmagic
dist.init_process_group("gloo")
path = hvdmagic.save_checkpoint({{"w": torch.tensor([1.0, 2.0])}}, {str(tmp_path)!r}, step=7)
dist.barrier()
state, step = hvdmagic.load_checkpoint({str(tmp_path)!r})
gathered = [None, None]
dist.all_gather_object(gathered, (str(path) if path else None, step, state["w"].tolist()))
gathered
""")
    assert error is None, error
    (path0, step0, w0), (path1, step1, w1) = result
    assert path0.endswith("checkpoint-7.pt") and path1 is None, "only rank 0 writes"
    assert step0 == step1 == 7 and w0 == w1 == [1.0, 2.0]


def test_lightning_ddp_inside_torchrun_feeds_the_dashboard(ip):
    result, error = run(ip, """%%torchrun --np -2
import torch, lightning.pytorch as pl
from hvdmagic.callbacks.lightning import HvdmagicCallback

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

X = torch.randn(64, 4)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8)
trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=2, log_every_n_steps=1,
                     callbacks=[HvdmagicCallback()], logger=False, enable_progress_bar=False,
                     enable_checkpointing=False, enable_model_summary=False)
trainer.fit(Model(), data)
(trainer.world_size, trainer.global_rank, trainer.global_step)
""")
    assert error is None, error
    world_size, global_rank, steps = result
    assert (world_size, global_rank) == (2, 0)
    assert steps == 2 * 64 // 8 // 2  # DistributedSampler halves each rank's batches
    metrics = hvdmagic.last_run().metrics
    assert "train_loss" in metrics and metrics["train_loss"].notna().sum() > 0
    assert {rank.bar.step for rank in hvdmagic.last_run().ranks} == {steps}


def test_an_environment_without_horovod_runs_torchrun_the_api_and_the_drop_in(kernel_factory):
    """horovod cannot be imported in this kernel nor in its ranks; everything torch-only still works."""
    _, client = kernel_factory(without_horovod=True)

    def ok(code: str, timeout: float = 180) -> str:
        reply, texts = execute(client, code, timeout=timeout)
        assert reply["status"] == "ok", (code, texts)
        return "".join(texts)

    ok("%load_ext hvdmagic")
    ok("import hvdmagic\n"
       "def world():\n"
       "    import sys, torch.distributed as dist\n"
       "    dist.init_process_group('gloo')\n"
       "    return dist.get_world_size(), 'horovod' in sys.modules")
    ok("%%torchrun --np -2 --out magic_result\nworld()")
    out = ok("print('magic', magic_result)\n"
             "print('api', hvdmagic.run(world, -2, backend='torch'))\n"
             "from hvdmagic import TorchDistributor\n"
             "print('drop-in', TorchDistributor(2, local_mode=False, use_gpu=False).run(world))")
    assert "magic (2, False)" in out and "api [(2, False), (2, False)]" in out and "drop-in (2, False)" in out, out
    reply, texts = execute(client, "%%horovod --np -2\n1", timeout=60)
    assert reply["status"] == "error" and reply["ename"] == "LaunchError", texts
    assert "horovod is not importable" in texts[-1] and "%%torchrun needs no horovod" in texts[-1]
