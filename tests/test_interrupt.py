"""Interrupting a real Jupyter kernel mid-training stops every rank and keeps the kernel usable."""

from __future__ import annotations

import random
import time

import pytest
from helpers import execute as _execute
from helpers import stop_kernel
from helpers import wait_for_reply as _wait_for_reply
from procs import alive, rank_processes

TRAIN = {
    "horovod": """%%horovod --np 2
import time, horovod.torch as hvd
hvd.init()
print("training", flush=True)
time.sleep(600)
""",
    "torchrun": """%%torchrun --np 2
import time, torch.distributed as dist
dist.init_process_group("gloo")
print("training", flush=True)
time.sleep(600)
""",
}


@pytest.mark.parametrize("magic", list(TRAIN))
def test_interrupt_stops_ranks_and_keeps_the_kernel(kernel, magic):
    manager, client = kernel
    reply, _ = _execute(client, "%load_ext hvdmagic", timeout=60)
    assert reply["status"] == "ok"
    kernel_pid = manager.provisioner.process.pid
    seen: list[int] = []
    interrupted_at = []

    def interrupt_once_training(text):
        if "training" in text and not interrupted_at:
            seen.extend(p.pid for p in rank_processes(kernel_pid))
            interrupted_at.append(time.monotonic())
            manager.interrupt_kernel()

    reply, texts = _execute(client, TRAIN[magic], timeout=180, on_output=interrupt_once_training)
    assert interrupted_at, "training never started"
    assert reply["status"] == "error" and reply["ename"] == "JobInterrupted", (reply, texts)
    assert len(seen) == 2, f"expected 2 rank processes while training, saw {seen}"
    error_text = texts[-1]
    assert len(error_text.splitlines()) <= 2, f"the interrupt produced a long traceback:\n{error_text}"
    assert time.monotonic() - interrupted_at[0] < 5 + 5, "the cell took too long to stop"
    assert alive(seen) == [], f"rank processes {alive(seen)} survived the interrupt"

    reply, texts = _execute(client, "%%horovod --np 2\nimport horovod.torch as hvd\nhvd.init()\nhvd.size()",
                            timeout=180)
    assert reply["status"] == "ok", texts


SLEEPER = """%%horovod --np 2
import time, horovod.torch as hvd
hvd.init()
time.sleep(600)
"""
WORKS = "%%horovod --np 2\nimport horovod.torch as hvd\nhvd.init()\nhvd.size()"
# Internal tracebacks, and the JVM's own chatter, which goes to its log file, never into a cell.
NOISE = ("Traceback", "Py4J", "reentrant", "Exception while sending command", "ERROR", "WARN",
         "Using incubator modules", "log level")


def _interrupt_at(manager, client, delay: float) -> str:
    """Run SLEEPER, press Stop ``delay`` seconds in; check the outcome is one line; return it."""
    msg_id = client.execute(SLEEPER)
    time.sleep(delay)  # the random moment Stop is pressed: the scenario, not synchronisation
    manager.interrupt_kernel()
    reply, texts = _wait_for_reply(client, msg_id, timeout=120)
    assert reply["status"] == "error" and reply["ename"] == "JobInterrupted", (delay, reply, texts)
    error = texts[-1]
    assert len(error.strip().splitlines()) == 1, f"Stop at {delay:.1f} s: not one line:\n{error}"
    noisy = [text for text in texts[:-1] if any(word in text for word in NOISE)]
    assert not noisy, f"Stop at {delay:.2f} s: noise before the error:\n" + "\n".join(noisy)  # whole, not repr'd
    reply, texts = _execute(client, WORKS, timeout=180)
    assert reply["status"] == "ok", f"the cell after Stop at {delay:.1f} s failed: {texts}"
    assert not any(word in text for text in texts for word in NOISE), texts
    return reply_text(error)


def reply_text(error: str) -> str:
    return error.split(":", 1)[1].strip() if ":" in error else error


def test_stop_at_random_moments_gives_one_line_and_the_next_cell_works(kernel_factory):
    """Stop pressed during Spark's first start, the submission, the ranks' start-up and training.

    Three fresh kernels; in each, the first cell (which starts the JVM) and two later ones
    are stopped at random moments (a fixed seed, so a failure can be replayed), and every
    Stop is followed by a cell that must work. Nine Stops catch a one-in-three failure with
    97 % probability.
    """
    rng = random.Random(20261123)
    hit = []
    for _ in range(3):
        manager, client = kernel_factory()
        try:
            reply, _ = _execute(client, "%load_ext hvdmagic", timeout=60)
            assert reply["status"] == "ok"
            hit.append(_interrupt_at(manager, client, rng.uniform(0.5, 5.0)))  # the JVM is starting
            for _ in range(2):
                hit.append(_interrupt_at(manager, client, rng.uniform(0.0, 3.0)))
        finally:
            stop_kernel(manager, client)
    assert any("embedded Spark was starting" in text for text in hit), hit
    assert any("while the ranks" in text for text in hit), hit
