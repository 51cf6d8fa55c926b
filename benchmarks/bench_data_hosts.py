#!/usr/bin/env python
"""``--data`` against its floor on 1 and 8 hosts: a cell's data cost next to Spark's own Arrow scan.

One command, from the repository root, as root (it makes network namespaces):

    .venv/bin/python benchmarks/bench_data_hosts.py --hosts 1,8 --rows 10000000,40000000

It prints a table and writes ``artifacts/bench_data_hosts.json``::

    {"runs": [{"hosts": 8, "ranks": 16, "rows": 40000000, "floor_s": [...], "data_cost_s": [...],
               "ratio": ..., ...}, ...], "conditions": {...}, "goal_ratio": 1.5}

For each number of hosts: that many simulated hosts (tests/netns.py: network namespaces on
one bridge, links uncapped), a standalone Spark cluster with one worker of ``--per-host``
cores on each (tests/helpers.py ``spark_cluster``, executors of ``--executor-memory``), and
the benchmark's own IPython shell (hvdmagic loaded, text view) whose SparkSession runs on it.
There are ranks = hosts x per-host. For each ``--rows``: ``df``, ``--columns`` float32
columns over ``ranks`` partitions (as bench_data.py's), is cached and counted first, so that
nothing below pays for generating it. If the cache does not fit in the executors' memory (any
of it on disk, or a partition not cached), that size is skipped and the JSON says why. Then,
``--reps`` times, in an order that rotates each repeat:

- **floor**: ``df.repartition(ranks).mapInArrow(count, "rows long").collect()``, where
  ``count`` counts the rows of every Arrow batch its Python worker receives and yields one
  row: Spark's own shuffle and scan that hands every row to Python as Arrow, with nothing
  written and no barrier. The counts must add up to the rows. Wall clock around the collect.
- **data cell**: ``%%horovod --np <ranks> --data df`` returning ``hvdmagic.shard().num_rows``
  (the same shuffle, in a barrier stage whose tasks write their shard beside their rank, which
  maps it). The run's note must say all the rows arrived, and every rank must have the
  same, padded, count.
- **launch cell**: the same cell without ``--data``, returning 0.

**data cost** is the data cell's wall time less the launch cell's, per repeat; the table
gives its median, the floor's median and their ratio (the issue's goal: at most 1.5x
everywhere), and the JSON every sample, the paired per-repeat ratios, each cell's start-up
stages (``last_run().timings``), the cache's size, and the other processes' load. One
warm-up round per cluster on a small frame of the same shape (floor, data cell, launch cell)
starts the executors' Python workers and the ranks' imports first. Everything runs on this
machine's cores, so more hosts means more processes sharing them, not more cores. Nothing is
asserted about timings.
"""

from __future__ import annotations

import argparse
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

log = _common.Log("bench_data_hosts")

GOAL_RATIO = 1.5  # issue 36: the data cost at most this many times the floor, everywhere
DATA_CELL = "%%horovod --np {np} --data df\nimport hvdmagic\nhvdmagic.shard().num_rows\n"
LAUNCH_CELL = "%%horovod --np {np}\nimport hvdmagic\n0\n"
NOTE = re.compile(r"data: (\d+) rows over (\d+) ranks, (\d+) per rank")
WARM_UP_ROWS_PER_RANK = 1000


def make_frame(spark, rows: int, columns: int, partitions: int, cache: bool = True):
    """bench_data.py's frame (float32 columns), over ``partitions`` partitions; cached and counted."""
    frame = spark.range(rows, numPartitions=partitions).selectExpr(
        *[f"cast(id * {i + 1} % 1000 as float) AS c{i}" for i in range(columns)])
    if cache:
        frame = frame.cache()
        frame.count()  # materialise, so neither side pays for generating the data
    return frame


def storage(spark) -> dict:
    """What the executors hold of the cached frames: bytes in memory and on disk, partitions cached of all."""
    infos = list(spark.sparkContext._jsc.sc().getRDDStorageInfo())
    return {"memory_bytes": sum(i.memSize() for i in infos), "disk_bytes": sum(i.diskSize() for i in infos),
            "partitions_cached": sum(i.numCachedPartitions() for i in infos),
            "partitions": sum(i.numPartitions() for i in infos)}


def row_counter():
    """The floor's function for mapInArrow: the rows of every batch it receives, as one row.

    Made here, so that cloudpickle sends it by value (the executors cannot import this module)."""

    def count(batches):
        import pyarrow as pa

        rows = 0
        for batch in batches:
            rows += batch.num_rows
        yield pa.RecordBatch.from_pydict({"rows": [rows]}, schema=pa.schema([("rows", pa.int64())]))

    return count


