"""Where each rank sits, and the Horovod environment that tells it so.

Ranks are numbered host by host in the order the hosts first appear among the
barrier tasks, so ranks sharing a host are contiguous, as Horovod expects.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Slot:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    host: str

    def to_dict(self) -> dict:
        return asdict(self)


def compute_layout(task_hosts: list[str]) -> list[Slot]:
    """One Slot per task, indexed by task (partition) number.

    ``task_hosts[i]`` is the host key of barrier task i. The result is the same
    on every task and on the driver, because it depends only on that list.
    """
    if not task_hosts:
        raise ValueError("a layout needs at least one task")
    hosts: dict[str, list[int]] = {}
    for task, host in enumerate(task_hosts):
        hosts.setdefault(host, []).append(task)
    host_order = list(hosts)
    size = len(task_hosts)
    slots: list[Slot | None] = [None] * size
    rank = 0
    for host in host_order:
        tasks = hosts[host]
        for local_rank, task in enumerate(tasks):
            peers = [h for h in host_order if len(hosts[h]) > local_rank]
            slots[task] = Slot(
                rank=rank,
                size=size,
                local_rank=local_rank,
                local_size=len(tasks),
                cross_rank=peers.index(host),
                cross_size=len(peers),
                host=host,
            )
            rank += 1
    return slots  # type: ignore[return-value]


def horovod_plan(slots: list[Slot]):
    """The same layout as horovod's SlotInfo list, for its RendezvousServer."""
    from horovod.runner.common.util.hosts import SlotInfo

    return [
        SlotInfo(hostname=s.host, rank=s.rank, local_rank=s.local_rank, cross_rank=s.cross_rank,
                 size=s.size, local_size=s.local_size, cross_size=s.cross_size)
        for s in sorted(slots, key=lambda s: s.rank)
    ]


def visible_devices(slots: list[Slot], task_gpus: list[list[str]], task: int) -> tuple[str, int] | None:
    """``CUDA_VISIBLE_DEVICES`` for a task's rank, and where its own first GPU sits in it.

    Every rank on a host sees the GPUs of all the job's tasks on that host, in
    local-rank order. With one GPU per task (the usual set-up) a rank's own GPU is
    then device ``hvd.local_rank()``, which is what Horovod code pins to, and NCCL
    can still reach its peers. None when Spark assigned no GPUs.
    """
    if not any(task_gpus):
        return None
    mine = slots[task]
    peers = sorted((s.local_rank, t) for t, s in enumerate(slots) if s.host == mine.host)
    devices: list[str] = []
    first = 0
    for local_rank, peer in peers:
        if local_rank == mine.local_rank:
            first = len(devices)
        devices.extend(task_gpus[peer])
    return ",".join(devices), first


def _spark_only(entry: str) -> bool:
    name = os.path.basename(entry.rstrip("/"))
    return name.endswith(".jar") or name == "pyspark.zip" or (name.startswith("py4j-") and name.endswith(".zip"))


def rank_base_environment(task_env: dict[str, str]) -> dict[str, str]:
    """The task's environment for its rank, without Spark's own PYTHONPATH entries.

    A Spark Python worker has pyspark.zip, py4j and a 16 MB Spark jar on its
    PYTHONPATH. Ranks need none of them, and zipimport consulting them made every
    rank's ``import torch`` 0.5 s slower. The user's own entries (--py-files) stay.
    """
    env = dict(task_env)
    path = env.get("PYTHONPATH")
    if path:
        kept = [entry for entry in path.split(os.pathsep) if entry and not _spark_only(entry)]
        if kept:
            env["PYTHONPATH"] = os.pathsep.join(kept)
        else:
            del env["PYTHONPATH"]
    return env


def rank_environment(slot: Slot, rendezvous: tuple[str, int], iface: str, controller: str = "gloo") -> dict[str, str]:
    """Horovod's variables for one rank process.

    Under MPI, Open MPI tells each rank where it sits; under Gloo these variables do.
    """
    if controller == "mpi":
        env = {"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "mpi"}
    else:
        env = {
            "HOROVOD_RANK": str(slot.rank),
            "HOROVOD_SIZE": str(slot.size),
            "HOROVOD_LOCAL_RANK": str(slot.local_rank),
            "HOROVOD_LOCAL_SIZE": str(slot.local_size),
            "HOROVOD_CROSS_RANK": str(slot.cross_rank),
            "HOROVOD_CROSS_SIZE": str(slot.cross_size),
            "HOROVOD_HOSTNAME": slot.host,
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous[0],
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous[1]),
            "HOROVOD_GLOO_IFACE": iface,
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
        }
    env["PYTHONUNBUFFERED"] = "1"
    if "OMP_NUM_THREADS" not in os.environ:
        # Without this every rank's torch starts one thread per core, and ranks
        # sharing a host fight over the same cores.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // slot.local_size))
    return env
