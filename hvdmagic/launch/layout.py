"""Where each rank sits: rank, local rank and cross rank from the tasks' hosts.

Ranks are numbered host by host in the order the hosts first appear among the
barrier tasks, so ranks sharing a host are contiguous, as Horovod expects.
"""

from __future__ import annotations

from hvdmagic.protocol import Slot


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
