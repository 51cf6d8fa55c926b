"""%%horovod on a real Spark standalone cluster (master + 2 workers on 127.0.0.1)."""

from __future__ import annotations

import shutil

import pytest
from cluster import StandaloneCluster, stop_active_session
from conftest import run
from procs import mpi_processes, rank_processes

from hvdmagic.errors import LaunchError


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    stop_active_session()  # one SparkContext per process: the embedded one must go
    cluster = StandaloneCluster(tmp_path_factory.mktemp("spark-cluster")).start()
    yield cluster
    stop_active_session()
    cluster.stop()


@pytest.fixture(scope="module")
def cluster_shell(shell, cluster):
    shell.user_ns["MASTER"] = cluster.url
    outcome = shell.run_cell("""
import os, sys
from pyspark.sql import SparkSession
os.environ["PYSPARK_PYTHON"] = sys.executable  # the executors' Python: this venv, with hvdmagic
spark = (SparkSession.builder.master(MASTER).appName("hvdmagic-cluster-test")
         .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.executor.cores", "2").config("spark.executor.memory", "1g")
         .config("spark.executor.resource.gpu.amount", "2").config("spark.task.resource.gpu.amount", "1")
         .config("spark.executorEnv.CUDA_VISIBLE_DEVICES", "7,6,5,4")
         .getOrCreate())
""")
    assert outcome.error_in_exec is None, outcome.error_in_exec
    return shell


def test_four_ranks_across_both_executors(cluster_shell):
    result, error = run(cluster_shell, """%%horovod --np 4
import os, torch, horovod.torch as hvd
hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
row = (hvd.rank(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(), os.getcwd(),
       os.environ["CUDA_VISIBLE_DEVICES"], os.environ["HVDMAGIC_TASK_GPUS"], total)
hvd.allgather_object(row)
""")
    assert error is None, error
    rows = sorted(result)
    assert [r[0] for r in rows] == [0, 1, 2, 3]
    assert all(r[8] == 6.0 for r in rows), "wrong allreduce result"
    # Both workers sit on 127.0.0.1: one host, four local ranks.
    assert [(r[1], r[2], r[3], r[4]) for r in rows] == [(i, 4, 0, 1) for i in range(4)]
    executors = {r[5] for r in rows}  # each executor runs in its own work directory
    assert len(executors) == 2, f"ranks ran in {executors}, not in both executors"

    # GPU pinning: Spark's addresses are remapped through the executors' CUDA_VISIBLE_DEVICES
    # (7,6,5,4), and each rank's own GPU is device hvd.local_rank() of what it sees.
    physical = {"0": "7", "1": "6", "2": "5", "3": "4"}
    for _rank, local_rank, *_, visible, own, _ in rows:
        assert visible.split(",")[local_rank] == own
        assert own in physical.values()
    assert sorted(r[7] for r in rows) == sorted(physical.values())
    assert len({r[6] for r in rows}) == 1  # every rank on the host sees the same ordered list
    assert rank_processes() == []


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed")
def test_mpi_controller_across_both_executors(cluster_shell):
    result, error = run(cluster_shell, """%%horovod --np 4 --controller mpi
import os, torch, horovod.torch as hvd
hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
row = (hvd.rank(), hvd.local_rank(), hvd.local_size(), hvd.mpi_enabled(), os.getcwd(),
       os.environ["HVDMAGIC_TASK_GPUS"], total)
hvd.allgather_object(row)
""")
    assert error is None, error
    rows = sorted(result)
    assert [r[:4] for r in rows] == [(i, i, 4, True) for i in range(4)]
    assert all(r[6] == 6.0 for r in rows), "wrong allreduce result"
    # mpirun's one daemon for the host started all four, yet each rank works in its own task's executor.
    assert len({r[4] for r in rows}) == 2, f"ranks ran in {set(r[4] for r in rows)}, not in both executors"
    assert sorted(r[5] for r in rows) == ["4", "5", "6", "7"]
    assert rank_processes() == []
    assert mpi_processes() == []


def test_slot_check_on_the_cluster_fails_fast(cluster_shell):
    # 2 workers x 2 GPUs, 1 GPU per task: 4 slots.
    _, error = run(cluster_shell, "%%horovod --np 5\nx = 1")
    assert isinstance(error, LaunchError)
    assert "--np 5 needs 5 barrier task slots at once, but this Spark cluster offers 4" in str(error)
    assert "1 GPU(s)" in str(error)
