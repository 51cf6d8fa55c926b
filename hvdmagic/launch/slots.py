"""Barrier task slots: how many a Spark cluster offers, how many are on their way, how long to wait.

A barrier stage needs all its tasks running at once, and Spark, short of slots,
retries it silently for minutes; so hvdmagic counts the slots before it submits.
A count taken too early is wrong on a cluster that is still growing: an executor
takes seconds to tens of seconds to register (a worker that just joined, autoscaling,
dynamic allocation, a restarting worker, or only a loaded machine). So the check
waits while the cluster itself says that more slots are coming and that they would
be enough, up to a bound the user sets (``spark.hvdmagic.slotWait``, a Spark
setting, since it is the cluster that is slow or quick to grow). With nothing on its
way, too few slots are final SLOT_WAIT after the count last changed: a cluster that
is simply too small is reported within seconds.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from hvdmagic.launch import settings

SLOT_WAIT = 3.0  # seconds without a change, with too little on its way, before too few slots is final
BOUND_CONF = settings.SLOT_WAIT
DEFAULT_BOUND = 60.0  # seconds to wait for slots on their way (and for a new session's first executors)
LOOK_EVERY = 1.0  # seconds between looks at what is on its way: a few JVM calls, and a question to the master
_MASTER_ASK = 2  # seconds a standalone master gets to answer; one that does not says nothing


@dataclass(frozen=True)
class Coming:
    """Slots the cluster says are on their way, and what they are, for a message."""

    slots: int
    what: str  # e.g. "2 more core(s) that spark.cores.max=4 asks for"


@dataclass(frozen=True)
class Waited:
    """How a wait for slots ended."""

    slots: int  # free slots at the end
    seconds: float
    coming: Coming | None  # what was on its way at the end
    waited_for: str | None  # the last slots on their way that would have been enough, if any
    ran_out: bool  # the bound ended the wait while it waited for those
    bound: float

    def reason(self, np: int) -> str:
        """How long the check waited and for what: the clause its error adds."""
        waited = f"{self.seconds:.0f} s"
        if self.ran_out:
            return (f"after waiting {waited} for {self.waited_for} (the bound, {BOUND_CONF}={self.bound:g}; "
                    "set it higher for a cluster that takes longer to grow)")
        if self.coming:
            return (f"and the {self.coming.slots} more on their way ({self.coming.what}) would not make {np}, "
                    f"after {waited}")
        # A local master has every slot from the start: the check did not wait at all.
        return "and no more were on their way" + (f" after {waited}" if self.seconds >= 0.5 else "")

    def note(self) -> str | None:
        """For the run's record, when the cell waited for slots on their way."""
        if self.waited_for is None or self.ran_out:
            return None
        return f"the slot check waited {self.seconds:.0f} s for {self.waited_for}"


def bound(session) -> float:
    """The user's bound on waiting for slots on their way: spark.hvdmagic.slotWait, in seconds."""
    return settings.seconds(session, BOUND_CONF, DEFAULT_BOUND)


def available(sc) -> int:
    """Barrier task slots the cluster offers right now.

    Spark's own count (the one its barrier check uses) covers executor cores,
    spark.task.cpus and GPU amounts; the fallback counts cores only.
    """
    try:
        jsc = sc._jsc.sc()
        return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:
        pass
    master = sc.master
    if master == "local":
        return 1
    local = re.fullmatch(r"local\[(\*|\d+)(?:,\s*\d+)?\]", master)
    if local:
        return (os.cpu_count() or 1) if local.group(1) == "*" else int(local.group(1))
    task_cpus = int(sc.getConf().get("spark.task.cpus", "1"))
    return sc.defaultParallelism // max(1, task_cpus)


