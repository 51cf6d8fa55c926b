#!/usr/bin/env python
"""A large global read by a cell on 2 to 16 hosts: the time it adds, and the bytes the kernel sends.

One command, from the repository root, as root (it makes network namespaces):

    .venv/bin/python benchmarks/bench_fanout.py --hosts 2,4,8,16 --size-mb 1024

It prints a table and writes ``artifacts/fanout.json``::

    {"hosts": {"8": {"extra_s": ..., "kernel_bytes": ..., "blob_bytes": ..., ...}, ...},
     "conditions": {...}, "relay_off": {"2": {...}}}

For each number of hosts: that many simulated hosts (tests/netns.py: network namespaces on
one bridge, every link capped at ``--rate`` with tc: the kernel's uplink, each host's
downlink and uplink), a standalone Spark cluster with one 1-core worker on each, and the
benchmark's own IPython shell (hvdmagic loaded, text view) whose SparkSession runs on it.
A ``%%horovod --np <hosts>`` cell reads ``X``, a float64 array of ``--size-mb``, with content
no host has seen (one element changed each repeat); the same cell reading a 1 KiB ``Y``
runs beside it. **extra_s** is the X cell's wall time less the Y cell's, median over
``--reps``. **kernel_bytes** is what the kernel's blob server itself sent
(``last_run().shipping["from_kernel"]``) and **blob_bytes** X's size; every host must have
received ``blob_bytes`` (the shipping record's ``hosts``) and every rank the right sum,
or the run stops with why.

``--relay-off 2,4`` also runs those host counts with ``HVDMAGIC_BLOB_RELAY=0`` (every
host reads from the kernel, as before the fan-out): the comparison in the same run.

``--slow-host 16`` also runs those host counts with one host's links (down and up) at a
quarter of ``--rate``: a host on a busy rack. Each rank notes when its body started, which is
when its host had the blob; **others_extra_s** is, over the hosts but the slow one, the latest
of those less the cell's start, for X less for Y (median). The slow host's own time is its
link's. The goal: at most 1.25 times the even links' others_extra_s, the kernel sending at most
1.5 copies (``blob_transfer.RelayOrder`` moves a slow host to the chain's end).

The rate: this machine's 2 cores must move every host's copy (receive, check, pass on),
so the default 200 Mbit/s keeps 16 hosts link-bound, not CPU-bound, as a real cluster's
hosts are (each has its own cores). Each host's cache is its own directory in
``--workdir`` (by default the temporary directory). Nothing is asserted about timings.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))  # the simulated hosts and the standalone cluster the tests use

os.environ["HVDMAGIC_NONINTERACTIVE"] = "1"  # the text view: no widgets in a benchmark
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

import netns  # noqa: E402
from helpers import spark_cluster  # noqa: E402

from benchmarks import _common  # noqa: E402
from hvdmagic.blob_transfer import RELAY_ENV  # noqa: E402

log = _common.Log("bench_fanout")

MiB = 1 << 20
# Each rank prints its host's name (the namespace's), when its body started (its host then had the
# blob) and what it read. No collective: the slow host's rank starts minutes after the others, past
# Gloo's rendezvous timeout.
CELL = ("%%horovod --np {hosts}\nimport json, socket, time\n"
        "print('ARRIVED', json.dumps([socket.gethostname(), time.time(), float({name}[:10].sum())]))\n")
# The issue's goals: at 16 hosts, the extra time at most this many times 2 hosts', and the
# kernel sending at most this many copies.
GOAL_TIME_RATIO = 2.5
GOAL_COPIES = 1.5
GOAL_SLOW_HOST_RATIO = 1.25  # the other hosts' extra time with one slow host, over the even links'


def _cell(ip, hvdmagic, hosts: int, name: str, value, slow: str | None) -> tuple[float, float, dict | None]:
    """Run the cell reading ``name``; check every rank's sum; (wall seconds, seconds until the last
    host but ``slow`` had it, the shipping record)."""
    _, started, ended = _common.checked_cell(ip, CELL.format(hosts=hosts, name=name))
    result = [json.loads(line.split("ARRIVED ", 1)[1]) for text in hvdmagic.last_run().logs.values()
              for line in text.splitlines() if "ARRIVED " in line]
    if len(result) != hosts:
        raise RuntimeError(f"{len(result)} of {hosts} ranks said when they started")
    if any(row[2] != float(value[:10].sum()) for row in result):
        raise RuntimeError(f"a rank read other values from {name}: {[row[2] for row in result]}")
    others = [arrived for host, arrived, _ in result if host != slow]
    return ended - started, max(others) - started, hvdmagic.last_run().shipping


def measure(ip, hosts: int, x, small, reps: int, rate: str, workdir: Path, slow_rate: str | None = None) -> dict:
    """``slow_rate``: the first host's links at that rate (the slow host), the others' at ``rate``."""
    import hvdmagic

    out: dict = {"x_wall": [], "y_wall": [], "x_others": [], "y_others": [], "kernel_bytes": [], "text": []}
    with netns.Hosts(hosts, rate=rate, rates={0: slow_rate} if slow_rate else None) as network, \
            spark_cluster(workdir, workers=hosts, cores=1, gpus=0, host=network.driver,
                          worker_hosts=network.hosts, app=f"bench-fanout-{hosts}",
                          # 16 executors' JVMs start on 2 cores, behind the cluster just stopped: minutes
                          conf={"spark.hvdmagic.slotWait": "300"}):
        slow = network.hosts[0][1] if slow_rate else None  # its namespace: the rank's hostname there
        ip.user_ns.update(X=x, Y=small)
        _cell(ip, hvdmagic, hosts, "Y", small, slow)  # the executors' Python workers start and import
        for r in range(reps):
            for name in _common.rotated(["X", "Y"], r):
                if name == "Y":
                    wall, others, _ = _cell(ip, hvdmagic, hosts, "Y", small, slow)
                    out["y_wall"].append(wall)
                    out["y_others"].append(others)
                    continue
                x[0] = -1.0 - r - hosts * 1000 - (0.5 if slow_rate else 0)  # content no host holds
                wall, others, shipping = _cell(ip, hvdmagic, hosts, "X", x, slow)
                if shipping is None or not shipping["done"]:
                    raise RuntimeError(f"{hosts} hosts: X was not shipped ({shipping})")
                if sorted(shipping["hosts"].values()) != [x.nbytes] * hosts:
                    raise RuntimeError(f"{hosts} hosts: not every host received X once: {shipping['hosts']}")
                out["x_wall"].append(wall)
                out["x_others"].append(others)
                out["kernel_bytes"].append(shipping["from_kernel"])
                out["text"].append(shipping["text"])
                log(f"{hosts} hosts: X cell {wall:.2f} s, {shipping['text']}")
        for name in ("X", "Y"):
            ip.user_ns.pop(name, None)
    extras = [a - b for a, b in zip(out["x_wall"], out["y_wall"])]
    others = [a - b for a, b in zip(out["x_others"], out["y_others"])]
    return {"extra_s": statistics.median(extras), "extra_samples": extras,
            "others_extra_s": statistics.median(others), "others_extra_samples": others,
            "kernel_bytes": max(out["kernel_bytes"]), "blob_bytes": x.nbytes,
            "copies_from_kernel": max(out["kernel_bytes"]) / x.nbytes,
            "x_wall": out["x_wall"], "y_wall": out["y_wall"], "shipping": out["text"]}


def _quarter(rate: str) -> str:
    """A quarter of a tc rate: "200mbit" -> "50mbit"."""
    number, unit = re.fullmatch(r"(\d+(?:\.\d+)?)(\D*)", rate).groups()
    return f"{float(number) / 4:g}{unit}"


def main(argv=None) -> int:
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="2,4,8,16", help="numbers of simulated hosts, comma-separated")
    parser.add_argument("--size-mb", type=int, default=1024, help="the global's size in MiB")
    parser.add_argument("--rate", default="200mbit", help="every link's cap, in tc's units")
    parser.add_argument("--reps", type=int, default=2, help="X cells (and as many Y cells) per number of hosts")
    parser.add_argument("--relay-off", default="", help="host counts also run with the relays off (the baseline)")
    parser.add_argument("--slow-host", default="", help="host counts also run with one host's links at a quarter")
    parser.add_argument("--workdir", default=tempfile.gettempdir(), help="where the hosts' caches and logs go")
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "fanout.json"))
    args = parser.parse_args(argv)
    if why := netns.available():
        parser.error(f"simulated hosts cannot be made here: {why}")

    x = np.random.default_rng(5).random(args.size_mb * MiB // 8)
    small = np.ones(128)
    ip = _common.ipython_shell()
    report: dict = {"hosts": {}, "relay_off": {}, "slow_host": {}, "conditions": _common.environment(
        "pyspark", "numpy", rate=args.rate, size_mb=args.size_mb, reps=args.reps, command=_common.command_line(),
        hosts_layout="one simulated host per Spark worker (1 core); network namespaces on one bridge, every "
                     "link capped with tc tbf (the kernel's uplink, each host's downlink and uplink)")}
    runs = [("hosts", n) for n in map(int, filter(None, args.hosts.split(",")))]
    runs += [("slow_host", n) for n in map(int, filter(None, args.slow_host.split(",")))]
    runs += [("relay_off", n) for n in map(int, filter(None, args.relay_off.split(",")))]
    quarter = _quarter(args.rate)
    for kind, hosts in runs:
        workdir = Path(tempfile.mkdtemp(prefix=f"bench-fanout-{hosts}-", dir=args.workdir))
        os.environ[RELAY_ENV] = "0" if kind == "relay_off" else "1"
        try:
            started = time.monotonic()
            figures = measure(ip, hosts, x, small, args.reps, args.rate, workdir,
                              slow_rate=quarter if kind == "slow_host" else None)
            figures["run_s"] = time.monotonic() - started
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            os.environ.pop(RELAY_ENV, None)
        report[kind][str(hosts)] = figures
        _common.write_json(args.out, report)

    print(f"\n{args.size_mb} MiB global, links capped at {args.rate}, median of {args.reps}")
    print(f"{'hosts':>5}  {'links':>22}  {'relays':>6}  {'extra s':>8}  {'others extra s':>14}  "
          f"{'kernel sent (copies)':>21}")
    for key, links, relays in (("hosts", "even", "on"), ("slow_host", f"one at {quarter}", "on"),
                               ("relay_off", "even", "off")):
        for hosts, f in report[key].items():
            print(f"{hosts:>5}  {links:>22}  {relays:>6}  {f['extra_s']:8.2f}  {f['others_extra_s']:14.2f}  "
                  f"{f['copies_from_kernel']:21.2f}")
    by_hosts = report["hosts"]
    if "2" in by_hosts and "16" in by_hosts:
        ratio = by_hosts["16"]["extra_s"] / by_hosts["2"]["extra_s"]
        report["goal"] = {"time_ratio_16_to_2": ratio, "time_goal": GOAL_TIME_RATIO,
                          "copies_16": by_hosts["16"]["copies_from_kernel"], "copies_goal": GOAL_COPIES}
        print(f"16 hosts / 2 hosts: {ratio:.2f}x the extra time (goal <= {GOAL_TIME_RATIO}x); the kernel sent "
              f"{by_hosts['16']['copies_from_kernel']:.2f} copies (goal <= {GOAL_COPIES})")
    for hosts, slowed in report["slow_host"].items():
        if (even := by_hosts.get(hosts)) is not None:
            ratio = slowed["others_extra_s"] / even["others_extra_s"]
            report.setdefault("slow_host_goal", {})[hosts] = {"others_ratio": ratio, "goal": GOAL_SLOW_HOST_RATIO,
                                                              "copies": slowed["copies_from_kernel"]}
            print(f"{hosts} hosts, one at {quarter}: the others' extra time {ratio:.2f}x the even links' "
                  f"(goal <= {GOAL_SLOW_HOST_RATIO}x); the kernel sent {slowed['copies_from_kernel']:.2f} copies "
                  f"(goal <= {GOAL_COPIES})")
    _common.write_json(args.out, report)
    print(f"wrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
