"""Rank-0 checkpoints that survive a killed run, and learning-rate scaling."""

from __future__ import annotations

import pytest
from conftest import run

import hvdmagic
from hvdmagic.errors import JobFailed

TRAIN = """%%horovod --np -2 --out resumed
import os, signal, torch, horovod.torch as hvd, hvdmagic
hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
state, step = hvdmagic.load_checkpoint(CKPT)
start = 0 if step is None else step + 1
if state is not None:
    model.load_state_dict(state)
for step in range(start, 10):
    with torch.no_grad():
        model.weight += 1.0  # stands for one optimizer step
    if step % 2 == 1:
        hvdmagic.save_checkpoint(model.state_dict(), CKPT, step)
    if KILL_AT is not None and step == KILL_AT and hvd.rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, mid-training
(start, model.weight.sum().item(), hvd.allgather_object(model.weight.sum().item()))
"""


def test_a_killed_run_resumes_from_its_last_checkpoint(ip, tmp_path):
    ip.user_ns.update(CKPT=str(tmp_path / "ckpt"), KILL_AT=6)
    _, error = run(ip, TRAIN)
    assert isinstance(error, JobFailed) and "killed by SIGKILL" in str(error)
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert saved == ["checkpoint-1.pt", "checkpoint-3.pt", "checkpoint-5.pt"]  # atomic: no .partial left

    ip.user_ns["KILL_AT"] = None
    result, error = run(ip, TRAIN)
    assert error is None, error
    start, weight_sum, every_rank = result
    assert start == 6, "training did not continue from the step after the last checkpoint"
    import torch

    torch.manual_seed(0)
    initial = torch.nn.Linear(4, 1).weight.sum().item()
    assert every_rank[0] == every_rank[1] == weight_sum  # rank 1 got rank 0's checkpoint
    # Steps 0-5 from the checkpoint, 6-9 after resuming: 10 steps of +1 on 4 weights, none twice.
    assert abs(weight_sum - (initial + 40)) < 1e-4


@pytest.mark.unit
def test_checkpoints_work_on_a_single_node_too(tmp_path):
    import torch

    assert hvdmagic.load_checkpoint(tmp_path) == (None, None)
    hvdmagic.save_checkpoint({"w": torch.ones(2)}, tmp_path, step=3, keep=1)
    hvdmagic.save_checkpoint({"w": torch.zeros(2)}, tmp_path, step=4, keep=1)
    state, step = hvdmagic.load_checkpoint(tmp_path)
    assert step == 4 and state["w"].tolist() == [0.0, 0.0]
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-4.pt"]


def test_scale_lr_scales_by_ranks_and_notes_the_effective_batch(ip, capfd):
    result, error = run(ip, """%%horovod --np -2
import horovod.torch as hvd, hvdmagic
hvd.init()
hvdmagic.scale_lr(0.01, batch_size=32)
""")
    assert error is None and result == 0.02
    assert hvdmagic.last_run().notes == [
        "learning rate scaled 0.01 -> 0.02 for 2 ranks; effective batch size 64 (32 per rank)"]
    assert "effective batch size 64" in capfd.readouterr().out
    assert hvdmagic.scale_lr(0.01) == 0.01  # a single node: unchanged
