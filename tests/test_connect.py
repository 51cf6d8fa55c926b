"""Every magic on a Spark Connect session: a real Connect server in its own process, a real kernel.

The server is pyspark's own (its SparkConnectServer through ``bin/spark-submit``, as
``sbin/start-connect-server.sh`` runs it: the jar the venv's pyspark ships)
with a ``local[4]`` master, bound to 127.0.0.1; the kernel is a real Jupyter kernel that
connects with ``SparkSession.builder.remote("sc://127.0.0.1:P")``, so no JVM runs in it. The
ranks are real Horovod (or torch.distributed) processes over Gloo (or MPI), descendants of the
server's JVM, which is where this module looks for any left behind. The server's UI listens on
127.0.0.1 too: its REST API is how a test sees which stages (by hvdmagic's operation tag) the
server still runs or queues. The ``cluster`` tests start the server on a standalone cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import connect_server
import psutil
import pytest
from helpers import (
    StandaloneCluster,
    execute,
    iopub_messages,
    start_kernel,
    stop_kernel,
    wait_for_reply,
    wait_until,
)
from ports import holding, reserve_port
from procs import alive, rank_processes, registered_rank, wait_until_gone, wait_until_no_mpi_processes
from test_elastic import SPARE_WORKER, _check_training, _kill_the_worker_of

SERVER_START = 120  # seconds the Connect server gets to listen: a JVM on a busy 2-core machine
CORES = 4
TRAIN = """%%horovod --np 2
import torch, horovod.torch as hvd
hvd.init()
print(f"ready {hvd.rank()}/{hvd.size()}", flush=True)
hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
"""


class ConnectServer(connect_server.ConnectServer):
    def __init__(self, workdir: Path, master: str = f"local[{CORES}]", conf: dict[str, str] | None = None):
        super().__init__(workdir, master, conf)

    def ranks(self) -> list[int]:
        """The rank processes that run under the server (its Python workers' children)."""
        return [proc.pid for proc in rank_processes(self.proc.pid)]

    def running_tags(self) -> set[str]:
        """hvdmagic's operation tags on the Spark jobs that run (or wait for slots) on the server now.

        Read from the server's own UI (its REST API, enabled by the module's server): the server's
        view, not the kernel's. Connect puts each user tag in a job tag of its own
        (``SparkConnect_OperationTag_User_..._Session_..._Tag_<tag>``)."""
        base = f"http://127.0.0.1:{self.ui_port()}/api/v1/applications"
        # Generous: the first request starts the REST API (Jersey), seconds on a busy machine.
        with urllib.request.urlopen(base, timeout=60) as reply:
            app = json.load(reply)[0]["id"]
        with urllib.request.urlopen(f"{base}/{app}/jobs?status=running", timeout=60) as reply:
            jobs = json.load(reply)
        return {tag[tag.index("hvdmagic-"):] for job in jobs for tag in job.get("jobTags", []) if "hvdmagic-" in tag}

    def ui_port(self) -> int:
        """The port the server's UI bound, from its log (the one asked for may have been taken)."""
        bound = re.search(r"Successfully started service 'SparkUI' on port (\d+)", self.log.read_text())
        assert bound, f"the Connect server's log does not say where its UI listens: {self.log}"
        return int(bound[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The UI (on 127.0.0.1: SPARK_LOCAL_IP) lets a test see the server's running jobs by their tags.
    server = ConnectServer(tmp_path_factory.mktemp("connect"), conf={"spark.ui.enabled": "true",
                                                                     "spark.ui.port": "0"})
    server.wait_listening(SERVER_START)
    yield server
    server.stop()


class Kernel:
    """A real Jupyter kernel whose active Spark session is the Connect server's."""

    def __init__(self, url: str):
        self.manager, self.client = start_kernel(PYSPARK_PYTHON=sys.executable)
        self.ok("%load_ext hvdmagic\nimport hvdmagic\nfrom pyspark.sql import SparkSession\n"
                 f"spark = SparkSession.builder.remote({url!r}).getOrCreate()\nspark.range(1).count()", 120)

    def run(self, code: str, timeout: float = 180, on_output=None) -> tuple[dict, str]:
        reply, texts = execute(self.client, code, timeout, on_output)
        return reply, "".join(texts)

    def ok(self, code: str, timeout: float = 180) -> str:
        reply, text = self.run(code, timeout)
        assert reply["status"] == "ok", text
        return text

    def value(self, expression: str):
        """An expression's value in the kernel, as its repr: ``print(repr(...))``."""
        import ast

        return ast.literal_eval(self.ok(f"print(repr({expression}))").strip().splitlines()[-1])

    def stop(self) -> None:
        stop_kernel(self.manager, self.client)


@pytest.fixture(scope="module")
def kernel(server):
    kernel = Kernel(server.url)
    yield kernel
    kernel.stop()


def _no_ranks_left(server: ConnectServer, what: str) -> None:
    wait_until(lambda: not server.ranks(), 15, lambda: f"rank processes {server.ranks()} outlived {what}")


def test_a_cell_runs_on_the_connect_session_with_no_jvm_in_the_kernel(kernel, server):
    reply, text = kernel.run(TRAIN)
    assert reply["status"] == "ok", text
    assert "(spark connect)" in text, text
    assert "[rank 0] ready 0/2" in text and "[rank 1] ready 1/2" in text, text
    assert kernel.value("hvdmagic.last_run().mode") == "spark connect"
    assert kernel.value("hvdmagic.last_run().result") == 3.0
    description = kernel.value("hvdmagic.last_run().description")
    assert description.startswith("Spark Connect barrier stage of 2 tasks") and server.url[5:] in description
    # No classic session beside the Connect one: no SparkContext, no JVM, no embedded session.
    assert kernel.value("__import__('pyspark').SparkContext._active_spark_context is None") is True
    assert kernel.value("__import__('hvdmagic.launch.spark_session').launch.spark_session._embedded is None")
    java = [p.name() for p in __import__("psutil").Process(kernel.manager.provisioner.process.pid).children(True)
            if "java" in p.name()]
    assert not java, f"the kernel started a JVM: {java}"
    _no_ranks_left(server, "a finished cell")


def test_too_large_np_fails_at_once_naming_the_slots(kernel, server):
    started = time.monotonic()
    reply, text = kernel.run(f"%%horovod --np {CORES + 1}\n1", 60)
    assert reply["status"] == "error" and reply["ename"] == "LaunchError", text
    assert f"offers {CORES}" in text and "Spark Connect" in text and f"local[{CORES}]" in text, text
    assert "Java" not in text and "\tat " not in text, text
    assert time.monotonic() - started < 15, "the slot check did not fail at once"
    assert not server.ranks()


FAULTS = {
    "raise": ('raise KeyError("boom on rank 1")', "boom on rank 1"),
    "sigkill": ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failing_rank_fails_the_cell_and_the_next_cell_works(kernel, server, fault):
    code, said = FAULTS[fault]
    reply, text = kernel.run(f"""%%horovod --np 2
import time, torch, horovod.torch as hvd
hvd.init()
if hvd.rank() == 1:
    {code}
hvd.allreduce(torch.tensor([1.0]))
""")
    assert reply["status"] == "error" and reply["ename"] == "JobFailed", text
    assert "rank 1" in text and said in text, text
    _no_ranks_left(server, "a failed cell")
    kernel.ok(TRAIN)
    assert kernel.value("hvdmagic.last_run().result") == 3.0


def test_timeout_cancels_the_stage_and_every_slot_comes_back(kernel, server):
    started = time.monotonic()
    reply, text = kernel.run("""%%horovod --np 2 --timeout 8
import time, horovod.torch as hvd
hvd.init()
time.sleep(600)
""", 120)
    assert reply["status"] == "error" and reply["ename"] == "JobTimeout", text
    assert "--timeout 8" in text, text
    assert time.monotonic() - started < 8 + 20, "the timeout took too long to end the cell"
    _no_ranks_left(server, "--timeout")
    # Every barrier slot is free again: a stage on all of them runs (one left waiting would hang it).
    text = kernel.ok(f"%%horovod --np {CORES} --timeout 90\nimport horovod.torch as hvd\nhvd.init()\nhvd.size()")
    assert f"np={CORES} (spark connect): finished" in text, text


def test_stop_during_training_stops_every_rank_and_the_next_cell_works(kernel, server):
    seen: list[int] = []

    def stop_once_training(text: str) -> None:
        if "training" in text and not seen:
            seen.extend(wait_until(server.ranks, 10, "no rank process ran while the cell trained"))
            kernel.manager.interrupt_kernel()

    msg = kernel.client.execute("""%%horovod --np 2
import time, horovod.torch as hvd
hvd.init()
print("training", flush=True)
time.sleep(600)
""")
    reply, texts = wait_for_reply(kernel.client, msg, 120, stop_once_training)
    assert seen, "training never started"
    assert reply["status"] == "error" and reply["ename"] == "JobInterrupted", texts
    assert len(texts[-1].strip().splitlines()) == 1, texts[-1]
    wait_until(lambda: not alive(seen), 15, lambda: f"rank processes {alive(seen)} survived Stop")
    kernel.ok(TRAIN)
    assert kernel.value("hvdmagic.last_run().result") == 3.0


@pytest.fixture
def every_slot_held(server, tmp_path):
    """Another kernel's ranks on all four slots until the test calls ``free()``: a stage submitted
    meanwhile waits in the server's queue, and none of its tasks can start. Yields (the holder's
    tags on the server, free)."""
    release = tmp_path / "release"
    holder = Kernel(server.url)
    try:
        holding = holder.client.execute(f"""%%horovod --np {CORES}
import os, time, horovod.torch as hvd
hvd.init()
while not os.path.exists({str(release)!r}):
    time.sleep(0.05)
""")
        wait_until(lambda: len(server.ranks()) == CORES, 120, lambda: f"the holder's ranks: {server.ranks()}")
        tags = wait_until(server.running_tags, 60, "the holder's stage has no hvdmagic tag on the server")

        def free() -> None:
            release.touch()
            reply, texts = wait_for_reply(holder.client, holding, 120)
            assert reply["status"] == "ok", texts

        yield tags, free
    finally:
        release.touch()
        holder.stop()


# The Stop that lands as the kernel submits the stage: a SIGINT to the kernel's own process (what
# jupyter_client's interrupt_kernel sends) right after SparkBackend.start returns, before the job
# thread's request can have reached the server. Patched once: the next cell launches as usual.
STOP_AS_SUBMITTED = """
import os, signal
from hvdmagic.launch.spark import SparkBackend
def stop_as_submitted(self, spec, start=SparkBackend.start):
    SparkBackend.start = start
    start(self, spec)
    os.kill(os.getpid(), signal.SIGINT)
SparkBackend.start = stop_as_submitted
"""


@pytest.mark.parametrize("moment", ["queued", "as-submitted"])
def test_stop_during_launch_leaves_no_stage_and_the_next_cell_works(kernel, server, every_slot_held, moment):
    """Stop during launch, at a moment the test holds still: another kernel's ranks hold every slot,
    so the cell's stage cannot start a task. ``queued``: the server lists the stage's tag (it waits
    in Spark's queue), then jupyter_client's interrupt. ``as-submitted``: Stop right after the
    kernel submits, before the server has the stage. Either way the cell ends in one line within
    seconds, the stage is gone from the server while the slots are still held (none of its tasks
    ever runs), and once they are free a stage on all of them runs."""
    holders_tags, free = every_slot_held
    if moment == "as-submitted":
        kernel.ok(STOP_AS_SUBMITTED)
    msg = kernel.client.execute("""%%horovod --np 2
import horovod.torch as hvd
hvd.init()
print("training", flush=True)
""")
    stopped_at = time.monotonic()
    if moment == "queued":
        wait_until(lambda: server.running_tags() - holders_tags, 60,
                   "the cell's stage never appeared on the Connect server")
        stopped_at = time.monotonic()
        kernel.manager.interrupt_kernel()
    reply, texts = wait_for_reply(kernel.client, msg, 90)
    took = time.monotonic() - stopped_at
    assert reply["status"] == "error" and reply["ename"] == "JobInterrupted", texts
    assert "interrupted while the ranks were being started" in texts[-1], texts[-1]
    assert len(texts[-1].strip().splitlines()) == 1, texts[-1]
    assert not any("training" in text for text in texts), texts
    # Before the fix an as-submitted Stop interrupted nothing and waited out the 30 s join.
    assert took < 15, f"Stop took {took:.1f} s to end the cell"
    tag = re.search(r"tag (hvdmagic-\w+)", kernel.value("hvdmagic.last_run().description"))[1]
    wait_until(lambda: tag not in server.running_tags(), 15,
               lambda: f"the interrupted stage {tag} still waits on the Connect server")
    assert len(server.ranks()) == CORES, "a rank started beside the holder's"
    free()
    _no_ranks_left(server, "the holder's cell")
    # The UI learns of a job's end from the listener bus, a moment after collect() has returned.
    wait_until(lambda: not server.running_tags(), 15, lambda: f"stages {server.running_tags()} outlived their cells")
    text = kernel.ok(f"%%horovod --np {CORES} --timeout 90\nimport horovod.torch as hvd\nhvd.init()\nhvd.size()")
    assert f"np={CORES} (spark connect): finished" in text, text


def test_a_kernel_that_dies_leaves_no_rank_and_no_stage_behind(kernel, server):
    """The kernel that ran the stage is SIGKILLed mid-training: its channel drops, the supervisors
    kill their ranks, the tasks end and so does the Connect operation, so every slot is free."""
    doomed = Kernel(server.url)
    try:
        seen: list[int] = []
        msg = doomed.client.execute("""%%horovod --np 2
import time, horovod.torch as hvd
hvd.init()
print("training", flush=True)
time.sleep(600)
""")
        for message in iopub_messages(doomed.client, msg, 120):
            if message["msg_type"] == "stream" and "training" in message["content"]["text"]:
                seen.extend(wait_until(server.ranks, 10, "no rank process ran while the cell trained"))
                break
        assert seen, "training never started"
        os.kill(doomed.manager.provisioner.process.pid, signal.SIGKILL)
    finally:
        doomed.stop()
    wait_until(lambda: not alive(seen), 20, lambda: f"rank processes {alive(seen)} outlived their kernel")
    text = kernel.ok(f"%%horovod --np {CORES} --timeout 90\nimport horovod.torch as hvd\nhvd.init()\nhvd.size()")
    assert f"np={CORES} (spark connect): finished" in text, text


def test_the_python_api_torch_distributor_and_torchrun_run_on_connect(kernel, server):
    kernel.ok("""
from hvdmagic import HorovodRunner
def size_and_rank():
    import horovod.torch as hvd
    hvd.init()
    return hvd.size(), hvd.rank()
""")
    assert kernel.value("hvdmagic.run(size_and_rank, np=2)") == [(2, 0), (2, 1)]
    assert kernel.value("hvdmagic.last_run().mode") == "spark connect"
    assert kernel.value("HorovodRunner(np=2).run(size_and_rank)") == (2, 0)
    kernel.ok("""
from hvdmagic import TorchDistributor
def world():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    return dist.get_world_size()
""")
    assert kernel.value("TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(world)") == 2
    assert kernel.value("hvdmagic.last_run().mode") == "spark connect"
    reply, text = kernel.run("""%%torchrun --np 2
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
t.item()
""")
    assert reply["status"] == "ok", text
    assert "(spark connect)" in text, text
    assert kernel.value("hvdmagic.last_run().result") == 3.0
    _no_ranks_left(server, "the API's runs")


def test_a_session_and_data_from_a_connect_dataframe(kernel, server):
    kernel.ok("%horovod start --np 2", 180)
    try:
        kernel.ok("%%horovod\nimport horovod.torch as hvd\nhvd.init()\nkept = hvd.rank() * 10")
        kernel.ok("%%horovod\nimport torch\nhvd.allreduce(torch.tensor([float(kept)]), op=hvd.Sum).item()")
        assert kernel.value("hvdmagic.last_run().result") == 10.0
    finally:
        kernel.ok("%horovod stop")
    _no_ranks_left(server, "%horovod stop")
    reply, text = kernel.run("""df = spark.range(10).selectExpr("id", "id * 2 as twice")
print(type(df).__module__)""")
    assert "pyspark.sql.connect" in text, text
    reply, text = kernel.run("""%%horovod --np 2 --data df
import hvdmagic, horovod.torch as hvd
hvd.init()
shard = hvdmagic.shard()
sorted(hvd.allgather_object(shard.column("id").to_pylist()), key=len)
""")
    assert reply["status"] == "ok", text
    rows = kernel.value("sorted(sum(hvdmagic.last_run().result, []))")
    assert rows == list(range(10))


def test_an_elastic_run_runs_on_a_plain_connect_stage(kernel, server):
    """An elastic run's stage is a plain one (a barrier stage fails as a whole when one task does):
    on Connect, mapInArrow without barrier=True, its tasks reading their TaskContext."""
    reply, text = kernel.run("""%%horovod --np 2 --min-np 1 --max-np 2 --timeout 120
import torch, horovod.torch as hvd
hvd.init()
state = hvd.elastic.TorchState(step=0)
@hvd.elastic.run
def train(state):
    for state.step in range(state.step, 3):
        hvd.allreduce(torch.tensor([1.0]))
        state.commit()
    return hvd.size()
train(state)
""")
    assert reply["status"] == "ok", text
    assert "elastic 1-2 (spark connect): finished" in text, text
    assert kernel.value("hvdmagic.last_run().result") == 2
    _no_ranks_left(server, "an elastic run")


def _supervisor_of(ready: Path, host_prefix: str, what: str) -> psutil.Process:
    """The Python worker under the server (the task's supervisor) of the rank that registered itself
    next to ``ready`` with a Horovod host starting with ``host_prefix``: killing it fails the task,
    as a crashed executor process would."""
    found = registered_rank(str(ready), host_prefix)
    assert found is not None, f"no rank of {what} registered next to {ready}"
    return found[1]


def test_an_elastic_run_whose_stage_fails_says_why_and_the_next_cell_works(kernel, server, tmp_path):
    """A ``local[N]`` master runs a task once (no retries): when task 1's supervisor (its Python
    worker) is SIGKILLed mid-run, the server aborts the elastic run's stage. The cell then fails
    with the stage's own error, however far Horovod's driver has got (it used to fail with an
    AttributeError when the stage's failure came first), no rank is left, and the next cell works."""
    ready = tmp_path / "ready"
    kernel.ok(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\nfrom elastic_training import train")
    msg = kernel.client.execute(f"%%horovod --np 2 --min-np 1 --max-np 2 --timeout 240\n"
                                f"train(100000, marker={str(ready)!r}, ready_at=5)")
    wait_until(ready.exists, 120, "training never reached step 5")
    _supervisor_of(ready, "t1.", "task 1").kill()
    reply, texts = wait_for_reply(kernel.client, msg, 120)
    text = "".join(texts)
    assert reply["status"] == "error" and reply["ename"] == "JobFailed", text
    assert "the Spark stage failed" in text and "AttributeError" not in text, text
    _no_ranks_left(server, "a failed elastic stage")
    kernel.ok(TRAIN)
    assert kernel.value("hvdmagic.last_run().result") == 3.0


def test_a_fixed_size_run_whose_stage_fails_says_why_and_the_next_cell_works(kernel, server, tmp_path):
    """The barrier stage of a ``--np 2`` run fails on the server: task 1's Python worker (its
    supervisor) is SIGKILLed while both ranks run, and a ``local[N]`` master does not retry it.
    The cell fails within seconds with one error that says so (not the --timeout, not Spark's
    Java trace), no rank is left under the server, the stage is gone from it, and the next cell works."""
    ready = tmp_path / "ready"
    msg = kernel.client.execute(f"""%%horovod --np 2 --timeout 120
import os, time, torch, horovod.torch as hvd
hvd.init()
with open(f"{ready!s}.r{{hvd.rank()}}.pids", "w") as pids:
    pids.write(f"{{os.getpid()}} {{os.environ['HVDMAGIC_SUPERVISOR_PID']}}")
hvd.allreduce(torch.tensor([1.0]))
if hvd.rank() == 0:
    open({str(ready)!r}, "w").close()
while True:
    time.sleep(0.05)
""")
    try:
        wait_until(ready.exists, 120, "the ranks never got past their first allreduce")
        running = server.running_tags()
        assert running, "the run's stage is not on the Connect server"
        _supervisor_of(ready, "r1", "rank 1").kill()
        killed_at = time.monotonic()
        reply, texts = wait_for_reply(kernel.client, msg, 120)
        msg = None
    finally:
        if msg is not None:  # a failed check left the ranks looping: Stop them before the next test's cells
            kernel.manager.interrupt_kernel()
            with contextlib.suppress(Exception):
                wait_for_reply(kernel.client, msg, 60)
    took, text = time.monotonic() - killed_at, "".join(texts)
    assert reply["status"] == "error" and reply["ename"] == "LaunchError", text
    assert took < 30, f"the failed stage took {took:.1f} s to end the cell"
    said = reply["evalue"]
    assert said.startswith("the Spark barrier stage failed: Job aborted due to stage failure"), said
    assert "\n" not in said and "\tat " not in said and "Traceback" not in said, said
    _no_ranks_left(server, "a failed barrier stage")
    wait_until(lambda: not running & server.running_tags(), 15,
               lambda: f"the failed stage {running} still runs on the Connect server")
    kernel.ok(TRAIN)
    assert kernel.value("hvdmagic.last_run().result") == 3.0


# Keeps the kernel's next job channel (its ChannelServer) and writes where it listens to a file,
# for a test to attack it; the class is restored by RELEASE_CHANNEL.
KEEP_CHANNEL = """
from hvdmagic import channel as _channel
_kept_channels, _channel_init = [], _channel.ChannelServer.__init__
def _keep_channel(self, *args, **kwargs):
    _channel_init(self, *args, **kwargs)
    _kept_channels.append(self)
    with open({where!r}, "w") as out:
        out.write(f"{{self.address[0]}} {{self.address[1]}}")
_channel.ChannelServer.__init__ = _keep_channel
"""
RELEASE_CHANNEL = "_channel.ChannelServer.__init__ = _channel_init"


def test_hostile_connections_to_the_channel_do_not_disturb_a_connect_run(kernel, server, tmp_path):
    """While both ranks of a Connect run wait, three peers connect to the job's channel (on the
    kernel's address toward the server): one sends garbage, one an ``exit`` frame signed with
    another secret, one stays silent. The first two are turned away (the channel counts them) and
    get nothing but the nonce every peer gets, the silent one nothing until the job closes it, and
    the run ends with the right result."""
    import socket

    from hvdmagic import channel

    where, release = tmp_path / "channel", tmp_path / "release"
    kernel.ok(KEEP_CHANNEL.format(where=str(where)))
    msg = None
    try:
        msg = kernel.client.execute(f"""%%horovod --np 2 --timeout 120
import os, time, torch, horovod.torch as hvd
hvd.init()
while not os.path.exists({str(release)!r}):
    time.sleep(0.05)
hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
""")
        wait_until(lambda: len(server.ranks()) == 2, 120, lambda: f"the run's ranks: {server.ranks()}")
        host, port = where.read_text().split()
        assert host == "127.0.0.1", host  # spark_connect.kernel_address for a server on this machine

        def peer() -> tuple[socket.socket, bytes]:
            sock = socket.create_connection((host, int(port)), timeout=30)
            return sock, channel._recv_exact(sock, channel.NONCE_SIZE)

        (garbage, _), (forger, nonce), (silent, _) = peer(), peer(), peer()
        garbage.sendall(b"\xff" * 64)
        # A well-formed frame for this connection's nonce, but signed without the job's secret.
        channel.Link(forger, channel.new_secret(), nonce, is_server=False).send({"type": "exit", "rank": 0, "code": 1})
        for name, sock in (("garbage", garbage), ("forger", forger)):
            with sock:
                assert sock.recv(1 << 16) == b"", f"the channel sent the {name} peer something"
        release.touch()
        reply, texts = wait_for_reply(kernel.client, msg, 120)
        msg = None
        assert reply["status"] == "ok", "".join(texts)
        # The run did not wait on the silent peer, and closing the channel is all it ever got.
        with silent:
            assert silent.recv(1 << 16) == b"", "the channel sent the silent peer something"
        assert kernel.value("hvdmagic.last_run().result") == 3.0
        assert kernel.value("_kept_channels[-1].rejected") == 2, "the channel did not turn both peers away"
    finally:
        release.touch()
        if msg is not None:  # a failed check: the kernel takes the next cell only once this one has ended
            with contextlib.suppress(Exception):
                wait_for_reply(kernel.client, msg, 120)
        kernel.ok(RELEASE_CHANNEL)
    _no_ranks_left(server, "a run under attack")


def test_the_mpi_controller_runs_on_connect(kernel, server):
    """``--controller mpi``: mpirun runs in the kernel, its rsh agent asks the kernel over the job's
    channel to start Open MPI's daemon in the Connect stage's task, and the ranks are adopted there."""
    reply, text = kernel.run("""%%horovod --np 2 --controller mpi
import os, torch, horovod.torch as hvd
hvd.init()
print(f"hello from rank {hvd.rank()}", flush=True)
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
hvd.allgather_object((hvd.rank(), hvd.size(), hvd.mpi_enabled(), hvd.gloo_enabled(),
                      os.environ.get("OMPI_COMM_WORLD_RANK"), total))
""")
    assert reply["status"] == "ok", text
    assert "(spark connect)" in text, text
    assert "[rank 0] hello from rank 0" in text and "[rank 1] hello from rank 1" in text, text
    assert kernel.value("sorted(hvdmagic.last_run().result)") == [(0, 2, True, False, "0", 3.0),
                                                                  (1, 2, True, False, "1", 3.0)]
    assert kernel.value("hvdmagic.last_run().mode") == "spark connect"
    _no_ranks_left(server, "an MPI run")
    wait_until_no_mpi_processes()


@pytest.mark.unit
def test_an_unreachable_kernel_is_one_paragraph_from_the_task():
    """A task whose kernel does not answer fails with the line the driver turns into its paragraph."""
    from hvdmagic.launch import spark_connect
    from hvdmagic.protocol import Payload, TaskSpec
    from hvdmagic.task import barrier

    port = reserve_port()  # nothing listens there
    spec = TaskSpec(job_id="x", driver_host="127.0.0.1", channel_port=port, rendezvous_port=0, secret=b"s" * 32,
                    payload=Payload(b""))
    with pytest.raises(barrier.Unreachable) as caught:
        barrier.run_task(spec, 0)
    assert str(caught.value).startswith(barrier.UNREACHABLE) and f"127.0.0.1:{port}" in str(caught.value)
    paragraph = spark_connect.unreachable("the task could not connect", "10.0.0.5", None)
    assert "\n" not in paragraph and "10.0.0.5" in paragraph and "open the kernel's TCP ports" in paragraph
    # Through a tunnel (the kernel's address toward the server is loopback) no port can be opened.
    tunnelled = spark_connect.unreachable("the task could not connect", "127.0.0.1", None)
    assert "tunnel" in tunnelled and "open the kernel's TCP ports" not in tunnelled


@pytest.fixture
def connect_default_port():
    """Spark Connect's 15002, held until the test's kernels have stopped (ask for it before
    ``kernel_factory``): ``remote("local[N]")``'s server binds it and its client connects there, so another
    test process's such server must be gone first. Its wait is within the test's time."""
    with holding(15002, within=300):
        yield


@pytest.mark.timeout(600)
def test_a_connect_server_inside_the_kernel_is_used_as_it_is(connect_default_port, kernel_factory):
    """``remote("local[2]")`` runs the server in the kernel's own process, a classic SparkContext
    with it: hvdmagic runs on the Connect session, starts no session of its own, and never tells
    the user to stop theirs."""
    manager, client = kernel_factory(PYSPARK_PYTHON=sys.executable)
    reply, texts = execute(client, "%load_ext hvdmagic\nimport hvdmagic\nfrom pyspark.sql import SparkSession\n"
                           "spark = SparkSession.builder.remote('local[2]').getOrCreate()\n"
                           "print(type(spark).__module__)", 240)
    if reply["status"] != "ok":
        print(f"The sockets on 15002 as the session failed:\n{_sockets_on(15002)}")  # shown whole with the failure
    assert reply["status"] == "ok" and "pyspark.sql.connect" in "".join(texts), texts
    reply, texts = execute(client, TRAIN, 240)
    text = "".join(texts)
    assert reply["status"] == "ok", text
    assert "(spark connect)" in text and "spark.stop()" not in text, text
    reply, texts = execute(client, "print(hvdmagic.last_run().result, hvdmagic.launch.spark_session._embedded)", 30)
    assert "".join(texts).split() == ["3.0", "None"], texts
    kernel_pid = manager.provisioner.process.pid
    wait_until(lambda: not rank_processes(kernel_pid), 15, "rank processes outlived the cell")


def _sockets_on(port: int) -> str:
    """The machine's sockets on ``port``, with their processes where this user may see them: who held it."""
    shown = subprocess.run(["ss", "-tanpe", f"( sport = :{port} or dport = :{port} )"], capture_output=True,
                           text=True, check=False)
    return shown.stdout + shown.stderr


@contextlib.contextmanager
def _connect_cluster(tmp_path, workers: int, cores: int, conf: dict[str, str], start: int | None = None):
    """A standalone cluster, a Connect server started on it (``tests/connect_server.py`` with ``--master
    spark://...``) and a kernel connected to that server: (cluster, kernel); all three stopped after.
    ``start``: how many of the workers start now (all by default; ``cluster.start_worker`` adds the others)."""
    cluster = StandaloneCluster(tmp_path, workers=workers, cores=cores, gpus=0).start(workers=start)
    server = kernel = None
    try:
        server = ConnectServer(tmp_path, master=cluster.url, conf={"spark.executor.memory": "1g", **conf})
        server.wait_listening(SERVER_START)
        kernel = Kernel(server.url)
        yield cluster, kernel
    finally:
        if kernel is not None:
            kernel.stop()
        if server is not None:
            server.stop()
        cluster.stop()


@pytest.mark.cluster
def test_a_connect_server_on_a_standalone_cluster_counts_its_slots_and_runs_across_workers(tmp_path):
    """A Connect server with ``--master spark://...``: the slot count comes from the server's
    defaultParallelism (the executors' cores), read from a plan, since the master string says nothing."""
    with _connect_cluster(tmp_path, workers=2, cores=2, conf={"spark.executor.cores": "2"}) as (cluster, kernel):
        kernel.ok("from hvdmagic.launch import spark_connect")
        wait_until(lambda: kernel.value("spark_connect.available(spark)") == 4, 90,
                   "the Connect server's executors did not register their 4 cores")
        reply, text = kernel.run("%%horovod --np 5\n1", 60)
        assert reply["status"] == "error" and reply["ename"] == "LaunchError", text
        assert "offers 4" in text and cluster.url in text, text
        kernel.ok("%%horovod --np 4 --timeout 120\nimport horovod.torch as hvd\nhvd.init()\n"
                  "(hvd.size(), hvd.cross_size())")
        assert kernel.value("hvdmagic.last_run().result") == (4, 1)  # one address, 127.0.0.1: one host
        assert kernel.value("hvdmagic.last_run().mode") == "spark connect"


@pytest.mark.cluster
@pytest.mark.timeout(600)  # four JVMs and a kernel start on a 2-core machine before training begins
def test_a_lost_worker_under_a_connect_server_does_not_lose_an_elastic_run(tmp_path):
    """test_elastic.py's lost worker, with the kernel on a Connect server of the standalone cluster:
    two ranks on two one-core workers, and the Worker JVM under task 1 (its executor with it)
    SIGKILLed once rank 0 has trained 15 steps. The other rank resumes alone from the commit; once
    it does, a third worker starts (before that, test_elastic's ``_kill_the_worker_of`` says why),
    and the server's scheduler runs task 1 again there (an elastic run's Connect stage is a plain
    mapInArrow, so one lost task does not fail the stage); its rank joins at a commit, and the run
    ends on two ranks with nothing trained twice."""
    ready, killed = str(tmp_path / "ready"), []
    conf = {"spark.executor.cores": "1", "spark.task.maxFailures": "4"}
    with _connect_cluster(tmp_path, workers=3, cores=1, conf=conf, start=SPARE_WORKER) as (cluster, kernel):
        kernel.ok(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                  "from elastic_training import train\nfrom hvdmagic.launch import spark_connect")
        wait_until(lambda: kernel.value("spark_connect.available(spark)") == SPARE_WORKER, 120,
                   "the Connect server's two executors did not register")
        killer = threading.Thread(target=_kill_the_worker_of, args=(cluster, "t1.", ready, killed), daemon=True)
        killer.start()
        kernel.ok(f"results = hvdmagic.run(train, 2, 30, marker={ready!r}, ready_at=15, until_size=2, step_time=0.05, "
                  "max_steps=4000, commit_every=5, min_np=1, max_np=2)", 420)
        killer.join(timeout=5)
        assert len(killed) == 1 and isinstance(killed[0], int), killed
        assert kernel.value("hvdmagic.last_run().mode") == "spark connect"
        trace = _check_training(kernel.value("results"), 2)
        resets = kernel.value("[(r.reason, r.size_before, r.size_after, (r.commit or {}).get('step')) "
                              "for r in hvdmagic.last_run().resets]")
        first, last = resets[0], resets[-1]
        assert "task 1's rank lost (its Spark task or executor was lost)" in first[0], resets
        assert first[1:3] == (2, 1) and first[3] >= 15, resets
        assert last[:3] == ("slots added", 1, 2), resets
        assert 1 in {size for _, size in trace} and trace[-1][1] == 2
        assert kernel.value("(hvdmagic.last_run().ranks[1].state, hvdmagic.last_run().world_size)") == ("finished", 2)
        # Whoever was rank 0 logged every step's metrics, across the resets.
        steps = kernel.value("sorted(set(int(s) for s in hvdmagic.last_run().metrics.query('rank == 0')['step']))")
        assert steps == list(range(1, len(trace) + 1)), steps
        assert cluster.procs[killed[0]].wait(timeout=10) == -signal.SIGKILL
        wait_until_gone([p.pid for p in rank_processes()], within=15)