def floor(df, ranks: int, rows: int) -> float:
    """Spark's shuffle and Arrow scan into Python: wall seconds, the row counts checked."""
    started = time.perf_counter()
    counts = df.repartition(ranks).mapInArrow(row_counter(), "rows long").collect()
    seconds = time.perf_counter() - started
    if sum(r["rows"] for r in counts) != rows:
        raise RuntimeError(f"the floor's tasks counted {sum(r['rows'] for r in counts)} rows, not {rows}")
    return seconds


def data_cell(ip, hvdmagic, ranks: int, rows: int) -> tuple[float, dict]:
    """The ``--data`` cell: wall seconds and what its run record says, the shards checked."""
    _, started, ended = _common.checked_cell(ip, DATA_CELL.format(np=ranks))
    run = hvdmagic.last_run()
    counts = list(run.results)
    note = next((m for m in map(NOTE.search, run.notes) if m), None)
    if note is None or int(note[1]) != rows or int(note[2]) != ranks:
        raise RuntimeError(f"the data cell's note says {run.notes!r}, not {rows} rows over {ranks} ranks")
    if len(counts) != ranks or set(counts) != {int(note[3])}:
        raise RuntimeError(f"the ranks read {counts} rows, not {note[3]} each")
    return ended - started, {"stages": run.timings["stages"], "padding": sum(counts) - rows}


def launch_cell(ip, hvdmagic, ranks: int) -> tuple[float, dict]:
    _, started, ended = _common.checked_cell(ip, LAUNCH_CELL.format(np=ranks))
    results = list(hvdmagic.last_run().results)
    if results != [0] * ranks:
        raise RuntimeError(f"the launch cell returned {results}, not {ranks} zeros")
    return ended - started, {"stages": hvdmagic.last_run().timings["stages"]}


def measure(ip, spark, hosts: int, ranks: int, rows: int, columns: int, reps: int) -> dict:
    """One (hosts, rows) block: the frame cached, then ``reps`` rotating rounds of floor, data and launch."""
    import hvdmagic

    out: dict = {"hosts": hosts, "ranks": ranks, "rows": rows, "columns": columns,
                 "arrow_bytes": rows * columns * 4}  # raw float32: what the shuffle hands to Python
    try:
        df = make_frame(spark, rows, columns, ranks)
    except Exception as exc:  # an executor lost to memory, say: skipped, said why
        out["skipped"] = f"caching the frame failed: {str(exc).splitlines()[0]}"
        return out
    try:
        out["storage"] = held = storage(spark)
        log(f"{hosts} hosts, {rows} rows: cached, {held['memory_bytes'] / 2**20:.0f} MiB in memory, "
            f"{held['disk_bytes'] / 2**20:.0f} MiB on disk")
        if held["disk_bytes"] or held["partitions_cached"] < held["partitions"]:
            out["skipped"] = (f"the cache does not fit in the executors' memory: {held['memory_bytes'] / 2**20:.0f} "
                              f"MiB in memory, {held['disk_bytes'] / 2**20:.0f} MiB on disk, "
                              f"{held['partitions_cached']} of {held['partitions']} partitions cached")
            return out
        ip.user_ns["df"] = df
        samples: dict = {"floor": [], "data": [], "launch": [], "data_runs": [], "launch_runs": [], "failures": []}
        r = 0
        while len(samples["floor"]) < reps and len(samples["failures"]) < reps:
            got = {}
            try:
                for what in _common.rotated(["floor", "data", "launch"], r):
                    if what == "floor":
                        got["floor"] = floor(df, ranks, rows)
                    elif what == "data":
                        got["data"], got["data_run"] = data_cell(ip, hvdmagic, ranks, rows)
                    else:
                        got["launch"], got["launch_run"] = launch_cell(ip, hvdmagic, ranks)
            except Exception as exc:  # the repeat is dropped and counted, so one bad run does not hide the others
                samples["failures"].append(str(exc).splitlines()[0])
                log(f"{hosts} hosts, {rows} rows: repeat {r + 1} failed: {samples['failures'][-1]}")
                r += 1
                continue
            for key in ("floor", "data", "launch"):
                samples[key].append(got[key])
            samples["data_runs"].append(got["data_run"])
            samples["launch_runs"].append(got["launch_run"])
            log(f"{hosts} hosts, {rows} rows, repeat {r + 1}: floor {got['floor']:.2f} s, data cell "
                f"{got['data']:.2f} s, launch cell {got['launch']:.2f} s")
            r += 1
        out["storage_after"] = storage(spark)  # whether the shuffles evicted some of the cache
    finally:
        ip.user_ns.pop("df", None)
        df.unpersist(blocking=True)
    cost = [d - n for d, n in zip(samples["data"], samples["launch"])]
    out.update({"floor_s": samples["floor"], "data_cell_s": samples["data"], "launch_cell_s": samples["launch"],
                "data_cost_s": cost, "failures": samples["failures"],
                "data_stages": samples["data_runs"], "launch_stages": samples["launch_runs"]})
    if cost:
        out.update({"floor_median_s": statistics.median(samples["floor"]),
                    "data_cost_median_s": statistics.median(cost),
                    "data_cell_median_s": statistics.median(samples["data"]),
                    "launch_cell_median_s": statistics.median(samples["launch"]),
                    "paired_ratio": _common.paired(cost, samples["floor"], totals=True)})
        out["ratio"] = out["data_cost_median_s"] / out["floor_median_s"]
    return out


