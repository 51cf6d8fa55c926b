"""Spark Connect: the kernel holds a thin gRPC client, the session's driver runs elsewhere.

Runs in the kernel, for the Spark backend (``launch.spark``), which runs the same stage on a
classic or a Connect session and asks this module only what differs on Connect:

- which session: the notebook's Connect session (``active_session``), found without importing
  Connect's client when the notebook never used it, and never a classic session beside it;
- where the tasks dial back (``kernel_address``): on Connect the kernel is not the session's
  driver, so ``spark.driver.host`` names the server's machine, not this one. The kernel's
  address toward the server's host is the one a task on the cluster can hope to reach;
- how many barrier task slots the cluster offers (``available``): there is no SparkContext to
  ask, so the count comes from the server's settings and from the plan of a one-row range,
  whose split count is the server's ``defaultParallelism`` (its executors' cores);
- what an unreachable kernel looks like (``unreachable``), in one paragraph.

The stage itself (``spark.range(n, numPartitions=n).mapInArrow(fn, schema, barrier=True)``, as
pyspark's own TorchDistributor runs on Connect) and its cancellation by operation tag live in
``launch.spark``. Imports pyspark lazily, and Connect's client only through the session the
user made.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
import sys

from hvdmagic.launch.slots import Coming

_SPLITS = re.compile(r"\bRange \(0, 1, step=1, splits=(\d+)\)")
_LOCAL = re.compile(r"local\[(\*|\d+)(?:,\s*\d+)?\]")


def active_session():
    """The notebook's Spark Connect session (the calling thread's, else the process's default), or None.

    A Connect session lives in ``pyspark.sql.connect.session``; a kernel that never made one has
    not imported it, and this never imports it (that would need Connect's gRPC client).
    """
    module = sys.modules.get("pyspark.sql.connect.session")
    if module is None:
        return None
    cls = module.SparkSession
    # pyspark >= 4 asks _get_default_session(), which leaves out a stopped one; 3.5 clears the attribute
    # when its session stops, and has no such method.
    default = getattr(cls, "_get_default_session", None)
    return cls.getActiveSession() or (default() if default else cls._default_session)


def is_connect(session) -> bool:
    """Whether ``session`` is a Spark Connect session (``builder.remote(...)``, ``spark.api.mode=connect``)."""
    return session is not None and type(session).__module__.startswith("pyspark.sql.connect")


def remote_mode() -> bool:
    """Whether this process was put in Spark Connect mode (a ``remote()`` session was made here)."""
    if "pyspark.sql.utils" not in sys.modules:
        return False
    from pyspark.sql.utils import is_remote

    return is_remote()


def server(session) -> tuple[str, int]:
    """The Connect server's host and port, as the session dialled them."""
    builder = session.client._builder  # its endpoint is "host:port"; the client shows only the host
    host, _, port = str(getattr(builder, "endpoint", "") or f"{builder.host}:15002").rpartition(":")
    return host.strip("[]"), int(port or 15002)


def kernel_address(session) -> str:
    """The kernel's address toward the Connect server's host: where the job's channel listens.

    A server on this machine (127.0.0.1, localhost, ``remote("local[N]")``) gets 127.0.0.1, as
    hvdmagic's embedded session does; a remote one gets the address of the interface the kernel
    reaches it through (a UDP socket's local end after connect(), which sends nothing). Whether
    the server's executors can reach that address back is the reachability question:
    ``unreachable`` answers it when they cannot.
    """
    host, port = server(session)
    try:
        address = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except OSError:
        return "127.0.0.1"  # the client reached it some other way (a proxy): the tasks' first connection tells
    if ipaddress.ip_address(address).is_loopback:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, port))
        return probe.getsockname()[0]


_read: dict[tuple[str, str], str | None] = {}  # by (Connect session id, key): the settings read so far


