"""What a rank's processes use: CPU, memory and, where NVML sees a GPU, the GPU's.

The supervisor samples its rank from the outside, on a thread of its own, while the
rank runs a cell: the rank's own process pays nothing and its code does nothing for it.
Each sample is one RESOURCES event over the task's channel, once a second
(``SAMPLE_INTERVAL``): a quick cell ends before the first one and sends none, and one
shorter than ``PRIME_DELAY`` is not even looked at.

CPU and RSS are summed over the rank's process tree (DataLoader workers, a compiler the
cell ran). Reading the tree means reading every process's parent (psutil's
``children``), a few milliseconds on a busy host, and in local mode the supervisors are
threads of the kernel: so the tree is re-read every ``TREE_INTERVAL`` only, and the
processes found are sampled every second, which is cheap (two small /proc reads each).

GPUs come from NVML (``pynvml``, the ``nvidia-ml-py`` package), imported on first use and
optional: without it, or without a GPU, a sample names no GPU and the views show none.
A rank's GPUs are the ones its ``CUDA_VISIBLE_DEVICES`` names (with ``HVDMAGIC_CUDA_DEVICE``,
the one it was given), else every GPU where one of its processes runs. For each: the
device's utilisation, its memory used and total, and what the rank's own processes hold
(None where NVML cannot tell, e.g. a container whose process ids NVML does not see).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psutil

from hvdmagic import protocol
from hvdmagic.protocol import CUDA_DEVICE_ENV

SAMPLE_INTERVAL = 1.0  # seconds: a row's figures need no more, and a second costs the host nothing
# A cell that ends sooner is never sampled and costs no psutil call: in local mode the supervisors
# are threads of the kernel, and a warm session's trivial cell takes some 20 ms.
PRIME_DELAY = 0.1
TREE_INTERVAL = 10.0  # seconds between two reads of the rank's process tree (see the module's docstring)


class ProcessTree:
    """The rank's process and its descendants, sampled for CPU % and RSS."""

    def __init__(self, pid: int):
        self.root = psutil.Process(pid)
        # psutil counts a process's CPU % from the previous call on the same object: keep them.
        self._processes: dict[int, psutil.Process] = {pid: self.root}
        self._tree_read: float | None = None  # the first real sample reads it: priming must stay cheap

    @property
    def pids(self) -> set[int]:
        return set(self._processes)

    def sample(self, now: float | None = None, *, prime: bool = False) -> tuple[float, int] | None:
        """``(cpu %, rss bytes)`` since the previous call, or None once the rank's process is gone.

        ``prime``: only start the CPU count of the processes known (a session's cell starts: a
        20 ms cell must not pay for a read of the process tree)."""
        now = time.monotonic() if now is None else now
        if not prime and (self._tree_read is None or now - self._tree_read >= TREE_INTERVAL):
            self._tree_read = now
            try:
                for child in self.root.children(recursive=True):
                    self._processes.setdefault(child.pid, child)
            except psutil.Error:
                return None  # the rank itself is gone
        cpu, rss = 0.0, 0
        for pid, process in list(self._processes.items()):
            try:
                with process.oneshot():
                    cpu += process.cpu_percent(None)
                    memory = process.memory_info().rss
            except psutil.Error:
                if process is self.root:
                    return None
                del self._processes[pid]  # a worker that ended
                continue
            if process is self.root and memory == 0:
                return None  # exited, not reaped yet: a zombie reads as no memory, and is no sample
            rss += memory
        return cpu, rss


def visible_gpus(env: dict[str, str]) -> list[str] | None:
    """The GPUs a rank with environment ``env`` uses, as NVML names them (an index or a UUID);
    None when its environment does not say (then every GPU its processes run on)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    devices = [device.strip() for device in visible.split(",") if device.strip()]
    chosen = env.get(CUDA_DEVICE_ENV)
    if chosen is not None and chosen.isdigit() and int(chosen) < len(devices):
        return [devices[int(chosen)]]
    return devices


class Gpus:
    """NVML, opened once per sampler; ``nvml`` is the ``pynvml`` module, or a stand-in with its API."""

    def __init__(self, nvml, devices: list[str] | None):
        self.nvml = nvml
        nvml.nvmlInit()
        self._handles: list[tuple[str, object, bool]] = []  # (name, handle, always shown)
        try:
            if devices is None:
                self._handles = [(str(i), nvml.nvmlDeviceGetHandleByIndex(i), False)
                                 for i in range(nvml.nvmlDeviceGetCount())]
            else:
                for device in devices:
                    handle = (nvml.nvmlDeviceGetHandleByIndex(int(device)) if device.isdigit()
                              else nvml.nvmlDeviceGetHandleByUUID(device))
                    self._handles.append((device, handle, True))
        except BaseException:
            self.close()  # NVML counts its inits: each needs its shutdown
            raise

    @classmethod
    def open(cls, devices: list[str] | None) -> Gpus | None:
        """NVML's view of this host's GPUs, or None without pynvml, a driver or a GPU."""
        if devices == []:
            return None  # CUDA_VISIBLE_DEVICES="": the rank sees no GPU
        try:
            import pynvml
        except ImportError:
            return None
        try:
            gpus = cls(pynvml, devices)
        except Exception:  # pynvml.NVMLError: no driver, no device, a UUID it does not know
            return None
        return gpus if gpus._handles else None

    def sample(self, pids: set[int]) -> list[dict]:
        nvml, usage = self.nvml, []
        for name, handle, always in self._handles:
            try:
                mine = [p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid in pids]
                if not mine and not always:
                    continue  # a GPU the rank was not given and does not use
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
            except Exception:  # pynvml.NVMLError: the device fell off the bus, or a call it does not support
                continue
            rank_used = sum(mine) if mine and all(isinstance(m, int) for m in mine) else None
            usage.append({"index": name, "util": float(util), "used": int(memory.used), "total": int(memory.total),
                          "rank_used": rank_used})
        return usage

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:
            pass


class Sampler:
    """Samples one rank while it runs a cell (``busy``/``idle``) and sends each sample with ``send``."""

    def __init__(self, pid: int, row: int, send: Callable[[dict], None], env: dict[str, str],
                 interval: float = SAMPLE_INTERVAL):
        self.row = row
        self.interval = interval
        self._pid = pid
        self._env = env
        self._send = send
        self._busy = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hvdmagic-resources-{row}", daemon=True)
        self._thread.start()

    def busy(self) -> None:
        """The rank runs a cell: sample it."""
        self._busy.set()

    def idle(self) -> None:
        """A session's rank finished its cell: nothing to sample until the next one."""
        self._busy.clear()

    def stop(self) -> None:
        self._stopped.set()
        self._busy.set()  # wakes the thread, which sees the stop

    def _run(self) -> None:
        try:
            tree = ProcessTree(self._pid)
        except psutil.Error:
            return  # the rank is gone already
        gpus = None
        try:
            while True:
                self._busy.wait()
                if self._stopped.is_set() or self._stopped.wait(PRIME_DELAY):
                    return
                if not self._busy.is_set():
                    continue  # a quick cell, over already
                if gpus is None:
                    gpus = Gpus.open(visible_gpus(self._env)) or False  # False: looked, none
                if tree.sample(prime=True) is None:  # the first CPU % counts from here
                    return
                while not self._stopped.wait(self.interval) and self._busy.is_set():
                    sample = tree.sample()
                    if sample is None:
                        return
                    cpu, rss = sample
                    self._send(protocol.resources(self.row, round(cpu, 1), rss, gpus.sample(tree.pids) if gpus else []))
        finally:
            if gpus:
                gpus.close()
