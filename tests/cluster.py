"""A real Spark standalone cluster, started from the installed pyspark.

One master and two workers with 2 cores each, on 127.0.0.1 by default. Each
worker also reports two fake GPUs through a resource discovery script (worker 0:
"0","1"; worker 1: "2","3"), so the GPU-pinning path runs on machines without
GPUs. With ``worker_hosts`` each worker runs inside its own network namespace
(see netns.py), as if on its own host.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pyspark

SPARK_HOME = Path(pyspark.__file__).parent


def stop_active_session() -> None:
    """Stop the process's SparkContext, whichever thread made it (hvdmagic makes its own on its
    Spark thread): one SparkContext per process, so a test on a cluster must end the embedded one."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    from hvdmagic.launch import spark

    if SparkContext._active_spark_context is not None:
        SparkSession.builder.getOrCreate().stop()
    spark._embedded = None


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class StandaloneCluster:
    """``worker_hosts``: (address, network namespace) per worker; by default all on ``host``."""

    def __init__(self, workdir: Path, workers: int = 2, cores: int = 2, host: str = "127.0.0.1",
                 worker_hosts: list[tuple[str, str | None]] | None = None):
        self.workdir = workdir
        self.cores = cores
        self.host = host
        self.worker_hosts = worker_hosts or [(host, None)] * workers
        self.workers = len(self.worker_hosts)
        self.port = _free_port(host)
        self.ui_port = _free_port(host)
        self.url = f"spark://{host}:{self.port}"
        self.procs: list[subprocess.Popen] = []

    def _start(self, name: str, args: list[str], extra_env: dict[str, str] | None = None,
               host: str | None = None, netns: str | None = None) -> None:
        env = dict(os.environ, SPARK_HOME=str(SPARK_HOME), SPARK_LOCAL_IP=host or self.host,
                   SPARK_LOG_DIR=str(self.workdir), SPARK_NO_DAEMONIZE="1", **(extra_env or {}))
        log = open(self.workdir / f"{name}.log", "wb")
        # A simulated host gets its own network and its own hostname (Open MPI names
        # shared-memory segments after it); each step execs, so the pid stays Spark's.
        prefix = (["ip", "netns", "exec", netns, "unshare", "--uts", "sh", "-c", f'hostname {netns} && exec "$0" "$@"']
                  if netns else [])
        self.procs.append(subprocess.Popen([*prefix, str(SPARK_HOME / "bin" / "spark-class"), *args], env=env,
                                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def _state(self) -> dict:
        with urllib.request.urlopen(f"http://{self.host}:{self.ui_port}/json/", timeout=2) as reply:
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
        script = self.workdir / f"gpus{i}.sh"
        addresses = json.dumps([str(2 * i), str(2 * i + 1)])
        script.write_text(f"#!/bin/sh\necho '{{\"name\": \"gpu\", \"addresses\": {addresses}}}'\n")
        script.chmod(0o755)
        opts = f"-Dspark.worker.resource.gpu.amount=2 -Dspark.worker.resource.gpu.discoveryScript={script}"
        (self.workdir / f"worker{i}").mkdir()
        self._start(f"worker{i}", ["org.apache.spark.deploy.worker.Worker", self.url,
                                   "--cores", str(self.cores), "--memory", "2g", "--host", worker_host,
                                   "--webui-port", "0", "--work-dir", str(self.workdir / f"worker{i}")],
                    {"SPARK_WORKER_OPTS": opts}, worker_host, netns)

    def wait_for_workers(self, count: int, timeout: float = 90) -> StandaloneCluster:
        """Return once the master lists ``count`` alive workers; fail with the logs after ``timeout``."""
        deadline = time.monotonic() + timeout
        alive = 0
        while time.monotonic() < deadline:
            try:
                alive = self._state().get("aliveworkers", 0)
            except OSError:
                alive = 0
            if alive == count:
                return self
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.5)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in self.workdir.glob("*.log"))
        self.stop()
        raise RuntimeError(f"the standalone cluster did not register {count} workers "
                           f"(saw {alive}) within {timeout:g} s\n{logs}")

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
