"""%%horovod on a real Spark standalone cluster (master + 2 workers on 127.0.0.1)."""

from __future__ import annotations

import re
import shutil

import pytest
from conftest import run
from helpers import record_slot_waits, spark_cluster, wait_until
from procs import rank_processes, wait_until_no_mpi_processes

import hvdmagic
from hvdmagic.errors import LaunchError
from hvdmagic.launch import slots

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster_shell(shell, tmp_path_factory):
    """The shell, on a cluster of 2 workers with 2 cores and 2 fake GPUs each; a task takes 1 GPU."""
    with spark_cluster(tmp_path_factory.mktemp("spark-cluster"), workers=2, cores=2, gpus=2, task_gpus=1,
                       app="hvdmagic-cluster-test", conf={"spark.executorEnv.CUDA_VISIBLE_DEVICES": "7,6,5,4"}):
        yield shell


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
    wait_until_no_mpi_processes()


def test_slot_check_on_the_cluster_fails_fast(cluster_shell, monkeypatch):
    # 2 workers x 2 GPUs, 1 GPU per task: 4 slots, all registered, and the cluster is not growing.
    waits = record_slot_waits(monkeypatch)
    _, error = run(cluster_shell, "%%horovod --np 5\nx = 1")
    assert isinstance(error, LaunchError)
    assert "--np 5 needs 5 barrier task slots at once, but this Spark cluster offers 4" in str(error)
    assert "1 GPU(s)" in str(error)
    assert re.search(r"and no more were on their way after \d+ s\.", str(error)), str(error)
    # Fast: the check saw nothing on its way, so it neither waited for slots on their way nor ran out its bound.
    assert [(w.slots, w.coming, w.waited_for, w.ran_out) for w in waits] == [(4, None, None, False)], waits


@pytest.mark.parametrize("cores_max", ["4", None], ids=["cores-max", "master-only"])
def test_a_worker_that_joins_after_the_cell_starts_still_gets_its_ranks(ip, tmp_path, monkeypatch, cores_max):
    """The cluster's second worker starts only once the cell's slot check finds 2 of 4 slots, and the
    check waits for the slots on their way instead of failing; the cell runs on both executors.

    With spark.cores.max the application says it wants 4 cores from the start, so the check waits
    while the worker's JVM starts. Without it only the master can tell, once the worker has
    registered, that it is starting an executor (the seconds a loaded machine once needed longer
    than the old 3 s). Last in the module: it ends the module cluster's session (one SparkContext
    per process)."""
    with spark_cluster(tmp_path, workers=2, start=1, app="hvdmagic-late-worker-test",
                       conf={"spark.cores.max": cores_max} if cores_max else {}) as (cluster, spark):
        spark.conf.set("spark.hvdmagic.slotWait", "180")  # a loaded machine starts JVMs slowly
        tracker = spark.sparkContext.statusTracker()
        wait_until(lambda: len(tracker.getExecutorInfos()) >= 2,  # the driver, and the first worker's executor
                   90, "the first worker's executor did not register")

        seen, wait = [], slots.wait

        def start_the_last_worker(np, free, *args, **kwargs):
            seen.append(free)
            cluster.start_worker(1)
            if cores_max is None:
                cluster.wait_for_workers(2)  # the master then starts an executor there at once
            return wait(np, free, *args, **kwargs)

        monkeypatch.setattr(slots, "wait", start_the_last_worker)
        result, error = run(ip, """%%horovod --np 4
import os, horovod.torch as hvd
hvd.init()
hvd.allgather_object((hvd.rank(), os.getcwd()))
""")
        assert error is None, error
        assert seen == [2], f"the slot check saw {seen} free slots when it began to wait, not [2]"
        assert sorted(rank for rank, _ in result) == [0, 1, 2, 3]
        assert len({cwd for _, cwd in result}) == 2, f"ranks ran in {set(cwd for _, cwd in result)}"
        notes = [note for note in hvdmagic.last_run().notes if note.startswith("the slot check waited")]
        if cores_max:  # names the last witness; without one, the executor may register before the first look
            assert notes, f"the run's record does not say the check waited: {hvdmagic.last_run().notes}"
        assert rank_processes() == []
