"""Interrupting a real Jupyter kernel mid-training stops every rank and keeps the kernel usable."""

from __future__ import annotations

import time

import psutil
from kernels import execute as _execute

TRAIN = """%%horovod --np 2
import time, horovod.torch as hvd
hvd.init()
print("training", flush=True)
time.sleep(600)
"""


def _rank_pids(kernel_pid: int) -> list[int]:
    pids = []
    for proc in psutil.Process(kernel_pid).children(recursive=True):
        try:
            if "hvdmagic.rank" in proc.cmdline():
                pids.append(proc.pid)
        except psutil.Error:  # exited (or a zombie) while we looked
            continue
    return pids


def test_interrupt_stops_ranks_and_keeps_the_kernel(kernel):
    manager, client = kernel
    reply, _ = _execute(client, "%load_ext hvdmagic", timeout=60)
    assert reply["status"] == "ok"
    kernel_pid = manager.provisioner.process.pid
    seen: list[int] = []
    interrupted_at = []

    def interrupt_once_training(text):
        if "training" in text and not interrupted_at:
            seen.extend(_rank_pids(kernel_pid))
            interrupted_at.append(time.monotonic())
            manager.interrupt_kernel()

    reply, texts = _execute(client, TRAIN, timeout=180, on_output=interrupt_once_training)
    assert interrupted_at, "training never started"
    assert reply["status"] == "error" and reply["ename"] == "JobInterrupted", (reply, texts)
    assert len(seen) == 2, f"expected 2 rank processes while training, saw {seen}"
    error_text = texts[-1]
    assert len(error_text.splitlines()) <= 2, f"the interrupt produced a long traceback:\n{error_text}"
    assert time.monotonic() - interrupted_at[0] < 5 + 5, "the cell took too long to stop"
    alive = [pid for pid in seen if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"rank processes {alive} survived the interrupt"

    reply, texts = _execute(client, "%%horovod --np 2\nimport horovod.torch as hvd\nhvd.init()\nhvd.size()",
                            timeout=180)
    assert reply["status"] == "ok", texts