def on_their_way(sc, slots_now: int) -> Coming | None:
    """The most slots the cluster itself says are coming, or None.

    Three witnesses, each a count of cores not yet registered with the driver: a
    standalone master's executors granted to this application; the executors
    requested from the cluster manager (dynamic allocation's target); and what the
    application asked for (spark.cores.max, spark.executor.instances). Any of them
    may be unreadable on another Spark or cluster manager: it then says nothing,
    and the check is as strict as with nothing on its way.
    """
    if sc.master.startswith("local"):
        return None  # a local master has all its slots from the start
    try:
        backend = sc._jsc.sc().schedulerBackend()
        cores, executors = int(backend.totalCoreCount()), int(backend.totalRegisteredExecutors())
    except Exception:
        return None  # not a coarse-grained backend: nothing to compare with
    conf = sc.getConf()
    per_core = slots_now / cores if cores else 1 / max(1, int(conf.get("spark.task.cpus", "1")))
    per_executor = int(conf.get("spark.executor.cores", "0")) or max(1, cores // executors if executors else 1)
    dynamic = conf.get("spark.dynamicAllocation.enabled", "false").lower() == "true"
    seen = []
    for witness in (lambda: _granted_by_master(sc, backend, cores, per_executor),
                    lambda: _requested(backend, executors, per_executor, dynamic),
                    lambda: _asked_for(sc.master, conf, cores, executors, per_executor, dynamic)):
        with contextlib.suppress(Exception):  # Py4J errors, a master that does not answer
            if (found := witness()) and found[0] > 0:
                seen.append(found)
    if not seen:
        return None
    pending, what = max(seen, key=lambda found: found[0])
    return Coming(max(1, int(pending * per_core)), what)


def _granted_by_master(sc, backend, cores: int, per_executor: int) -> tuple[int, str] | None:
    """Cores of executors a standalone master has started for this application that the driver has not seen."""
    if not sc.master.startswith("spark://"):
        return None
    state = _master_state(sc, backend)
    if state is None:
        return None
    granted = next((app.get("cores", 0) for app in state.get("activeapps", []) if app.get("id") == sc.applicationId), 0)
    pending = granted - cores
    return pending, (f"{math.ceil(pending / per_executor)} executor(s) that the standalone master had started on "
                     f"its {state.get('aliveworkers', '?')} alive worker(s) and that had not registered yet")


_master_ui: dict[str, str] = {}  # by master address: its web UI, found once


def _master_state(sc, backend) -> dict | None:
    """What the alive standalone master's web UI shows as JSON (its workers, the applications'
    granted cores), or None.

    The driver knows the master's RPC address, not its web UI port; the master tells it, when
    asked over the driver's own RPC connection (BoundPortsRequest, as Spark's own test clusters
    ask). The UI it is, because the master's own state over RPC (RequestMasterState) arrives
    without the granted cores: those fields are transient.
    """
    for address in sc.master[len("spark://"):].split(","):
        with contextlib.suppress(Exception):
            if address not in _master_ui:
                _master_ui[address] = _ask_ui_address(sc, backend, address)
            try:
                with urllib.request.urlopen(f"{_master_ui[address]}/json/", timeout=_MASTER_ASK) as reply:
                    state = json.load(reply)
            except OSError:
                del _master_ui[address]  # a master that restarted may have moved its UI
                raise
            if state.get("status") == "ALIVE":
                return state
    return None


def _ask_ui_address(sc, backend, address: str) -> str:
    jvm = sc._jvm
    host, port = address.rsplit(":", 1)
    master = backend.rpcEnv().setupEndpointRef(jvm.org.apache.spark.rpc.RpcAddress(host, int(port)), "Master")
    ask = getattr(jvm.org.apache.spark.deploy.master, "MasterMessages$BoundPortsRequest$")
    reply = jvm.scala.reflect.ClassTag.apply(
        jvm.java.lang.Class.forName("org.apache.spark.deploy.master.MasterMessages$BoundPortsResponse"))
    timeout = jvm.org.apache.spark.rpc.RpcTimeout(
        jvm.scala.concurrent.duration.Duration.create(_MASTER_ASK, "seconds"), "hvdmagic slot check")
    return f"http://{host}:{master.askSync(getattr(ask, 'MODULE$'), timeout, reply).webUIPort()}"


def _requested(backend, executors: int, per_executor: int, dynamic: bool) -> tuple[int, str] | None:
    """Cores of executors requested from the cluster manager (dynamic allocation's target) not registered yet."""
    values = backend.getRequestedTotalExecutors().valuesIterator()
    requested = 0
    while values.hasNext():
        requested += int(values.next())
    pending = requested - executors
    asker = "dynamic allocation's target" if dynamic else "the request to the cluster manager"
    return pending * per_executor, f"{pending} executor(s) that {asker} of {requested} asks for"


def _asked_for(master: str, conf, cores: int, executors: int, per_executor: int,
               dynamic: bool) -> tuple[int, str] | None:
    """Cores the application's own settings ask for beyond those registered."""
    max_cores = conf.get("spark.cores.max", None)
    if master.startswith("spark://") and max_cores:
        pending = int(max_cores) - cores
        return pending, f"{pending} more core(s) that spark.cores.max={max_cores} asks for"
    instances = conf.get("spark.executor.instances", None)
    if instances and not dynamic:  # with dynamic allocation it is only the initial number
        pending = int(instances) - executors
        return pending * per_executor, f"{pending} more executor(s) that spark.executor.instances={instances} asks for"
    return None


def wait(np: int, slots: int, held: int, count: Callable[[], int], coming: Callable[[int], Coming | None],
         bound: float, stop: threading.Event | None = None) -> Waited:
    """Wait until ``np`` free slots are there, or until waiting is pointless; say how it ended.

    ``slots`` free slots now, ``held`` more held by a session's warm ranks; ``count()``
    counts all slots, ``coming(all slots now)`` says what is on its way. The check
    waits up to ``bound`` while enough is on its way or, for a new session, until its
    first executors register; else SLOT_WAIT after the count (or what is coming) last
    changed. ``stop`` ends it early: the cell that asked was interrupted.
    """
    start = changed = time.monotonic()
    looked = -math.inf
    seen: Coming | None = None
    waited_for, ran_out = None, False
    while slots < np and not (stop is not None and stop.is_set()):
        now = time.monotonic()
        if now - looked >= LOOK_EVERY:
            found, looked = coming(slots + held), now
            if (found and found.slots) != (seen and seen.slots):
                changed = now
            seen = found
        if seen is not None and slots + seen.slots >= np:
            awaited = seen.what
        elif slots + held == 0:  # a new session's first executors are surely on their way
            awaited = "the session's first executors"
        else:
            awaited = None
        waited_for = awaited or waited_for
        if now < changed + SLOT_WAIT:
            pass
        elif awaited is None:
            break
        elif now >= start + bound:
            ran_out = True
            break
        time.sleep(0.25)
        if (current := count() - held) != slots:
            slots, changed = current, time.monotonic()
    return Waited(slots, time.monotonic() - start, seen, waited_for, ran_out, bound)
