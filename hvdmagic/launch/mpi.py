"""The MPI controller (``--controller mpi``): Open MPI's mpirun, started without ssh.

mpirun runs on the driver. It is given one made-up host name per Spark host
(``hvdmagic-host-0``, ...), so it treats every host as remote, and an rsh agent
(``hvdmagic.launch.mpi_rsh``) in place of ssh. The agent asks the driver, over
the job's authenticated channel, to run mpirun's ``orted`` command in the
barrier task that leads that host; the daemon then starts the host's ranks.

Each rank mpirun starts is a small shim (``hvdmagic.rank.mpi_shim``) that its
task's supervisor adopts (``hvdmagic.task.mpi``).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from hvdmagic import protocol
from hvdmagic.errors import LaunchError
from hvdmagic.protocol import PYTHON_ENV, RSH_ENV, Event
from hvdmagic.task.mpi import as_root_env
from hvdmagic.task.network import network_of

FAILURE_GRACE = 2.0  # seconds a rank's own error gets to arrive before mpirun's exit is blamed
_APP = f'exec "${PYTHON_ENV}" -m hvdmagic.rank.mpi_shim'
_INSTALL = ("install Open MPI (Debian/Ubuntu: 'apt-get install -y openmpi-bin libopenmpi-dev') and rebuild "
            "horovod with MPI (the README's set-up command does both when run as root), or leave out "
            "--controller mpi to use Gloo")


def host_alias(index: int) -> str:
    return f"hvdmagic-host-{index}"


def host_index(alias: str) -> int | None:
    prefix = host_alias(0)[:-1]
    suffix = alias[len(prefix):] if alias.startswith(prefix) else ""
    return int(suffix) if suffix.isdigit() else None


def check_available() -> None:
    """Fail before launch, in one paragraph, when MPI or horovod's MPI support is missing."""
    if not shutil.which("mpirun"):
        raise LaunchError(f"--controller mpi needs Open MPI's mpirun, which is not on this driver's PATH: {_INSTALL}.")
    if not _horovod_has_mpi():
        raise LaunchError(f"--controller mpi needs horovod built with MPI, and this horovod was built "
                          f"without it: {_INSTALL}.")


@functools.lru_cache(maxsize=1)
def _horovod_has_mpi() -> bool:
    """Whether horovod's torch extension links libmpi, found without importing torch (seconds)."""
    import importlib.util

    spec = importlib.util.find_spec("horovod.torch")
    libs = list(Path(spec.origin).parent.glob("mpi_lib_v2*.so")) if spec and spec.origin else []
    return bool(libs) and b"libmpi.so" in libs[0].read_bytes()


def mpirun_command(host_sizes: list[int], driver_host: str) -> list[str]:
    hosts = ",".join(f"{host_alias(i)}:{n}" for i, n in enumerate(host_sizes))
    command = ["mpirun", "-np", str(sum(host_sizes)), "-H", hosts, "--map-by", "slot", "--bind-to", "none",
               # The agent needs the driver: no daemon may start another one (tree spawn).
               "--mca", "plm_rsh_agent", f"{sys.executable} -m hvdmagic.launch.mpi_rsh",
               "--mca", "plm_rsh_no_tree_spawn", "1",
               # TCP between hosts, shared memory within one: no InfiniBand/UCX probing and warnings.
               "--mca", "pml", "ob1", "--mca", "btl", "self,vader,tcp"]
    # Open MPI's own traffic (mpirun <-> daemons) and the ranks' TCP go over the
    # network the Spark tasks reach the driver on, not every interface there is;
    # the user's own OMPI_MCA_* choices win.
    subnet = network_of(driver_host)
    for param in ("oob_tcp_if_include", "btl_tcp_if_include"):
        if f"OMPI_MCA_{param}" not in os.environ:
            command += ["--mca", param, subnet]
    if os.geteuid() == 0:
        command.append("--allow-run-as-root")
    return command + ["sh", "-c", _APP]


class Mpirun:
    """mpirun on the driver, started once every rank's supervisor is listening."""

    def __init__(self, host_sizes: list[int], driver: tuple[str, int], secret: bytes):
        env = dict(os.environ, **as_root_env())
        env[RSH_ENV] = f"{driver[0]}:{driver[1]}:{secret.hex()}"
        self.proc = subprocess.Popen(mpirun_command(host_sizes, driver[0]), env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self._output: list[str] = []
        self._ended_at: float | None = None
        self._reader = threading.Thread(target=self._read, name="hvdmagic-mpirun", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if len(self._output) < 200:
                self._output.append(line.decode("utf-8", "replace").rstrip())
        self.proc.wait()
        self._ended_at = time.monotonic()

    def failure(self) -> str | None:
        """mpirun's own complaint, once it has exited non-zero and no rank explained why."""
        if self._ended_at is None or self.proc.returncode == 0 or time.monotonic() - self._ended_at < FAILURE_GRACE:
            return None
        said = [line for line in self._output if line.strip() and not set(line) <= set("-*= ")]
        return (f"mpirun exited with code {self.proc.returncode} before every rank had finished: "
                + (" ".join(said[:6])[:1200] if said else "it printed nothing"))

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=wait)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        self._reader.join(timeout=5)


class MpiDriver:
    """The driver's part: start mpirun once every rank can be adopted, and route its rsh requests.

    ``rsh`` comes from the agent mpirun started; it becomes an ``exec`` for the
    task that leads the named host, whose ``rsh_exit`` goes back to the agent.
    """

    EVENTS = frozenset({Event.READY, Event.RSH, Event.RSH_EXIT})

    def __init__(self, np: int, channel_address: tuple[str, int], secret: bytes):
        self.np = np
        self._address = channel_address
        self._secret = secret
        self._ready: set[int] = set()
        self._host_sizes: list[int] = []
        self._leaders: list = []  # by host index: the link of the task with local rank 0
        self._agents: dict[int, object] = {}
        self.mpirun: Mpirun | None = None

    def placed(self, slots: list, links: list) -> None:
        """The layout by task, and each task's link."""
        hosts: list[str] = []
        for slot in sorted(slots, key=lambda s: s.rank):
            if slot.host not in hosts:
                hosts.append(slot.host)
        self._host_sizes = [sum(1 for s in slots if s.host == host) for host in hosts]
        self._leaders = [next(links[t] for t, s in enumerate(slots) if s.host == host and s.local_rank == 0)
                         for host in hosts]

    def handle(self, link, event: dict) -> None:
        kind = event["type"]
        if kind == Event.READY:
            self._ready.add(event.get("task"))
            if len(self._ready) == self.np and self.mpirun is None:
                self.mpirun = Mpirun(self._host_sizes, self._address, self._secret)
        elif kind == Event.RSH:
            index = host_index(str(event.get("host")))
            if index is None or index >= len(self._leaders):
                link.send(protocol.rsh_exit(255))
                return
            request = len(self._agents) + 1
            self._agents[request] = link
            self._leaders[index].send(protocol.exec_command(request, str(event.get("command", ""))))
        elif kind == Event.RSH_EXIT and (agent := self._agents.get(event.get("id"))) is not None:
            try:
                agent.send(protocol.rsh_exit(int(event.get("code", 1))))
            except OSError:
                pass  # mpirun already stopped that agent

    def failure(self) -> str | None:
        return self.mpirun.failure() if self.mpirun else None

    def stop(self, clean: bool) -> None:
        if self.mpirun is None:
            return
        if clean:
            try:  # every rank has exited: mpirun is only tearing its daemons down
                self.mpirun.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.mpirun.stop()
