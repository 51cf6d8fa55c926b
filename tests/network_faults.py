"""Runs training jobs through hvdmagic's launcher under real network faults, inside a network namespace.

    ip netns exec <namespace> python tests/network_faults.py CASE [CASE ...]

The namespace is the test's own (``tests/test_network_faults.py``): only its loopback exists, so
``ss -K`` and ``iptables`` touch nothing but this process's connections. Every case runs ``--np 2``
on one embedded local Spark (one JVM for all cases): two barrier tasks whose supervisors talk to
this process, the kernel, over TCP, as executors on other machines do. Each prints one JSON line:
the case, whether the run succeeded, its error in one paragraph, rank 0's metric count, seconds.

The faults hit only the kernel's own ports (the job's channel and blob server, found as the
launcher makes them): Spark's JVM and py4j traffic is left alone, as the network between a
cluster's executors and its driver machine would leave the driver's JVM alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STEPS = 40
STEP_TIME = 0.25  # seconds of a step's "work": a run is long enough for the fault to land in its middle
FAULT_AT = 8  # the step at which rank 0 says it is training; the fault comes then
BLACKHOLE = 30.0  # seconds
LOSS = 0.05  # of the packets to and from the kernel's ports, for the whole run
SHORT_GRACE = 5.0  # the grace of the case whose fault outlasts it
ROWS_AT = 13.0  # seconds into a blackhole (the kernel finds the silence after 10) to read the rows
DEADLINE = 240.0  # for the fault's trigger: a run that never gets there is a failure, said so


def train(steps: int, step_time: float, stamp: str, value=None):
    import time

    import horovod.torch as hvd
    import torch

    import hvdmagic

    hvd.init()
    for step in hvdmagic.track(range(steps), desc="train"):
        time.sleep(step_time)  # the step's work
        loss = hvd.allreduce(torch.tensor([1.0 / (step + 1)])).item()
        hvdmagic.log_metrics(step=step, loss=loss)
        if step == FAULT_AT and hvd.rank() == 0:
            Path(stamp).touch()
    return {"steps": steps, "value_bytes": int(value.nbytes) if value is not None else 0}


class Ports:
    """The kernel's ports of the job running now, recorded as the launcher makes its servers."""

    def __init__(self):
        from hvdmagic import blob_transfer, channel

        self.channel: int | None = None
        self.blobs: int | None = None
        self.blob_server = None
        ports = self
        channel_server, blob_server = channel.ChannelServer, blob_transfer.BlobServer

        class RecordedChannel(channel_server):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                ports.channel = self.address[1]

        class RecordedBlobs(blob_server):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                ports.blobs, ports.blob_server = self.address[1], self

        channel.ChannelServer, blob_transfer.BlobServer = RecordedChannel, RecordedBlobs


def _run(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def reset(port: int) -> int:
    """Reset every connection the tasks hold to ``port`` (both ends see it broken); how many there were."""
    killed = _run("ss", "-K", "-tn", "dst", "127.0.0.1", "dport", "=", f":{port}")
    return sum(1 for line in killed.splitlines() if f":{port}" in line)


def _iptables(action: str, port: int, *match: str) -> None:
    for direction in ("--dport", "--sport"):
        _run("iptables", action, "INPUT", "-i", "lo", "-p", "tcp", direction, str(port), *match, "-j", "DROP")


def blackhole(port: int, seconds: float) -> None:
    """Packets to and from ``port`` vanish for ``seconds``: no reset, no error, only silence."""
    _iptables("-I", port)
    try:
        time.sleep(seconds)  # the fault's own length
    finally:
        _iptables("-D", port)


def loss(ports: list[int], probability: float):
    """Each packet to or from ``ports`` is dropped with ``probability``, until the returned undo runs."""
    match = ("-m", "statistic", "--mode", "random", "--probability", str(probability))
    for port in ports:
        _iptables("-I", port, *match)
    return lambda: [_iptables("-D", port, *match) for port in ports]


def _wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} never happened within {DEADLINE:g} s")
        time.sleep(0.05)


