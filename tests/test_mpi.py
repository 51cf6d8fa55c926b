"""--controller mpi: Open MPI's mpirun starts the ranks through the Spark tasks, with no ssh.

The standalone-cluster variant is in test_cluster.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import tempfile
import threading

import pytest
from conftest import run
from procs import rank_processes, wait_until_no_mpi_processes

from hvdmagic.errors import JobFailed, LaunchError
from hvdmagic.protocol import read_message

# Only the tests that start mpirun need Open MPI; the rest (its absence included) run everywhere.
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None,
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


@needs_mpirun
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
    wait_until_no_mpi_processes()


@needs_mpirun
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
    wait_until_no_mpi_processes()

    result, error = run(ip, "%%horovod --np 2 --controller mpi\nimport horovod.torch as hvd\nhvd.init()\nhvd.size()")
    assert error is None and result == 2


@pytest.mark.unit
def test_missing_mpirun_is_a_clear_error(ip, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no mpirun anywhere
    _, error = run(ip, "%%horovod --np 2 --controller mpi\n1")
    assert isinstance(error, LaunchError)
    message = str(error)
    assert "mpirun" in message and "apt-get install -y openmpi-bin libopenmpi-dev" in message
    assert "\n" not in message.strip()


@pytest.mark.unit
def test_unknown_controller_is_a_usage_error(ip):
    from IPython.core.error import UsageError

    _, error = run(ip, "%%horovod --np 2 --controller nccl\n1")
    assert isinstance(error, UsageError), error
    # argparse's own message (quoting the choices or not, by Python version).
    assert re.fullmatch(r"argument --controller: invalid choice: 'nccl' \(choose from '?gloo'?, '?mpi'?\)",
                        str(error)), error


@pytest.mark.unit
def test_mpirun_command_names_every_host_as_remote_and_stays_on_the_driver_network(monkeypatch):
    from hvdmagic.launch import mpi

    monkeypatch.delenv("OMPI_MCA_btl_tcp_if_include", raising=False)
    monkeypatch.setenv("OMPI_MCA_oob_tcp_if_include", "eth9")  # the user's choice wins
    command = mpi.mpirun_command([3, 1], "127.0.0.1")
    assert command[command.index("-H") + 1] == "hvdmagic-host-0:3,hvdmagic-host-1:1"
    assert command[command.index("-np") + 1] == "4"
    assert [mpi.host_index(mpi.host_alias(i)) for i in range(3)] == [0, 1, 2]
    assert mpi.host_index("some-other-host") is None
    joined = " ".join(command)
    assert "btl_tcp_if_include 127.0.0.0/8" in joined
    assert "oob_tcp_if_include" not in joined
    assert "plm_rsh_no_tree_spawn 1" in joined  # only the driver can run the agent
    assert ("--allow-run-as-root" in command) == (os.geteuid() == 0)


@pytest.mark.unit
def test_rank_socket_hands_the_pipes_only_to_a_shim_of_the_job(tmp_path, monkeypatch):
    """A local process without the job's token gets nothing; the shim gets the rank's pipes."""
    from hvdmagic.task import mpi

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    listener = mpi.listen_for_rank("job1", 0)
    assert stat.S_IMODE(mpi.socket_dir("job1").stat().st_mode) == 0o700
    token = mpi.rank_token(b"s" * 32, "job1")
    aborted = threading.Event()
    adopted = []
    events_r, events_w = os.pipe()
    waiter = threading.Thread(target=lambda: adopted.append(
        mpi.adopt_rank(listener, token, {"RANK_ENV": "1"}, events_w, aborted)))
    waiter.start()
    path = str(mpi.socket_dir("job1") / "rank-0.sock")
    rank = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        intruder = socket.socket(socket.AF_UNIX)
        intruder.connect(path)
        intruder.sendall(json.dumps({"token": "guess"}).encode() + b"\n")
        data, fds, _, _ = socket.recv_fds(intruder, 1, 4)
        assert (data, fds) == (b"", []), "a process without the token got the rank's pipes"

        shim = socket.socket(socket.AF_UNIX)
        shim.connect(path)
        shim.sendall(json.dumps({"token": token}).encode() + b"\n")
        _, fds, _, _ = socket.recv_fds(shim, 1, 4)
        assert len(fds) == 4
        assert read_message(shim) == {"env": {"RANK_ENV": "1"}, "cwd": os.getcwd()}
        shim.sendall(json.dumps({"pid": rank.pid}).encode() + b"\n")
        waiter.join(timeout=10)
        (proc,) = adopted
        assert proc.pid == rank.pid and proc.poll() is None
        # The shim's end of the rank's stdout reaches the supervisor's.
        os.write(fds[1], b"hello\n")
        assert proc.stdout.read1(100) == b"hello\n"
        shim.sendall(json.dumps({"code": 3}).encode() + b"\n")
        assert proc.wait(timeout=10) == 3
        for fd in fds:
            os.close(fd)
    finally:
        aborted.set()
        rank.kill()
        rank.wait()
        mpi.close_listener(listener)
        os.close(events_r)
        os.close(events_w)
    assert not mpi.socket_dir("job1").exists()
