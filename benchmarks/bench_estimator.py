"""hvdmagic.spark's TorchEstimator: what fit costs beyond training, and transform against predict_batch_udf.

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
- horovod.spark's own TorchEstimator is not run beside them yet: it needs a virtualenv with
  Petastorm, pyarrow < 11, numpy < 2 and a horovod built there (docs/performance.md).

    .venv/bin/python benchmarks/bench_estimator.py [--rows 200000] [--features 64] [--repeat 3]

Every figure goes to ``artifacts/bench_estimator.json``; the table to stdout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common

BATCH = 256


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    spark = _common.start_spark(2)
    df = make_frame(spark, args.rows, args.features)
    fits, handovers, training = [], [], []
    fitted = None
    for _ in range(args.repeat):
        handovers.append(handover_once(df))
        wall, trained, fitted = fit_once(df, args.features)
        fits.append(wall - trained)
        training.append(trained)
    fitted.setTransformBatchSize(BATCH)
    ours_column = fitted.transform(df).select("label__output")
    theirs_column = df.select(predict_batch_udf_column(fitted.getModel(), args.features).alias("out"))
    ours, theirs, ours_first, theirs_first = [], [], [], []
    timed_noop(ours_column), timed_noop(theirs_column)  # both warm: Python workers started, models loaded
    for round_ in range(args.repeat):  # alternated, the side that goes first swapped each round
        for side in ([ours, ours_column], [theirs, theirs_column])[::1 if round_ % 2 == 0 else -1]:
            side[0].append(timed_noop(side[1]))
    # The first row last: a take(1) leaves its Python worker's iterator unfinished, so Spark does not
    # reuse that worker, and the next full run pays a new worker's imports (torch: seconds).
    for _ in range(args.repeat):
        ours_first.append(timed_first(fitted.transform(df).select("label__output")))
        theirs_first.append(timed_first(theirs_column))
    med = statistics.median
    figures = {
        "rows": args.rows, "features": args.features, "batch_size": BATCH, "repeat": args.repeat,
        "fit_beyond_training_s": fits, "training_s": training, "data_handover_s": handovers,
        "fit_beyond_training_over_handover": med(fits) / med(handovers),
        "transform_s": ours, "predict_batch_udf_s": theirs,
        "transform_rows_per_s": args.rows / med(ours), "predict_batch_udf_rows_per_s": args.rows / med(theirs),
        "transform_over_predict_batch_udf_throughput": med(theirs) / med(ours),
        "transform_first_row_s": ours_first, "predict_batch_udf_first_row_s": theirs_first,
        "environment": _common.environment("torch", "pyspark", "pyarrow"),
    }
    rows = [
        ("fit beyond training (s)", med(fits)), ("  --data hand-over (s)", med(handovers)),
        ("  ratio (goal <= 1.2)", figures["fit_beyond_training_over_handover"]),
        ("  training itself (s)", med(training)),
        ("transform (rows/s)", figures["transform_rows_per_s"]),
        ("  predict_batch_udf (rows/s)", figures["predict_batch_udf_rows_per_s"]),
        ("  ratio (goal >= 1.0)", figures["transform_over_predict_batch_udf_throughput"]),
        ("transform, first row (s)", med(ours_first)), ("  predict_batch_udf, first row (s)", med(theirs_first)),
    ]
    print(f"{args.rows} rows x {args.features} features, batch {BATCH}, 2 ranks / local[2], medians of {args.repeat}")
    for label, value in rows:
        print(f"{label:<36} {_common.num(value)}")
    _common.write_json(Path("artifacts") / "bench_estimator.json", figures)
    spark.stop()


if __name__ == "__main__":
    main()