def conf(session, key: str, default: str | None = None) -> str | None:
    """A setting of the Connect server, or ``default``.

    Only the server's static settings are read here (the master, task and executor sizes,
    ``spark.default.parallelism``), which no client can change while the server runs: each is
    asked once per session, and later cells make no round trip for it.
    """
    cache = (str(getattr(session, "session_id", id(session))), key)
    if cache not in _read:
        try:
            value = session.conf.get(key, None)
        except Exception:
            return default  # asked again next time: the server may have been busy
        _read[cache] = None if value is None else str(value)
    value = _read[cache]
    return default if value is None else value


def task_cpus(session) -> int:
    try:
        return max(1, int(conf(session, "spark.task.cpus", "1") or 1))
    except ValueError:
        return 1


def available(session) -> int | None:
    """Barrier task slots the Connect server's cluster offers now, or None when it cannot be told.

    A ``local[N]`` master has N; otherwise the server's ``defaultParallelism``, which Spark
    plans a range without a partition count over and which is its executors' cores (at least
    2), read from the plan of a one-row range (no job runs), divided by ``spark.task.cpus``.
    Where ``spark.default.parallelism`` is set, the plan shows that setting instead of the
    cores, and the count is unknown.
    """
    master = conf(session, "spark.master", "") or ""
    per_task = task_cpus(session)
    if master == "local":
        return 1
    local = _LOCAL.fullmatch(master)
    if local and local.group(1) != "*":
        return int(local.group(1)) // per_task
    if conf(session, "spark.default.parallelism") is not None:
        return None
    try:
        plan = session.range(1)._explain_string(mode="simple")
    except Exception:
        return None
    found = _SPLITS.search(plan)
    return int(found.group(1)) // per_task if found else None


def on_their_way(session, slots_now: int) -> Coming | None:
    """Slots the server's own settings ask for beyond those it has now, or None.

    On Connect only the settings are there to read (``spark.cores.max`` on a standalone
    master, ``spark.executor.instances`` times ``spark.executor.cores`` without dynamic
    allocation); the master's and the scheduler's own counts (``launch.slots.on_their_way``)
    need the SparkContext that Connect keeps on the server.
    """
    master = conf(session, "spark.master", "") or ""
    if master.startswith("local"):
        return None
    per_task = task_cpus(session)
    cores_now = slots_now * per_task
    with contextlib.suppress(ValueError, TypeError):
        if master.startswith("spark://") and (max_cores := conf(session, "spark.cores.max")):
            pending = int(max_cores) - cores_now
            if pending >= per_task:
                return Coming(pending // per_task, f"{pending} more core(s) that spark.cores.max={max_cores} asks for")
        dynamic = (conf(session, "spark.dynamicAllocation.enabled", "false") or "").lower() == "true"
        instances, cores = conf(session, "spark.executor.instances"), conf(session, "spark.executor.cores")
        if instances and cores and not dynamic:
            pending = int(instances) * int(cores) - cores_now
            if pending >= per_task:
                return Coming(pending // per_task,
                              f"{pending} more core(s) that spark.executor.instances={instances} asks for")
    return None


def unreachable(detail: str, bind_host: str, session) -> str:
    """The one paragraph for tasks that could not connect back to the kernel's job channel."""
    host, port = server(session) if session is not None else ("?", 0)
    if ipaddress_is_loopback(bind_host):
        # The server is this machine's only as far as the kernel knows: a tunnel, a proxy, a port forward.
        why = (f"the kernel reaches the Spark Connect server {host}:{port} through this machine's loopback (a "
               "tunnel or a port forward), so the executors have no address for this machine at all")
        fix = "or give the executors a route to this machine and reach the server by an address on it"
    else:
        why = (f"the executors cannot reach {bind_host}, the kernel's address toward the Spark Connect server "
               f"{host}:{port}, as when the notebook runs on a laptop outside the cluster's network")
        fix = "or open the kernel's TCP ports on that address to the executors' network"
    return (f"the Spark tasks could not connect back to this kernel ({detail}). hvdmagic's ranks report "
            f"to the notebook over the kernel's own authenticated channel, which listens on {bind_host}; {why}. "
            "Run the notebook on a machine the executors can reach (the cluster's driver, or a notebook "
            f"attached to the cluster), {fix}; docs/clusters.md#spark-connect says more.")


def ipaddress_is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
