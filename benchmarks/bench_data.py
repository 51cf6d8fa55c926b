"""Delivering a Spark DataFrame to 2 ranks: hvdmagic's Arrow shards against Petastorm's Spark converter.

The same cached DataFrame (``--rows`` x ``--columns`` float32 columns) goes to 2
consumers, each of which turns its share into per-column torch batches and
counts the rows:

- ``arrow``: ``hvdmagic.run(consume_shard, 2, data=df)``: a barrier ``mapInArrow``
  stage writes each rank's shard next to it, the rank reads it with
  ``hvdmagic.shard()``. Its data cost is the run's wall time minus that of the
  same run without data (the Horovod launch), measured alternately.
- ``petastorm``: ``make_spark_converter(df)`` writes Parquet to a cache folder;
  two spawned processes read ``make_torch_dataloader(cur_shard=i, shard_count=2)``.
  Its data cost is the conversion plus the slower reader. A second conversion of
  the same DataFrame hits Petastorm's cache ("warm").

Petastorm 0.12.1 needs pyarrow < 15 and numpy < 2, which this project's
environment does not have, so it runs in its own interpreter:

    .venv/bin/python benchmarks/bench_data.py --petastorm-python /tmp/peta-venv/bin/python

(``arrow`` alone: ``--modes arrow``.) See docs/workflow.md for the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this repository, for benchmarks._common

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

from benchmarks import _common  # standard library only: it also runs under --petastorm-python

RANKS = 2


def make_frame(spark, rows: int, columns: int):
    frame = spark.range(rows, numPartitions=RANKS).selectExpr(
        *[f"cast(id * {i + 1} % 1000 as float) AS c{i}" for i in range(columns)])
    frame = frame.cache()
    frame.count()  # materialise, so neither transport pays for generating the data
    return frame


def to_torch_batches(batch) -> dict:
    """One Arrow record batch as a dict of torch tensors, the shape Petastorm's loader yields."""
    import torch

    return {name: torch.from_numpy(batch.column(name).to_numpy()) for name in batch.schema.names}


def consume_shard(batch_size: int) -> dict:
    import torch  # noqa: F401  (imported before the clock starts, as in no_data)

    import hvdmagic

    start = time.perf_counter()
    table = hvdmagic.shard()
    rows = sum(len(to_torch_batches(batch)["c0"]) for batch in table.to_batches(max_chunksize=batch_size))
    return {"rows": rows, "seconds": time.perf_counter() - start}


def no_data() -> dict:
    """The baseline: the same launch and imports, no data."""
    import torch  # noqa: F401

    import hvdmagic  # noqa: F401

    return {"rows": 0, "seconds": 0.0}


def bench_arrow(rows: int, columns: int, batch_size: int, repeats: int) -> dict:
    import hvdmagic
    from hvdmagic.launch.spark import session_for

    frame = make_frame(session_for(RANKS), rows, columns)
    hvdmagic.run(no_data, RANKS)  # warm-up: Spark's first job and the ranks' imports
    with_data, without, in_rank, failures = [], [], [], []
    while len(with_data) < repeats and len(failures) < repeats:
        start = time.perf_counter()
        try:
            results = hvdmagic.run(consume_shard, RANKS, batch_size, data=frame)
        except Exception as exc:  # counted and reported, so one bad run does not hide the others
            failures.append(str(exc).splitlines()[0])
            continue
        with_data.append(time.perf_counter() - start)
        assert sum(r["rows"] for r in results) >= rows, results
        in_rank.append(max(r["seconds"] for r in results))
        start = time.perf_counter()
        hvdmagic.run(no_data, RANKS)
        without.append(time.perf_counter() - start)
    delivery = statistics.median(w - n for w, n in zip(with_data, without))
    return {"mode": "arrow", "rows": rows, "columns": columns, "run_with_data_s": statistics.median(with_data),
            "run_without_data_s": statistics.median(without), "delivery_s": delivery,
            "in_rank_read_s": statistics.median(in_rank), "rows_per_s": rows / delivery,
            "rows_per_rank": [r["rows"] for r in results], "failed_runs": failures}


