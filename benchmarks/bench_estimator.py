"""hvdmagic.spark's TorchEstimator: what fit costs beyond training, and transform against predict_batch_udf
and against horovod.spark's own TorchEstimator.

One Spark session (``local[2]``), one cached DataFrame of ``--rows`` rows: a ``--features``-long
vector column and a scalar label. Three measurements, each repeated ``--repeat`` times, alternated:

- ``fit``: ``TorchEstimator(num_proc=2, epochs=1).fit(df)`` with a small MLP. Its cost beyond the
  training is the fit's wall time minus the ranks' own training time (rank 0's clock around its
  epochs, ``fit_info["training_seconds"]``). Beside it, ``--data``'s hand-over of the same
  DataFrame: ``hvdmagic.run(read_every_batch, 2, data=df)``, whose ranks read their whole shard.
  The goal (issue 44): fit's cost beyond training <= 1.2x the hand-over.
- ``transform``: the fitted model's ``transform(df)``, written to Spark's ``noop`` sink (every row
  predicted, nothing kept), against ``pyspark.ml.functions.predict_batch_udf`` with the same
  model, rows and batch size. Throughput is rows per second; also the time from the action to
  the first row (``take(1)``).
- with ``--horovod-spark-python PATH``, horovod.spark's own ``TorchEstimator`` on the same rows,
  model and batch size (num_proc=2, its Store in a new temporary folder for each fit), in that
  interpreter (bench_estimator_horovod_spark.py; the virtualenv: requirements/bench-horovod-spark.txt).
  It runs in its own process with its own ``local[2]`` Spark session (pyspark 3.5), driven over a
  pipe so that its rounds take turns with hvdmagic's; each session sits idle while the other
  measures. Its fit's wall time and training time (rank 0's clock from its first loss to its
  last), its transform's throughput to the ``noop`` sink and its first row, and predict_batch_udf
  in its Spark as a yardstick between the two Sparks. Its transform predicts row by row, so it
  runs on ``--horovod-transform-rows`` rows (made the same way; default 20,000).

    .venv/bin/python benchmarks/bench_estimator.py [--rows 200000] [--features 64] [--repeat 3] \
        [--horovod-spark-python /path/to/venv/bin/python]

Every figure goes to ``artifacts/bench_estimator.json``; the table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common

BATCH = 256
ROOT = Path(__file__).resolve().parent.parent


class HorovodSpark:
    """bench_estimator_horovod_spark.py under another interpreter: one command a line, one JSON reply a line."""

    def __init__(self, python: str, rows: int, features: int, transform_rows: int):
        # Its own Spark: none of this process's Spark or hvdmagic settings (PYSPARK_PYTHON is this venv's)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "SPARK_", "HVDMAGIC_"))}
        env.update(SPARK_LOCAL_IP="127.0.0.1", PYTHONWARNINGS="ignore",  # Petastorm's pyarrow warnings
                   PYTHONPATH=str(ROOT))
        self.log = Path(tempfile.gettempdir()) / f"bench_estimator_horovod_spark-{os.getpid()}.log"
        self.process = subprocess.Popen(
            [python, str(ROOT / "benchmarks" / "bench_estimator_horovod_spark.py"), "--rows", str(rows),
             "--features", str(features), "--transform-rows", str(transform_rows), "--batch-size", str(BATCH)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log.open("w"), env=env, text=True,
            cwd=ROOT)
        print(f"horovod.spark's side logs to {self.log}", file=sys.stderr, flush=True)
        self.ready: dict | None = None
        self.error: str | None = None

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"horovod.spark's side exited (code {self.process.wait()}); see {self.log}")
        return json.loads(line)

    def wait_ready(self) -> dict:
        """Its Spark session and frames made: the versions on its side; raises where it failed."""
        self.ready = self._reply()
        if "error" in self.ready:
            raise RuntimeError(f"horovod.spark's side did not start: {self.ready['error']} (see {self.log})")
        return self.ready["versions"]

    def call(self, command: str) -> dict | None:
        """The command's figures; None, and ``error`` kept, where it failed (the rest goes on without it)."""
        if self.error:
            return None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        reply = self._reply()
        if "error" in reply:
            self.error = f"{command}: {reply['error']}"
            print(f"horovod.spark's {self.error} (see {self.log})", file=sys.stderr, flush=True)
            return None
        return reply

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
            self.process.wait(timeout=120)