def warm_up(ip, spark, ranks: int, columns: int) -> None:
    """One round on a small frame of the same shape: the Python workers, the ranks' imports, the first jobs."""
    import hvdmagic

    rows = ranks * WARM_UP_ROWS_PER_RANK
    small = make_frame(spark, rows, columns, ranks, cache=False)
    ip.user_ns["df"] = small
    try:
        launch_cell(ip, hvdmagic, ranks)
        floor(small, ranks, rows)
        data_cell(ip, hvdmagic, ranks, rows)
    finally:
        ip.user_ns.pop("df", None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default="1,8", help="numbers of simulated hosts, comma-separated")
    parser.add_argument("--per-host", type=int, default=2, help="Spark cores, and so ranks, per host")
    parser.add_argument("--rows", default="10000000,40000000", help="the frame's rows, comma-separated")
    parser.add_argument("--columns", type=int, default=4, help="float32 columns")
    parser.add_argument("--reps", type=int, default=3, help="rounds of floor, data cell and launch cell")
    parser.add_argument("--executor-memory", default="2g",
                        help="spark.executor.memory (each worker offers 2g, so at most that)")
    parser.add_argument("--workdir", default=tempfile.gettempdir(), help="where the clusters' logs go")
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench_data_hosts.json"))
    args = parser.parse_args(argv)
    if why := netns.available():
        parser.error(f"simulated hosts cannot be made here: {why}")
    host_counts = [int(n) for n in args.hosts.split(",")]
    row_counts = [int(n) for n in args.rows.split(",")]

    ip = _common.ipython_shell()
    load = _common.LoadMonitor()
    report: dict = {"runs": [], "goal_ratio": GOAL_RATIO, "conditions": _common.environment(
        "pyspark", "pyarrow", command=_common.command_line(), per_host=args.per_host, columns=args.columns,
        reps=args.reps, executor_memory=args.executor_memory,
        hosts_layout="one simulated host per Spark worker (--per-host cores); network namespaces on one bridge, "
                     "links uncapped; every process on this machine's cores")}
    for hosts in host_counts:
        ranks = hosts * args.per_host
        workdir = Path(tempfile.mkdtemp(prefix=f"bench-data-hosts-{hosts}-", dir=args.workdir))
        try:
            with netns.Hosts(hosts) as network, \
                    spark_cluster(workdir, workers=hosts, cores=args.per_host, gpus=0, host=network.driver,
                                  worker_hosts=network.hosts, app=f"bench-data-hosts-{hosts}",
                                  conf={"spark.executor.memory": args.executor_memory,
                                        "spark.ui.enabled": "false",
                                        "spark.ui.showConsoleProgress": "false"}) as (_, spark):
                log(f"{hosts} hosts, {ranks} ranks: warming up")
                warm_up(ip, spark, ranks, args.columns)
                for rows in row_counts:
                    load.sample()
                    started = time.monotonic()
                    figures = measure(ip, spark, hosts, ranks, rows, args.columns, args.reps)
                    figures["block_s"] = time.monotonic() - started
                    figures["load"] = load.sample()
                    if "skipped" in figures:
                        log(f"{hosts} hosts, {rows} rows: skipped: {figures['skipped']}")
                    report["runs"].append(figures)
                    _common.write_json(args.out, report)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    print(f"\n--data against its floor: {args.columns} float32 columns, {args.per_host} ranks per host, "
          f"median of {args.reps}")
    print(f"{'hosts':>5}  {'ranks':>5}  {'rows':>10}  {'floor s':>8}  {'data cost s':>11}  {'ratio':>6}  "
          f"{'goal':>6}  {'others cores':>12}")
    for f in report["runs"]:
        head = f"{f['hosts']:>5}  {f['ranks']:>5}  {f['rows']:>10}"
        if "ratio" not in f:
            print(f"{head}  skipped: {f.get('skipped') or 'every repeat failed: ' + '; '.join(f['failures'])}")
            continue
        print(f"{head}  {f['floor_median_s']:8.2f}  {f['data_cost_median_s']:11.2f}  {f['ratio']:5.2f}x  "
              f"<= {GOAL_RATIO}x  {f['load']['others_cores']:12.2f}")
    _common.write_json(args.out, report)
    print(f"wrote {os.path.relpath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