def petastorm_reader(converter, shard: int, batch_size: int, queue) -> None:
    import petastorm.pytorch  # noqa: F401  (imports before the clock starts, as for the ranks)
    import torch  # noqa: F401

    start = time.perf_counter()
    rows = 0
    with converter.make_torch_dataloader(batch_size=batch_size, cur_shard=shard, shard_count=RANKS,
                                         num_epochs=1) as loader:
        for batch in loader:
            rows += len(batch["c0"])
    queue.put({"shard": shard, "rows": rows, "seconds": time.perf_counter() - start})


def read_with_petastorm(converter, batch_size: int) -> list[dict]:
    context = multiprocessing.get_context("spawn")  # a fresh process per rank, as hvdmagic's ranks are
    queue = context.Queue()
    readers = [context.Process(target=petastorm_reader, args=(converter, shard, batch_size, queue))
               for shard in range(RANKS)]
    for reader in readers:
        reader.start()
    results = sorted((queue.get(timeout=600) for _ in readers), key=lambda r: r["shard"])
    for reader in readers:
        reader.join()
    return results


def bench_petastorm(rows: int, columns: int, batch_size: int, repeats: int) -> dict:
    import warnings

    warnings.simplefilter("ignore")  # petastorm's pyarrow deprecation warnings, one per call
    from petastorm.spark import SparkDatasetConverter, make_spark_converter
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(f"local[{RANKS}]").config("spark.ui.enabled", "false")
             .config("spark.driver.memory", "4g").getOrCreate())
    frame = make_frame(spark, rows, columns)
    cold, warm, read = [], [], []
    for _ in range(repeats):
        cache = tempfile.mkdtemp(prefix="petastorm-cache-")
        spark.conf.set(SparkDatasetConverter.PARENT_CACHE_DIR_URL_CONF, "file://" + cache)
        start = time.perf_counter()
        converter = make_spark_converter(frame)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        make_spark_converter(frame)  # same plan: Petastorm reuses the Parquet it wrote
        warm.append(time.perf_counter() - start)
        results = read_with_petastorm(converter, batch_size)
        assert sum(r["rows"] for r in results) == rows, results
        read.append(max(r["seconds"] for r in results))
        converter.delete()
    delivery = statistics.median(c + r for c, r in zip(cold, read))
    return {"mode": "petastorm", "rows": rows, "columns": columns, "convert_cold_s": statistics.median(cold),
            "convert_warm_s": statistics.median(warm), "in_rank_read_s": statistics.median(read),
            "delivery_s": delivery, "rows_per_s": rows / delivery,
            "delivery_warm_s": statistics.median(w + r for w, r in zip(warm, read)),
            "rows_per_rank": [r["rows"] for r in results],
            "versions": _common.versions("petastorm", "pyarrow")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--columns", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="arrow,petastorm", help="comma-separated: arrow, petastorm")
    parser.add_argument("--petastorm-python", help="an interpreter with petastorm (pyarrow < 15, numpy < 2)")
    args = parser.parse_args()
    sizes = (args.rows, args.columns, args.batch_size, args.repeats)
    for mode in args.modes.split(","):
        if mode == "arrow":
            print(json.dumps(bench_arrow(*sizes)), flush=True)
        elif mode == "petastorm" and args.petastorm_python:
            command = [args.petastorm_python, __file__, "--modes", "petastorm", "--rows", str(args.rows),
                       "--columns", str(args.columns), "--batch-size", str(args.batch_size),
                       "--repeats", str(args.repeats)]
            subprocess.run(command, check=True)
        elif mode == "petastorm":
            print(json.dumps(bench_petastorm(*sizes)), flush=True)
        else:
            parser.error(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
