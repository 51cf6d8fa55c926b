"""The environment of a rank process: the task's own, minus Spark's paths, plus Horovod's place."""

from __future__ import annotations

import os

from hvdmagic.protocol import LEGACY_KERAS_SET_ENV, Framework, Slot


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


def rank_environment(slot: Slot, rendezvous: tuple[str, int], iface: str, controller: str = "gloo",
                     framework: str = Framework.HOROVOD, job_id: str = "",
                     job_env: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that tell one rank process where it sits and how to join the others
    (``job_env``: the variables the job gives every rank itself, which these do not override).

    Horovod: under MPI, Open MPI tells each rank where it sits; under Gloo these
    variables do. torch.distributed: the variables torchrun gives its workers.
    """
    if framework == Framework.TORCH:
        env = torchrun_environment(slot, rendezvous, iface, job_id)
    elif controller == "mpi":
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
    env.update(keras_environment(job_env or {}))
    if "OMP_NUM_THREADS" not in os.environ:
        # Without this every rank's torch starts one thread per core, and ranks
        # sharing a host fight over the same cores.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // slot.local_size))
    return env


def torchrun_environment(slot: Slot, store: tuple[str, int], iface: str, job_id: str) -> dict[str, str]:
    """What torchrun gives a worker, with the kernel's store as its agent's (launch.torch_store).

    ``init_process_group(backend, init_method="env://")`` then joins as a client, rank 0
    included; frameworks that look for TorchElastic (Lightning) find its markers.
    """
    return {
        "RANK": str(slot.rank),
        "WORLD_SIZE": str(slot.size),
        "LOCAL_RANK": str(slot.local_rank),
        "LOCAL_WORLD_SIZE": str(slot.local_size),
        "GROUP_RANK": str(slot.cross_rank),  # torchrun's node index
        "GROUP_WORLD_SIZE": str(slot.cross_size),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(slot.rank),
        "ROLE_WORLD_SIZE": str(slot.size),
        "MASTER_ADDR": store[0],
        "MASTER_PORT": str(store[1]),
        "TORCHELASTIC_RUN_ID": job_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        # The interface the ranks reach each other on, for Gloo and NCCL alike.
        "GLOO_SOCKET_IFNAME": iface,
        "NCCL_SOCKET_IFNAME": iface,
    }


def keras_environment(job_env: dict[str, str]) -> dict[str, str]:
    """``TF_USE_LEGACY_KERAS=1`` where TensorFlow would otherwise give the ranks Keras 3, unless the user
    (this process's environment) or the job (``job_env``: a KerasEstimator, for its model's Keras) chose.

    horovod.tensorflow.keras's DistributedOptimizer does not average gradients under
    Keras 3 (docs/frameworks.md); with tf_keras installed, this selects Keras 2. Found
    without importing TensorFlow (seconds): the metadata of what is installed.
    """
    from importlib import metadata

    if "TF_USE_LEGACY_KERAS" in os.environ or "TF_USE_LEGACY_KERAS" in job_env:
        return {}  # the user's or the job's choice
    try:
        metadata.version("tf_keras")
        major, minor = (int(part) for part in metadata.version("tensorflow-cpu" if _has("tensorflow-cpu")
                                                              else "tensorflow").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return {}
    if (major, minor) < (2, 16):
        return {}
    return {"TF_USE_LEGACY_KERAS": "1", LEGACY_KERAS_SET_ENV: "1"}


def _has(distribution: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True
