"""What the tests share: waiting for a condition, Jupyter kernels and their messages, Spark clusters.

- ``wait_until(predicate, timeout, message)``: poll until the predicate holds, else fail with the message.
- Kernels: ``kernel_factory`` (the one kernel fixture: it starts kernels, and shuts down every one
  it started) and ``kernel`` (its default kernel), which conftest.py offers to every module;
  ``iopub_messages`` (one request's iopub messages, in order), ``shell_reply``, ``execute`` and
  ``wait_for_reply``.
- Spark: ``spark_cluster`` (a standalone cluster of some workers, cores and fake GPUs each, and a
  SparkSession on it), ``StandaloneCluster`` (its processes), ``stop_active_session``, and
  ``record_slot_waits`` (how each wait of the slot check ended).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ports import reserve_port

from hvdmagic.task import blob_cache


# -- waiting ----------------------------------------------------------------------------------------
class WaitTimeout(AssertionError, TimeoutError):
    """A condition did not come true in time: a failed check (AssertionError) and a timeout alike."""


def wait_until(predicate: Callable[[], Any], timeout: float, message: str | Callable[[], str],
               interval: float = 0.05) -> Any:
    """Poll ``predicate`` every ``interval`` seconds until it returns something true, and return that.

    After ``timeout`` seconds, raise WaitTimeout with ``message`` (a callable is called then, so the
    message can say what was seen last). An exception from the predicate goes through at once.
    """
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"{message() if callable(message) else message} (waited {timeout:g} s)")
        time.sleep(interval)
    return value


# -- Jupyter kernels ----------------------------------------------------------------------------------
def users_shell() -> dict[str, str]:
    """The environment of a user's shell that runs ``.venv/bin/python script.py`` without activating
    the virtualenv (or of a kernel Jupyter starts): no PYSPARK_PYTHON, and no directory on PATH whose
    python3 is this Python."""
    def this_python(folder: str) -> bool:
        return os.path.realpath(os.path.join(folder, "python3")) == os.path.realpath(sys.executable)

    path = os.pathsep.join(folder for folder in os.environ["PATH"].split(os.pathsep) if not this_python(folder))
    return {**{k: v for k, v in os.environ.items() if k != "PYSPARK_PYTHON"}, "PATH": path}


def start_kernel(*, interactive: bool = False, **env: str | None):
    """A python3 kernel started through jupyter_client, as VS Code starts one (no JPY_SESSION_NAME);
    return (manager, client), the kernel ready. ``interactive``: HVDMAGIC_NONINTERACTIVE is left
    out, so hvdmagic shows its widgets; else it is 1 (text views). ``env`` adds to the kernel's
    environment (None: leaves that variable out), never to this process's."""
    from jupyter_client.manager import start_new_kernel

    kernel_env = {k: v for k, v in os.environ.items() if k not in ("JPY_SESSION_NAME", "HVDMAGIC_NONINTERACTIVE")}
    if not interactive:
        kernel_env["HVDMAGIC_NONINTERACTIVE"] = "1"
    kernel_env.update(env)
    kernel_env = {name: value for name, value in kernel_env.items() if value is not None}
    return start_new_kernel(kernel_name="python3", env=kernel_env)


def stop_kernel(manager, client) -> None:
    """Shut the kernel down now, whether it runs or the test killed it: jupyter_client SIGKILLs the
    kernel's whole process group, so its Spark JVM goes too."""
    client.stop_channels()
    manager.shutdown_kernel(now=True)


@pytest.fixture
def kernel_factory(tmp_path_factory):
    """Start a kernel: ``kernel_factory(interactive=False, without_horovod=False, **env)`` returns
    (manager, client). ``without_horovod``: horovod cannot be imported in the kernel nor in its
    ranks (a package of that name that raises ImportError comes first on PYTHONPATH). Every kernel
    it started is shut down after the test; ``stop_kernel`` ends one earlier."""
    started = []

    def start(*, interactive: bool = False, without_horovod: bool = False, **env: str):
        if without_horovod:
            path = tmp_path_factory.mktemp("without-horovod")
            (path / "horovod").mkdir()
            (path / "horovod" / "__init__.py").write_text("raise ImportError('no horovod in this test kernel')\n")
            env["PYTHONPATH"] = str(path)
        manager, client = start_kernel(interactive=interactive, **env)
        started.append((manager, client))
        return manager, client

    yield start
    for manager, client in started:
        if manager.has_kernel:
            stop_kernel(manager, client)


