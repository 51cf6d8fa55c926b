"""--controller mpi: Open MPI's mpirun starts the ranks through the Spark tasks, with no ssh.

The standalone-cluster variant is in test_cluster.py.
"""

from __future__ import annotations

import shutil

import pytest

from conftest import run
from hvdmagic.errors import JobFailed, LaunchError
from procs import mpi_processes, rank_processes

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None,
                                reason="Open MPI is not installed (the README's set-up installs it as root)")

MPI_CELL = """%%horovod --np {np} --controller mpi
import os, torch, horovod.torch as hvd
hvd.init()
print(f"hello from rank {{hvd.rank()}}")
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
row = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.mpi_enabled(), hvd.gloo_enabled(),
       os.environ.get("OMPI_COMM_WORLD_RANK"), os.environ["HOROVOD_CONTROLLER"], total)
hvd.allgather_object(row)
"""


@pytest.mark.parametrize("np", [2, -2], ids=["spark", "local"])
def test_ranks_run_under_mpirun_and_allreduce(ip, capfd, np):
    result, error = run(ip, MPI_CELL.format(np=np))
    assert error is None, error
    n = abs(np)
    assert sorted(result) == [(r, n, r, n, True, False, str(r), "mpi", float(n * (n + 1) // 2)) for r in range(n)]
    out = capfd.readouterr().out
    for r in range(n):
        assert f"[rank {r}] hello from rank {r}" in out  # output still travels through the task's supervisor
    assert rank_processes() == []
    assert mpi_processes() == [], "mpirun, a daemon or a shim outlived the cell"


def test_failing_rank_under_mpi_is_named_and_the_next_cell_works(ip):
    ip.user_ns["answer"] = "untouched"
    _, error = run(ip, """%%horovod --np 2 --controller mpi --out answer
import torch, horovod.torch as hvd
hvd.init()
if hvd.rank() == 1:
    raise ValueError("rank one is broken")
hvd.allreduce(torch.ones(1))
""")
    assert isinstance(error, JobFailed), error
    assert error.failures[0].rank == 1
    assert "ValueError: rank one is broken" in str(error)
    assert ip.user_ns["answer"] == "untouched"
    assert rank_processes() == []
    assert mpi_processes() == []

    result, error = run(ip, "%%horovod --np 2 --controller mpi\nimport horovod.torch as hvd\nhvd.init()\nhvd.size()")
    assert error is None and result == 2


def test_missing_mpirun_is_a_clear_error(ip, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no mpirun anywhere
    _, error = run(ip, "%%horovod --np 2 --controller mpi\n1")
    assert isinstance(error, LaunchError)
    message = str(error)
    assert "mpirun" in message and "apt-get install -y openmpi-bin libopenmpi-dev" in message
    assert "\n" not in message.strip()


def test_unknown_controller_is_a_usage_error(ip):
    from IPython.core.error import UsageError

    _, error = run(ip, "%%horovod --np 2 --controller nccl\n1")
    assert isinstance(error, UsageError), error
