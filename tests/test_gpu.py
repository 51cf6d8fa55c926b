"""What only a GPU shows: NVML's figures on a rank's row, and torch's NCCL flight recorder.

The tier ``gpu`` runs where an NVIDIA GPU and a CUDA build of torch are (tests/conftest.py
leaves it out elsewhere and says so). It needs no Spark and no IPython: ``hvdmagic.run``
and the TorchDistributor drop-in in local mode. docs/diagnostics.md says where it last ran.
A machine with one GPU runs one NCCL rank: NCCL refuses two ranks on one device, so the
hang is made with a kernel that spins on the GPU, which the next collective waits behind.
"""

from __future__ import annotations

import pytest

import hvdmagic
from hvdmagic.errors import JobFailed, JobTimeout

pytestmark = pytest.mark.gpu

GIB = 1 << 30


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
