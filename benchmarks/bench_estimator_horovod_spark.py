"""horovod.spark's own TorchEstimator, for bench_estimator.py: runs in a second interpreter.

horovod 0.28.1's Spark estimators need Petastorm, and so pyarrow < 11 and numpy < 2, which this
project's environment does not have; they run in their own virtualenv, whose pins are in
requirements/bench-horovod-spark.txt (how to build it is at its top; measured with CPython 3.11.7,
horovod 0.28.1, torch 2.13.0+cpu, pyspark 3.5.9, petastorm 0.12.1, pyarrow 10.0.1, numpy 1.26.4,
pandas 2.0.3). bench_estimator.py starts this file under that interpreter with
``--horovod-spark-python PATH`` and talks to it over a pipe, one command a line on stdin and one
JSON line a reply on stdout (a first one when it is ready), so that its rounds alternate with
hvdmagic's although the two run in separate processes with separate Spark sessions (each
``local[2]`` on loopback; the one not measuring sits idle). Everything else this process and its
ranks print (Spark, horovod, Petastorm) goes to stderr, which bench_estimator.py sends to a log.

The same rows, features, model and batch size as bench_estimator.py (its ``make_frame``,
``make_model`` and ``predict_batch_udf_column``), with two differences that horovod.spark needs:

- the model starts with ``Float32Input`` (a cast to float32): horovod.spark trains on float32
  (it casts every column), but its ``TorchModel.transform`` turns a vector column's float64
  values into a float64 tensor, which a float32 ``Linear`` refuses ("mat1 and mat2 must have
  the same dtype"). In training the cast does nothing.
- ``input_shapes=[[-1, features]]``: without it horovod.spark's training step fails
  (``TypeError: 'NoneType' object is not iterable`` in its ``prepare_batch``).

Commands: ``fit`` (a fresh Store in a temporary folder each time, so every fit writes its
Parquet as hvdmagic's ships its data each time; horovod.spark would otherwise reuse the Parquet
of an earlier fit of the same DataFrame and Store), ``transform``, ``udf`` (predict_batch_udf
with the fitted model, this interpreter's pyspark, for a yardstick between the two Sparks),
``first`` and ``udf_first`` (``take(1)``), ``quit``. horovod.spark's transform predicts one row
at a time, so it runs on a frame of ``--transform-rows`` rows (made the same way).

Its training time: rank 0's clock from its first batch's loss to its last (``timed_loss``),
which leaves out that first batch's reading and forward pass and the last backward pass.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch  # this module runs only in the second virtualenv and its ranks

CLOCK_ENV = "BENCH_HOROVOD_SPARK_CLOCK"  # the folder rank 0 writes its loss clock to, set before each fit
_clock: dict = {}  # in a rank: the clock file and the first loss's time


def timed_loss(output, label):
    """Cross-entropy, as bench_estimator.py's, that also writes this rank's seconds since its first call."""
    now = time.monotonic()
    if "fd" not in _clock:
        path = os.path.join(os.environ[CLOCK_ENV], "rank-" + os.environ.get("HOROVOD_RANK", "unknown"))
        _clock.update(fd=os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), first=now)
    os.pwrite(_clock["fd"], f"{now - _clock['first']:24.6f}".encode(), 0)
    return torch.nn.functional.cross_entropy(output, label.long())


class Float32Input(torch.nn.Module):
    """The model's first layer: its input as float32 (see the module's doc)."""

    def forward(self, x):
        return x.float()


def float32_model(features: int):
    from benchmarks.bench_estimator import make_model

    return torch.nn.Sequential(Float32Input(), *make_model(features))  # the same seeded layers as hvdmagic's


class Bench:
    def __init__(self, rows: int, features: int, transform_rows: int, batch: int):
        from pyspark.sql import SparkSession

        from benchmarks.bench_estimator import make_frame

        self.features, self.batch = features, batch
        self.spark = (SparkSession.builder.master("local[2]").appName("bench_estimator_horovod_spark")
                      .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
                      .config("spark.ui.showConsoleProgress", "false").getOrCreate())
        self.spark.sparkContext.setLogLevel("ERROR")
        self.df = make_frame(self.spark, rows, features)
        self.small = make_frame(self.spark, transform_rows, features) if transform_rows != rows else self.df
        self.fitted = None
        self.columns: dict = {}

    def fit(self) -> dict:
        from horovod.spark.common.backend import SparkBackend
        from horovod.spark.common.store import Store
        from horovod.spark.torch import TorchEstimator

        folder = tempfile.mkdtemp(prefix="bench-horovod-spark-")
        clock = Path(folder) / "clock"
        clock.mkdir()
        os.environ[CLOCK_ENV] = str(clock)  # the ranks get this process's environment
        model = float32_model(self.features)
        estimator = TorchEstimator(
            backend=SparkBackend(num_proc=2, use_gloo=True, nics=["lo"], verbose=0),
            store=Store.create(str(Path(folder) / "store")), model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.01), loss=timed_loss,
            feature_cols=["features"], label_cols=["label"], input_shapes=[[-1, self.features]],
            batch_size=self.batch, epochs=1, verbose=0)
        started = time.perf_counter()
        self.fitted = estimator.fit(self.df)
        wall = time.perf_counter() - started
        training = float((clock / "rank-0").read_text())
        shutil.rmtree(folder, ignore_errors=True)
        self.columns = {}
        return {"wall_s": wall, "training_s": training}

    def column(self, name: str):
        """The frame each transform command writes: horovod.spark's prediction, or predict_batch_udf's."""
        from benchmarks.bench_estimator import predict_batch_udf_column

        if name not in self.columns:
            if name == "transform":
                self.columns[name] = self.fitted.transform(self.small).select("label__output")
            else:
                self.columns[name] = self.small.select(
                    predict_batch_udf_column(self.fitted.getModel(), self.features).alias("out"))
        return self.columns[name]

    def run(self, command: str) -> dict:
        from benchmarks.bench_estimator import timed_first, timed_noop

        if command == "fit":
            return self.fit()
        if command in ("transform", "udf"):
            return {"seconds": timed_noop(self.column(command))}
        if command == "first":  # a new transform each time, as bench_estimator.py's own first-row rounds
            return {"seconds": timed_first(self.fitted.transform(self.small).select("label__output"))}
        if command == "udf_first":
            return {"seconds": timed_first(self.column("udf"))}
        raise ValueError(f"unknown command {command!r}")


def versions() -> dict:
    from importlib import metadata

    found = {}
    for name in ("horovod", "pyspark", "petastorm", "pyarrow", "numpy", "pandas", "torch"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return {"python": sys.version.split()[0], **found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--features", type=int, required=True)
    parser.add_argument("--transform-rows", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    args = parser.parse_args()
    replies = os.fdopen(os.dup(1), "w")  # the protocol's own stream; fd 1 itself goes to stderr from here on
    os.dup2(2, 1)
    root = str(Path(__file__).resolve().parent.parent)  # Spark's workers and the ranks import this module
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable

    def reply(value: dict) -> None:
        replies.write(json.dumps(value) + "\n")
        replies.flush()

    try:
        bench = Bench(args.rows, args.features, args.transform_rows, args.batch_size)
    except Exception as exc:
        reply({"error": f"{type(exc).__name__}: {exc}"})
        raise
    reply({"ready": True, "versions": versions()})
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        try:
            reply(bench.run(command))
        except Exception as exc:  # reported, so that bench_estimator.py can go on without this side
            import traceback

            traceback.print_exc()
            reply({"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"})
    bench.spark.stop()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks import bench_estimator_horovod_spark  # an importable module, not __main__: torch.save and

    bench_estimator_horovod_spark.main()  # cloudpickle name its loss and model class, which the ranks import
