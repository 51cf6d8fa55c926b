"""The DataFrame's columns, checked and prepared, for fit and for transform.

Everything here is Spark SQL, so it runs on a classic and on a Spark Connect session alike, and
lazily: a null in a feature column fails the stage that reads it (``raise_error``) with a message
naming the column, before any rank starts, instead of costing a pass of its own over the data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pyspark.sql import functions as F
from pyspark.sql import types as T

from hvdmagic.errors import HvdmagicError
from hvdmagic.rank.estimator_data import VALIDATION_COLUMN

_NUMERIC = (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.FloatType, T.DoubleType, T.DecimalType,
            T.BooleanType)


_NULL = "has a null value; drop or fill those rows (df.na.drop(subset=[...]))"
# The null's message, found in the error of the job that met it.
_RAISED_NULL = re.compile(r"hvdmagic: (\w[\w ]* column \S+ " + re.escape(_NULL) + ")")


class ColumnError(HvdmagicError, ValueError):
    """A column the estimator cannot use; the message names it and says why."""


def is_vector(data_type) -> bool:
    return type(data_type).__name__ == "VectorUDT"  # pyspark.ml.linalg's, from either module that defines it


def kind(df, name: str, role: str) -> str:
    """"scalar", "array" or "vector" for a usable column; a ColumnError naming it otherwise."""
    if name not in df.columns:
        raise ColumnError(f"the DataFrame has no {role} column {name!r}; its columns are {', '.join(df.columns)}.")
    data_type = df.schema[name].dataType
    if is_vector(data_type):
        return "vector"
    if isinstance(data_type, _NUMERIC):
        return "scalar"
    if isinstance(data_type, T.ArrayType) and isinstance(data_type.elementType, _NUMERIC):
        return "array"
    raise ColumnError(f"{role} column {name!r} is {data_type.simpleString()}: a {role} must be a number, an "
                      "array of numbers or an ML vector (VectorAssembler makes one of several columns).")


def as_arrow_friendly(df, name: str, column_kind: str, role: str):
    """The column as Arrow can carry it (a vector as an array of float32s), failing the stage on a null."""
    column = F.col(name)
    if column_kind == "vector":
        from pyspark.ml.functions import vector_to_array

        column = vector_to_array(column, "float32")
    elif column_kind == "scalar" and isinstance(df.schema[name].dataType, (T.DecimalType, T.BooleanType)):
        column = column.cast("double")
    message = f"hvdmagic: {role} column {name} {_NULL}"
    return F.when(F.col(name).isNull(), F.raise_error(F.lit(message))).otherwise(column).alias(name)


@dataclass
class Prepared:
    frame: object  # the DataFrame the ranks' shards are made of
    kinds: dict[str, str]  # by column: scalar, array or vector


def training_frame(df, feature_cols, label_cols, sample_weight_col, validation, seed) -> Prepared:
    """Only the columns training reads, Arrow-friendly, with the validation rows marked."""
    kinds = {}
    for role, names in (("feature", feature_cols), ("label", label_cols),
                        ("sample weight", [sample_weight_col] if sample_weight_col else [])):
        for name in names:
            kinds[name] = kind(df, name, role)
    if not feature_cols or not label_cols:
        raise ColumnError("the estimator needs feature_cols and label_cols: the columns the model reads and predicts.")
    columns = [as_arrow_friendly(df, name, kinds[name], "feature" if name in feature_cols else
                                 "label" if name in label_cols else "sample weight") for name in kinds]
    if isinstance(validation, str):
        if validation not in df.columns:
            raise ColumnError(f"validation={validation!r} names no column of the DataFrame; give a fraction of the "
                              "rows (0.1) or a boolean column that marks the validation rows.")
        columns.append(F.col(validation).cast("boolean").alias(VALIDATION_COLUMN))
    elif validation:
        if not 0 < float(validation) < 1:
            raise ColumnError(f"validation={validation!r}: a fraction of the rows is between 0 and 1 (0.1 holds out "
                              "a tenth), or name a boolean column.")
        columns.append((F.rand(seed) < float(validation)).alias(VALIDATION_COLUMN))
    return Prepared(df.select(*columns), kinds)


def first_rows_summary(prepared: Prepared, rows: int):
    """One job over at most ``rows`` rows: how many there are, and each array column's shortest and longest."""
    arrays = [name for name, k in prepared.kinds.items() if k != "scalar"]
    head = prepared.frame.limit(rows)
    aggregates = [F.count(F.lit(1)).alias("rows")]
    for i, name in enumerate(arrays):
        aggregates += [F.min(F.size(name)).alias(f"min{i}"), F.max(F.size(name)).alias(f"max{i}")]
    try:
        row = head.agg(*aggregates).first()
    except Exception as exc:
        # A null this job met (``as_arrow_friendly``'s raise_error). Spark 4 gives the message alone;
        # Spark 3.5's classic session wraps it in a Java stack.
        raised = _RAISED_NULL.search(str(exc))
        if raised is None:
            raise
        raise ColumnError(raised.group(1)) from None
    return row["rows"], {name: (row[f"min{i}"], row[f"max{i}"]) for i, name in enumerate(arrays)}


def check_shapes(sizes: dict[str, tuple[int, int]], kinds: dict[str, str], feature_cols, input_shapes) -> None:
    """``input_shapes`` against the features' sizes in the data, before any rank starts."""
    if input_shapes is None:
        return
    if len(input_shapes) != len(feature_cols):
        raise ColumnError(f"input_shapes has {len(input_shapes)} shape(s) for {len(feature_cols)} feature column(s) "
                          f"{feature_cols}: give one shape per feature column, -1 for the batch.")
    for name, shape in zip(feature_cols, input_shapes):
        fixed = 1
        for dim in shape:
            fixed *= 1 if dim == -1 else dim
        low, high = sizes.get(name, (1, 1)) if kinds[name] != "scalar" else (1, 1)
        if low != high:
            raise ColumnError(f"feature column {name!r} holds arrays of {low} to {high} values: a model input needs "
                              "the same number on every row.")
        if low is not None and low % fixed:
            raise ColumnError(f"input_shapes gives feature column {name!r} the shape {list(shape)} ({fixed} values "
                              f"a row), but its rows hold {low} values.")


def output_type(label_type, size: int):
    """horovod.spark's rule: a scalar label and one value out gives the label's type; else (a vector or
    array label, several values out, or a loaded model that does not know its label) a vector."""
    if size == 1 and isinstance(label_type, _NUMERIC) and not isinstance(label_type, T.BooleanType):
        return label_type
    from pyspark.ml.linalg import VectorUDT

    return VectorUDT()