def run_case(case: str, ports: Ports, spark) -> dict:
    import numpy as np

    import hvdmagic

    stamp = Path(tempfile.mkdtemp(prefix="hvdmagic-netfault-")) / "training"
    value = None
    fault: dict = {"kind": case}
    trained = None

    def inject() -> None:
        try:
            if case == "blob_reset":
                # While the value streams to the hosts: once the blob server has sent some of it.
                deadline = time.monotonic() + DEADLINE
                while not _blob_streaming(ports):
                    if time.monotonic() > deadline:
                        raise TimeoutError("the value's transfer was never caught midway")
                    time.sleep(0.001)
                fault["connections"] = reset(ports.blobs)
                return
            _wait_for(stamp, "rank 0's training")
            fault["at"] = time.time()
            if case in ("reset", "session_reset"):
                fault["connections"] = reset(ports.channel)
            elif case in ("blackhole", "past_grace"):
                seconds = BLACKHOLE if case == "blackhole" else SHORT_GRACE * 3
                threading.Timer(ROWS_AT, _rows_now, args=(fault,)).start()
                blackhole(ports.channel, seconds)
        except Exception as exc:  # the case fails with why, rather than hang
            fault["error"] = f"{type(exc).__name__}: {exc}"

    injector = threading.Thread(target=inject, daemon=True)
    if case == "blob_reset":
        value = np.full(1 << 27, time.time())  # 1 GiB of float64 that no host has yet: a large value the cell reads
    started = time.monotonic()
    result = {"case": case}
    try:
        if case == "past_grace":
            spark.conf.set("spark.hvdmagic.reconnectGrace", str(SHORT_GRACE))
        injector.start()
        if case == "loss":
            # The whole run, from before launch: the ports are the job's, so they are set as it starts.
            threading.Thread(target=_lossy_when_launched, args=(ports, fault), daemon=True).start()
        if case == "session_reset":
            with hvdmagic.session(2) as session:
                hvdmagic.run(_warm_up, session=session)
                try:
                    values = hvdmagic.run(train, None, STEPS, STEP_TIME, str(stamp), session=session)
                finally:
                    trained = hvdmagic.last_run()
                # The session goes on: its ranks, their state, and the next cell.
                result["session_after"] = hvdmagic.run(_warm_up, session=session)
        else:
            values = hvdmagic.run(train, 2, STEPS, STEP_TIME, str(stamp), value)
        result.update(ok=True, value=values[0])
    except Exception as exc:
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    finally:
        result["seconds"] = round(time.monotonic() - started, 2)
        if case == "past_grace":
            spark.conf.unset("spark.hvdmagic.reconnectGrace")
        injector.join(timeout=BLACKHOLE * 2)
        if undo := fault.pop("undo", None):
            undo()
    record = trained if case == "session_reset" else hvdmagic.last_run()
    frame = record.metrics if record is not None else None
    result["rank0_metrics"] = int((frame["rank"] == 0).sum()) if frame is not None and len(frame) else 0
    result["fault"] = fault
    if "at" in fault:
        result["ended_after_fault"] = round(time.time() - fault["at"], 2)
    return result


def _rows_now(fault: dict) -> None:
    """What the rows say, as the dashboard and the text view show them, well into the blackhole."""
    import hvdmagic
    from hvdmagic.kernel.ui import progress_text

    record = hvdmagic.last_run()
    fault["rows"] = [progress_text.row_state(rank) for rank in record.ranks] if record is not None else []


def _lossy_when_launched(ports: Ports, fault: dict) -> None:
    deadline = time.monotonic() + DEADLINE
    while ports.channel is None or ports.blobs is None:
        if time.monotonic() > deadline:
            fault["error"] = "the job's ports never appeared"
            return
        time.sleep(0.01)
    try:
        fault["undo"] = loss([ports.channel, ports.blobs], LOSS)
    except Exception as exc:
        fault["error"] = f"{type(exc).__name__}: {exc}"


def _blob_streaming(ports: Ports) -> bool:
    """Whether the value is on its way, past its first 64 MiB and well before its end."""
    if ports.blob_server is None:
        return False
    progress = ports.blob_server.progress()
    return 64 << 20 < progress.from_kernel < progress.requested - (256 << 20)


def _warm_up():
    return 1


def main() -> int:
    _run("ip", "link", "set", "lo", "up")
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    os.environ["HVDMAGIC_NONINTERACTIVE"] = "1"
    cache = tempfile.TemporaryDirectory(prefix="hvdmagic-netfault-blobs-")  # the hosts' blob cache, this run's own
    os.environ["HVDMAGIC_BLOB_CACHE"] = cache.name
    ports = Ports()
    from pyspark.sql import SparkSession

    import hvdmagic

    hvdmagic.run(_warm_up, 2)  # starts the embedded Spark and the hosts' rank templates, once for every case
    spark = SparkSession.getActiveSession()
    for case in sys.argv[1:]:
        ports.channel = ports.blobs = ports.blob_server = None
        print(json.dumps(run_case(case, ports, spark)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
