"""Local mode (np < 0): the rank supervisors run as threads on the driver, no Spark.

Runs in the kernel; matches ``launch.backend.Backend``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

from hvdmagic.channel import DEFAULT_GRACE
from hvdmagic.errors import LaunchError
from hvdmagic.launch.backend import Backend
from hvdmagic.protocol import TaskSpec
from hvdmagic.task.shards import write_shard
from hvdmagic.task.supervisor import run_task


class LocalBackend(Backend):
    name = "local"
    bind_host = "127.0.0.1"
    job_group = None  # no scheduler, so no job to name
    failure_details = ""  # failure() says it all: a supervisor's exception in the kernel's own process
    reconnect_grace = DEFAULT_GRACE  # the tasks are threads of the kernel, over loopback: nothing else to read

    def __init__(self, np: int, data=None, gpus: bool = False):
        self.np = np
        self.data = data
        self.notes: list[str] = []
        # One device per task: required (use_gpu), else wherever the driver has one for each rank.
        self.gpus = driver_gpus(np) if gpus else self._gpus_if_enough(np)
        self._threads: list[threading.Thread] = []
        self._errors: list[str] = []
        self._shard_dir: str | None = None

    def _gpus_if_enough(self, np: int) -> list[list[str]]:
        """Pin rank i to the driver's GPU i when it has one for each rank. With more ranks than GPUs,
        NCCL fails (it refuses two ranks on one device): say so before the launch, and leave the ranks
        unpinned, since a cell that reduces CPU tensors over Gloo still runs."""
        devices = driver_devices()
        if devices and np > len(devices):
            self.notes.append(
                f"{np} ranks on {len(devices)} GPU{'s' if len(devices) > 1 else ''}: NCCL needs one GPU per rank, "
                "so its collectives fail here (\"invalid usage\", \"Duplicate GPU detected\"). Use "
                f"--np -{len(devices)}, or Gloo for CPU tensors (torch.distributed's gloo backend also takes CUDA "
                "tensors). The ranks are not pinned: each sees every GPU.")
            devices = []
        return [[device] for device in devices[:np]] if devices else [[] for _ in range(np)]

    def describe(self) -> str:
        return f"local mode, {self.np} processes on the driver"

    def _write_shards(self) -> list[tuple[str, int] | None]:
        if self.data is None:
            return [None] * self.np
        table = self.data.toArrow()
        if table.num_rows < self.np:
            raise ValueError(f"--data has {table.num_rows} rows, fewer than the {self.np} ranks")
        self._shard_dir = tempfile.mkdtemp(prefix="hvdmagic-shards-")
        shards = []
        for task, part in enumerate(_split_round_robin(table, self.np)):
            path = Path(self._shard_dir) / f"shard-{task}.arrow"
            shards.append((str(path), write_shard(part.to_batches(), part.schema, path)))
        return shards

    def start(self, spec: TaskSpec) -> None:
        for task, shard in enumerate(self._write_shards()):
            thread = threading.Thread(target=self._run, args=(spec, task, shard), name=f"hvdmagic-local-{task}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()

    def _run(self, spec: TaskSpec, task: int, shard: tuple[str, int] | None) -> None:
        try:
            run_task(spec, task, self.gpus[task], shard=shard)
        except Exception as exc:  # reported through failure(); the job loop decides
            self._errors.append(f"local task {task} failed: {type(exc).__name__}: {exc}")

    def failure(self) -> str | None:
        return self._errors[0] if self._errors else None

    def ended(self) -> bool:
        return bool(self._threads) and not any(thread.is_alive() for thread in self._threads)

    def cancel(self) -> None:
        pass  # supervisors obey the channel's abort; there is no scheduler to tell

    def join(self, timeout: float) -> None:
        for thread in self._threads:
            thread.join(timeout)
        if self._shard_dir:
            shutil.rmtree(self._shard_dir, ignore_errors=True)


def driver_devices() -> list[str]:
    """The driver's GPUs, found without initialising CUDA in the kernel: CUDA_VISIBLE_DEVICES when set,
    else nvidia-smi's list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        # CUDA stops at the first invalid entry: "-1" (the usual way to hide every GPU) means none.
        devices = []
        for device in (d.strip() for d in visible.split(",")):
            if not device or device.startswith("-"):
                break
            devices.append(device)
        return devices
    smi = shutil.which("nvidia-smi")
    return list(_listed_gpus(smi)) if smi else []


# nvidia-smi's answers by its path, kept for the kernel's life: it takes a tenth of a second or more, and a
# machine's GPUs do not change under a running kernel.
_LISTED: dict[str, tuple[str, ...]] = {}


def _listed_gpus(smi: str) -> tuple[str, ...]:
    """nvidia-smi's GPU indices. A wedged driver hangs nvidia-smi: after 10 s the driver counts as
    having none, and is asked again next time."""
    import subprocess

    if smi in _LISTED:
        return _LISTED[smi]
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ()
    _LISTED[smi] = found = tuple(str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU "))
    return found


def driver_gpus(np: int) -> list[list[str]]:
    """One of the driver's GPUs per task; fewer GPUs than tasks fail the launch here, in one
    paragraph, rather than in every rank."""
    devices = driver_devices()
    if len(devices) < np:
        raise LaunchError(f"{np} processes with a GPU each need {np} GPUs on the driver, and it has {len(devices)} "
                          "(CUDA_VISIBLE_DEVICES or nvidia-smi). Use fewer processes, use_gpu=False, or the "
                          "executors (local_mode=False).")
    return [[device] for device in devices[:np]]


def _split_round_robin(table, parts: int) -> list:
    """Row i goes to part i % parts, as Spark's repartition(np) deals rows: shards differ by a row at most."""
    return [table.take(list(range(i, table.num_rows, parts))) for i in range(parts)]