def make_frame(spark, rows: int, features: int):
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    frame = spark.range(rows, numPartitions=2).select(
        array_to_vector(F.array(*[(F.col("id") * (i + 1) % 97 / 97.0).cast("double")
                                  for i in range(features)])).alias("features"),
        (F.col("id") % 10).cast("double").alias("label"))
    frame = frame.cache()
    frame.count()  # materialised: no measurement pays for generating the rows
    return frame


def make_model(features: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(features, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def read_every_batch(batch_size: int) -> int:
    """--data's consumer: the whole shard, batch by batch, as numpy."""
    import hvdmagic

    table = hvdmagic.shard()
    rows = 0
    for batch in table.to_batches(max_chunksize=batch_size):
        rows += len(batch.column(0).flatten().to_numpy(zero_copy_only=False)) and batch.num_rows
    return rows


def fit_once(df, features: int) -> tuple[float, float, object]:
    import torch

    from hvdmagic.spark.torch import TorchEstimator

    model = make_model(features)
    estimator = TorchEstimator(num_proc=2, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                               loss=lambda out, y: torch.nn.functional.cross_entropy(out, y.long()),
                               feature_cols=["features"], label_cols=["label"], batch_size=BATCH, epochs=1,
                               verbose=0)
    started = time.perf_counter()
    fitted = estimator.fit(df)
    return time.perf_counter() - started, fitted.fit_info["training_seconds"], fitted


def handover_once(df) -> float:
    import hvdmagic
    from hvdmagic.spark.common.columns import training_frame

    prepared = training_frame(df, ["features"], ["label"], None, None, None).frame  # what fit ships
    started = time.perf_counter()
    hvdmagic.run(read_every_batch, 2, BATCH, data=prepared)
    return time.perf_counter() - started


def predict_batch_udf_column(model, features: int):
    import cloudpickle
    from pyspark.ml.functions import predict_batch_udf, vector_to_array
    from pyspark.sql import types as T

    blob = cloudpickle.dumps(model)

    def make_predict_fn():
        import cloudpickle as pickler
        import torch

        loaded = pickler.loads(blob).eval()

        def predict(inputs):
            with torch.no_grad():
                return loaded(torch.from_numpy(inputs.astype("float32"))).numpy()
        return predict

    udf = predict_batch_udf(make_predict_fn, return_type=T.ArrayType(T.FloatType()), batch_size=BATCH,
                            input_tensor_shapes=[[features]])
    return udf(vector_to_array("features"))


def timed_noop(frame) -> float:
    started = time.perf_counter()
    frame.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - started


def timed_first(frame) -> float:
    started = time.perf_counter()
    frame.take(1)
    return time.perf_counter() - started


def seconds(reply: dict | None, key: str = "seconds") -> float | None:
    return None if reply is None else reply[key]


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--horovod-spark-python", help="an interpreter with horovod.spark (requirements/"
                        "bench-horovod-spark.txt): its TorchEstimator beside hvdmagic's")
    parser.add_argument("--horovod-transform-rows", type=int, default=20_000,
                        help="the rows of horovod.spark's transform, which predicts row by row")
    args = parser.parse_args()
    # Started first, so that its Spark session and frames are made while this one's are
    horovod = (HorovodSpark(args.horovod_spark_python, args.rows, args.features,
                            min(args.horovod_transform_rows, args.rows)) if args.horovod_spark_python else None)
    spark = _common.start_spark(2)
    df = make_frame(spark, args.rows, args.features)
    theirs_versions = horovod.wait_ready() if horovod else None
    fits, handovers, training = [], [], []
    h_fits, h_training = [], []
    fitted = None

    def ours_fit():
        nonlocal fitted
        handovers.append(handover_once(df))
        wall, trained, fitted = fit_once(df, args.features)
        fits.append(wall - trained)
        training.append(trained)

    def horovod_fit():
        reply = horovod.call("fit")
        h_fits.append(None if reply is None else reply["wall_s"] - reply["training_s"])
        h_training.append(seconds(reply, "training_s"))

    for round_ in range(args.repeat):  # with horovod.spark's, the side that goes first swapped each round
        for side in _common.rotated([ours_fit, horovod_fit] if horovod else [ours_fit], round_):
            side()
    fitted.setTransformBatchSize(BATCH)
    ours_column = fitted.transform(df).select("label__output")
    theirs_column = df.select(predict_batch_udf_column(fitted.getModel(), args.features).alias("out"))
    runs = {"ours": [], "theirs": [], "horovod": [], "horovod_udf": []}
    sides = [("ours", lambda: timed_noop(ours_column)), ("theirs", lambda: timed_noop(theirs_column))]
    if horovod:
        sides += [("horovod", lambda: seconds(horovod.call("transform"))),
                  ("horovod_udf", lambda: seconds(horovod.call("udf")))]
    for _, side in sides:  # all warm: Python workers started, models loaded
        side()
    for round_ in range(args.repeat):  # alternated, each side going first in turn
        for name, side in _common.rotated(sides, round_):
            runs[name].append(side())
    # The first row last: a take(1) leaves its Python worker's iterator unfinished, so Spark does not
    # reuse that worker, and the next full run pays a new worker's imports (torch: seconds).
    firsts = {"ours": [], "theirs": [], "horovod": [], "horovod_udf": []}
    for _ in range(args.repeat):
        firsts["ours"].append(timed_first(fitted.transform(df).select("label__output")))
        firsts["theirs"].append(timed_first(theirs_column))
        if horovod:
            firsts["horovod"].append(seconds(horovod.call("first")))
            firsts["horovod_udf"].append(seconds(horovod.call("udf_first")))
    if horovod:
        horovod.close()
    med = statistics.median
    ours, theirs = runs["ours"], runs["theirs"]
    figures = {
        "rows": args.rows, "features": args.features, "batch_size": BATCH, "repeat": args.repeat,
        "fit_beyond_training_s": fits, "training_s": training, "data_handover_s": handovers,
        "fit_beyond_training_over_handover": med(fits) / med(handovers),
        "transform_s": ours, "predict_batch_udf_s": theirs,
        "transform_rows_per_s": args.rows / med(ours), "predict_batch_udf_rows_per_s": args.rows / med(theirs),
        "transform_over_predict_batch_udf_throughput": med(theirs) / med(ours),
        "transform_first_row_s": firsts["ours"], "predict_batch_udf_first_row_s": firsts["theirs"],
        "environment": _common.environment("torch", "pyspark", "pyarrow"), "load_at_end": os.getloadavg(),
    }
    h_rows = min(args.horovod_transform_rows, args.rows)

    def rate(values):
        return None if median(values) is None else h_rows / median(values)

    if horovod:
        figures["horovod_spark"] = {
            "versions": theirs_versions, "error": horovod.error, "transform_rows": h_rows,
            "fit_beyond_training_s": h_fits, "training_s": h_training,
            "transform_s": runs["horovod"], "transform_rows_per_s": rate(runs["horovod"]),
            "predict_batch_udf_s": runs["horovod_udf"], "predict_batch_udf_rows_per_s": rate(runs["horovod_udf"]),
            "transform_first_row_s": firsts["horovod"], "predict_batch_udf_first_row_s": firsts["horovod_udf"],
        }
    h = figures.get("horovod_spark", {})
    rows = [  # what, hvdmagic, predict_batch_udf, horovod.spark, predict_batch_udf in horovod.spark's Spark
        ("fit beyond training (s)", med(fits), None, median(h_fits), None),
        ("  --data hand-over (s)", med(handovers), None, None, None),
        ("  training itself (s)", med(training), None, median(h_training), None),
        ("transform (rows/s)", figures["transform_rows_per_s"], figures["predict_batch_udf_rows_per_s"],
         h.get("transform_rows_per_s"), h.get("predict_batch_udf_rows_per_s")),
        ("  rows", args.rows, args.rows, h_rows if horovod else None, h_rows if horovod else None),
        ("first row (s)", med(firsts["ours"]), med(firsts["theirs"]), median(firsts["horovod"]),
         median(firsts["horovod_udf"])),
    ]
    print(f"{args.rows} rows x {args.features} features, batch {BATCH}, 2 ranks / local[2], medians of {args.repeat}")
    heads = ["hvdmagic", "predict_batch_udf"] + (["horovod.spark", "its predict_batch_udf"] if horovod else [])
    print(f"{'':<28}" + "".join(f"{head:>22}" for head in heads))
    for label, *values in rows:
        print(f"{label:<28}" + "".join(f"{value if isinstance(value, int) else _common.num(value):>22}"
                                        for value in values[:len(heads)]))
    print(f"fit beyond training / --data hand-over: {_common.num(figures['fit_beyond_training_over_handover'])} "
          "(goal <= 1.2)")
    print(f"transform / predict_batch_udf throughput: "
          f"{_common.num(figures['transform_over_predict_batch_udf_throughput'])} (goal >= 1.0)")
    if horovod:
        print(f"horovod.spark ({json.dumps(theirs_versions)}) in its own process and Spark session"
              + (f"; failed: {horovod.error}" if horovod.error else ""))
    _common.write_json(Path("artifacts") / "bench_estimator.json", figures)
    spark.stop()


if __name__ == "__main__":
    main()
