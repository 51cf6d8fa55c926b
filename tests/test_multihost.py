"""Two simulated hosts: Spark workers in their own network namespaces (see netns.py).

Ranks on different hosts must get the layout of their host (local_rank,
local_size, cross_rank, cross_size) and talk over the interface that reaches
the other host, never ``lo``: only the test's own 10.77.N.0/24 joins the namespaces.
"""

from __future__ import annotations

import shutil

import netns
import pytest
from conftest import run
from helpers import spark_cluster
from procs import rank_processes, wait_until_no_mpi_processes

_why_not = netns.available()
pytestmark = [pytest.mark.cluster,
              pytest.mark.skipif(_why_not is not None, reason=f"no simulated hosts: {_why_not}")]

LAYOUT_CELL = """%%horovod --np 4{flags}
import os, torch, horovod.torch as hvd
hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
row = (hvd.rank(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(),
       os.readlink("/proc/self/ns/net"), sorted(os.listdir("/sys/class/net")), total,
       os.environ.get("HOROVOD_GLOO_IFACE"))
hvd.allgather_object(row)
"""


@pytest.fixture(scope="module")
def two_host_shell(shell, tmp_path_factory):
    """The shell, on a cluster of one 2-core worker on each simulated host; the driver on their network."""
    with netns.Hosts() as network, spark_cluster(tmp_path_factory.mktemp("two-hosts"), cores=2,
                                                    host=network.driver, worker_hosts=network.hosts,
                                                    app="hvdmagic-two-hosts"):
        shell.user_ns["DRIVER"] = network.driver
        try:
            yield shell
        finally:
            del shell.user_ns["DRIVER"]


def _check_layout(rows):
    rows = sorted(rows)
    assert [r[0] for r in rows] == [0, 1, 2, 3]
    assert all(r[7] == 6.0 for r in rows), "wrong allreduce result"
    hosts = [r[5] for r in rows]
    assert len(set(hosts)) == 2, f"the ranks ran in {set(hosts)}, not in both simulated hosts"
    # Ranks sharing a host are contiguous, as Horovod expects: 0,1 on one host, 2,3 on the other.
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3]
    assert [(r[1], r[2], r[3], r[4]) for r in rows] == [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    veths = ([netns.inside_interface(0)], [netns.inside_interface(1)])
    for row in rows:
        assert [name for name in row[6] if name != "lo"] in veths, row[6]


def test_gloo_layout_follows_the_hosts(two_host_shell):
    result, error = run(two_host_shell, LAYOUT_CELL.format(flags=""))
    assert error is None, error
    _check_layout(result)
    for row in result:  # Gloo is told the interface that holds the rank's own address
        assert row[8] == next(name for name in row[6] if name != "lo"), row
    assert rank_processes() == []


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI is not installed")
def test_mpi_layout_follows_the_hosts(two_host_shell):
    result, error = run(two_host_shell, LAYOUT_CELL.format(flags=" --controller mpi"))
    assert error is None, error
    _check_layout(result)
    assert rank_processes() == []
    wait_until_no_mpi_processes()


DATA_CELL = """%%horovod --np 4
import os, horovod.torch as hvd
hvd.init()
hvd.allgather_object((hvd.rank(), os.readlink("/proc/self/ns/net"), float(X.sum()), X.flags.writeable))
"""


def test_a_large_global_goes_to_each_host_once(two_host_shell):
    """Four ranks on two hosts: each host receives X's 48 MB once (a host's first rank fetches it,
    its second maps the same file), the kernel sends them once (the second host reads them from
    the first: test_fanout.py), and a second cell reading the unchanged X sends nothing."""
    import numpy as np

    from hvdmagic import last_run

    x = np.random.default_rng(7).random(6 << 20)  # 48 MiB of float64
    two_host_shell.user_ns["X"] = x
    try:
        result, error = run(two_host_shell, DATA_CELL)
        assert error is None, error
        assert len({row[1] for row in result}) == 2, "the ranks did not run on both hosts"
        assert all(row[2] == float(x.sum()) and row[3] for row in result), result
        shipping = last_run().shipping
        assert shipping is not None and shipping["done"], shipping
        assert sorted(shipping["hosts"].values()) == [x.nbytes, x.nbytes], shipping  # once per host, not per rank
        assert len(shipping["hosts"]) == 2, shipping
        assert shipping["from_kernel"] == x.nbytes, shipping
        result, error = run(two_host_shell, DATA_CELL)
        assert error is None, error
        assert last_run().shipping is None, "the hosts had X already, yet it was sent again"
        x[0] += 1.0  # changed in place: same object, new content
        result, error = run(two_host_shell, DATA_CELL)
        assert error is None, error
        assert all(row[2] == float(x.sum()) for row in result), "a rank read the old X"
        assert sorted(last_run().shipping["hosts"].values()) == [x.nbytes, x.nbytes]
    finally:
        del two_host_shell.user_ns["X"]


TORCHRUN_CELL = """%%torchrun --np 4
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
row = (dist.get_rank(), int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]),
       int(os.environ["GROUP_RANK"]), int(os.environ["GROUP_WORLD_SIZE"]),
       os.readlink("/proc/self/ns/net"), sorted(os.listdir("/sys/class/net")), t.item(),
       os.environ["GLOO_SOCKET_IFNAME"], os.environ["MASTER_ADDR"])
rows = [None] * dist.get_world_size()
dist.all_gather_object(rows, row)
rows
"""


def test_torchrun_layout_follows_the_hosts_and_every_rank_reaches_the_store(two_host_shell):
    """The store lives at the driver's address on the namespaces' network, which every host reaches."""
    result, error = run(two_host_shell, TORCHRUN_CELL)
    assert error is None, error
    _check_layout(result)
    for row in result:
        assert row[8] == next(name for name in row[6] if name != "lo"), row  # Gloo's interface, never lo
        assert row[9] == two_host_shell.user_ns["DRIVER"], row  # MASTER_ADDR: the driver, reachable from both
    assert rank_processes() == []