@pytest.fixture
def kernel(kernel_factory):
    """A real Jupyter kernel (text views), shut down after the test: (manager, client)."""
    return kernel_factory()


def iopub_messages(client, msg_id: str, timeout: float, *, comms: bool = False) -> Iterator[dict]:
    """The iopub messages whose parent is request ``msg_id``, in order, up to and including its
    idle status; ``comms``: every comm message too (a widget's messages from a subshell have the
    front end's request as parent). Fails if the idle status has not come ``timeout`` seconds on."""
    seen = []
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WaitTimeout(f"request {msg_id} did not end within {timeout:g} s; its messages so far: {seen}")
        try:
            msg = client.get_iopub_msg(timeout=remaining)
        except queue.Empty:
            continue
        ours = msg["parent_header"].get("msg_id") == msg_id
        if not ours and not (comms and msg["msg_type"].startswith("comm_")):
            continue
        seen.append(msg["content"]["text"] if msg["msg_type"] == "stream" else msg["msg_type"])
        yield msg
        if ours and msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return


def shell_reply(client, msg_id: str, timeout: float = 10) -> dict:
    """The shell reply to request ``msg_id``, skipping replies to other requests (start_new_kernel's kernel_info)."""
    while True:
        reply = client.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]


def execute(client, code: str, timeout: float, on_output=None) -> tuple[dict, list[str]]:
    """Run code; return (execute_reply content, output texts), calling on_output as text arrives."""
    return wait_for_reply(client, client.execute(code), timeout, on_output)


def wait_for_reply(client, msg_id: str, timeout: float, on_output=None) -> tuple[dict, list[str]]:
    """The reply to an execute request already sent, and the texts it output on the way: one text for each
    run of one stream, as front ends show them. ipykernel sends a stream's text in chunks at its flush
    timer's pace, so one print can come in two messages, its line and then its newline."""
    texts, last_stream = [], None
    for msg in iopub_messages(client, msg_id, timeout):
        content = msg["content"]
        if msg["msg_type"] == "stream":
            if content["name"] == last_stream:
                texts[-1] += content["text"]
            else:
                texts.append(content["text"])
            last_stream = content["name"]
            if on_output:
                on_output(content["text"])
        elif msg["msg_type"] == "error":
            texts.append("\n".join(content["traceback"]))
            last_stream = None
        elif msg["msg_type"] in ("display_data", "execute_result"):
            last_stream = None  # front ends show a display between the runs of text it parts
    return shell_reply(client, msg_id), texts


# -- Spark ----------------------------------------------------------------------------------------------
def record_slot_waits(monkeypatch) -> list:
    """Each wait of the slot check (launch.slots.wait) from now on in the test, as it ended: a list
    of slots.Waited, which tells whether the check waited for slots on their way (``waited_for``)
    or for the bound (``ran_out``), without timing the cell."""
    from hvdmagic.launch import slots

    waits, wait = [], slots.wait

    def recorded(*args, **kwargs):
        waits.append(wait(*args, **kwargs))
        return waits[-1]

    monkeypatch.setattr(slots, "wait", recorded)
    return waits


def stop_active_session() -> None:
    """Stop the process's SparkContext, whichever thread made it (hvdmagic makes its own on its
    Spark thread): one SparkContext per process, so a test on a cluster must end the embedded one."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    from hvdmagic.launch import spark_session as spark

    if SparkContext._active_spark_context is not None:
        SparkSession.builder.getOrCreate().stop()
    spark._embedded = None


class StandaloneCluster:
    """A real Spark standalone cluster, started from the installed pyspark: one master and
    ``workers`` workers of ``cores`` cores, on 127.0.0.1 by default.

    Each worker also reports ``gpus`` fake GPUs through a resource discovery script (worker 0:
    "0","1"; worker 1: "2","3" with two each), so the GPU-pinning path runs on machines without
    GPUs. ``worker_hosts``: (address, network namespace) per worker, each then inside its own
    namespace (see netns.py), as if on its own host; by default all on ``host``. ``worker_env``:
    more environment per worker (its executors and their Python workers inherit it). ``discovery``: a
    real discovery script for every worker's ``gpus`` GPUs instead (scripts/gpu_discovery.sh).
    """

    def __init__(self, workdir: Path, workers: int = 2, cores: int = 2, gpus: int = 2, host: str = "127.0.0.1",
                 worker_hosts: list[tuple[str, str | None]] | None = None,
                 worker_env: list[dict[str, str]] | None = None, discovery: Path | None = None):
        import pyspark

        self.spark_home = Path(pyspark.__file__).parent
        self.workdir = workdir
        self.cores = cores
        self.gpus = gpus
        self.discovery = discovery
        self.host = host
        self.worker_hosts = worker_hosts or [(host, None)] * workers
        self.workers = len(self.worker_hosts)
        self.worker_env = worker_env or [{}] * self.workers
        self.port = reserve_port(host)
        self.ui_port = reserve_port(host)
        self.url = f"spark://{host}:{self.port}"
        self.procs: list[subprocess.Popen] = []

    def _start(self, name: str, args: list[str], extra_env: dict[str, str] | None = None,
               host: str | None = None, netns: str | None = None) -> None:
        from hvdmagic.launch import jvm_archive

        # The master and workers map the embedded Spark's class-data archive too (the same jars on
        # their class path): each starts in about 3 s, not 5, and the cluster tests start many.
        env = dict(os.environ, SPARK_HOME=str(self.spark_home), SPARK_LOCAL_IP=host or self.host,
                   SPARK_LOG_DIR=str(self.workdir), SPARK_NO_DAEMONIZE="1",
                   SPARK_DAEMON_JAVA_OPTS=jvm_archive.options(), **(extra_env or {}))
        log = open(self.workdir / f"{name}.log", "wb")
        # A simulated host gets its own network and its own hostname (Open MPI names
        # shared-memory segments after it); each step execs, so the pid stays Spark's.
        prefix = (["ip", "netns", "exec", netns, "unshare", "--uts", "sh", "-c", f'hostname {netns} && exec "$0" "$@"']
                  if netns else [])
        self.procs.append(subprocess.Popen([*prefix, str(self.spark_home / "bin" / "spark-class"), *args], env=env,
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def _state(self) -> dict:
        """The master's state, from the web UI port its log says it bound: the port asked for may
        have been taken meanwhile (Spark then binds the next one, and the asked one may answer
        with another Spark UI's HTML page). {} until the master has said."""
        try:
            log = (self.workdir / "master.log").read_text(errors="replace")
        except OSError:
            return {}
        bound = re.search(r"Bound MasterWebUI to \S+, and started at http://[^:\s]+:(\d+)", log)
        if bound is None:
            return {}
        with urllib.request.urlopen(f"http://{self.host}:{bound[1]}/json/", timeout=2) as reply:
            return json.load(reply)

    def start(self, timeout: float = 90, workers: int | None = None) -> StandaloneCluster:
        """The master and the first ``workers`` workers (all by default), once the master lists them."""
        self._start("master", ["org.apache.spark.deploy.master.Master", "--host", self.host,
                               "--port", str(self.port), "--webui-port", str(self.ui_port)])
        for i in range(self.workers if workers is None else workers):
            self.start_worker(i)
        return self.wait_for_workers(self.workers if workers is None else workers, timeout)

    def start_worker(self, i: int) -> None:
        """Start worker ``i`` (of ``worker_hosts``); it registers with the master seconds later."""
        worker_host, netns = self.worker_hosts[i]
        opts = ""
        if self.gpus:
            script = self.discovery or self.workdir / f"gpus{i}.sh"
            if self.discovery is None:
                addresses = json.dumps([str(self.gpus * i + g) for g in range(self.gpus)])
                script.write_text(f"#!/bin/sh\necho '{{\"name\": \"gpu\", \"addresses\": {addresses}}}'\n")
                script.chmod(0o755)
            opts = (f"-Dspark.worker.resource.gpu.amount={self.gpus} "
                    f"-Dspark.worker.resource.gpu.discoveryScript={script}")
        (self.workdir / f"worker{i}").mkdir()
        env = {"SPARK_WORKER_OPTS": opts, **self.worker_env[i]}
        if netns:  # a host of its own has a blob cache of its own (its own /dev/shm)
            env[blob_cache.DIR_ENV] = str(self.workdir / f"worker{i}-blobs")
        self._start(f"worker{i}", ["org.apache.spark.deploy.worker.Worker", self.url,
                                   "--cores", str(self.cores), "--memory", "2g", "--host", worker_host,
                                   "--webui-port", "0", "--work-dir", str(self.workdir / f"worker{i}")],
                    env, worker_host, netns)

    def wait_for_workers(self, count: int, timeout: float = 90) -> StandaloneCluster:
        """Return once the master lists ``count`` alive workers; fail with the logs after ``timeout``
        or once one of the cluster's processes has exited."""
        seen = {"alive": 0}

        def registered() -> bool:
            if any(p.poll() is not None for p in self.procs):
                raise ChildProcessError("a process of the cluster exited")
            try:
                seen["alive"] = self._state().get("aliveworkers", 0)
            except (OSError, ValueError):  # not up yet, or a half-written reply
                seen["alive"] = 0
            return seen["alive"] == count

        try:
            wait_until(registered, timeout, "", interval=0.5)
        except (WaitTimeout, ChildProcessError) as exc:
            logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in self.workdir.glob("*.log"))
            self.stop()
            raise RuntimeError(f"the standalone cluster did not register {count} workers "
                               f"(saw {seen['alive']}) within {timeout:g} s\n{logs}") from exc
        return self

    def stop(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@contextlib.contextmanager
def spark_cluster(workdir: Path, *, workers: int = 2, cores: int = 2, gpus: int = 2, task_gpus: int | None = None,
                  start: int | None = None, host: str = "127.0.0.1",
                  worker_hosts: list[tuple[str, str | None]] | None = None, app: str = "hvdmagic-test",
                  conf: dict[str, str] | None = None, worker_env: list[dict[str, str]] | None = None,
                  python: str = sys.executable,
                  discovery: Path | None = None) -> Iterator[tuple[StandaloneCluster, Any]]:
    """A standalone cluster and a SparkSession on it, as a user makes one: (cluster, session).

    The process's SparkContext (the embedded one, or an earlier cluster's) is stopped first: one
    per process. ``workers`` workers of ``cores`` cores and ``gpus`` fake GPUs each (see
    StandaloneCluster); ``start``: how many of them start now (all by default; start_worker adds
    the others). Each executor takes a whole worker (its cores, 1 GiB); with ``task_gpus`` it takes
    the worker's GPUs too and each task ``task_gpus`` of them, else the session asks for none.
    ``conf``: more settings for the session; ``worker_env``, ``discovery``: see StandaloneCluster. The executors run
    ``python``, this Python by default (PYSPARK_PYTHON, restored afterwards). On the way out the
    session is stopped and the cluster with it.
    """
    from pyspark.sql import SparkSession

    stop_active_session()
    cluster = StandaloneCluster(workdir, workers=workers, cores=cores, gpus=gpus, host=host,
                                worker_hosts=worker_hosts, worker_env=worker_env,
                                discovery=discovery).start(workers=start)
    try:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("PYSPARK_PYTHON", python)  # the executors' Python: this venv, with hvdmagic, by default
            builder = (SparkSession.builder.master(cluster.url).appName(app)
                       .config("spark.driver.host", host).config("spark.driver.bindAddress", host)
                       .config("spark.executor.cores", str(cores)).config("spark.executor.memory", "1g"))
            if task_gpus:
                builder = (builder.config("spark.executor.resource.gpu.amount", str(gpus))
                           .config("spark.task.resource.gpu.amount", str(task_gpus)))
            for key, value in (conf or {}).items():
                builder = builder.config(key, value)
            yield cluster, builder.getOrCreate()
    finally:
        stop_active_session()
        cluster.stop()
