"""--data: every rank gets an equal-size, disjoint shard of a real Spark DataFrame."""

from __future__ import annotations

import pytest
from conftest import run

import hvdmagic

CELL = """%%horovod --np {np} --data frame
import hvdmagic
table = hvdmagic.shard()
sorted(table["id"].to_pylist()), table.column_names
"""


@pytest.mark.parametrize("np", [2, -2])
def test_shards_cover_every_row_once_with_documented_padding(ip, np, spark_kind):
    ip.user_ns["frame"] = spark_kind.session.range(1001).selectExpr("id", "id * 2 AS twice")
    _, error = run(ip, CELL.format(np=np))
    assert error is None, error
    shards = [ids for ids, _ in hvdmagic.last_run().results]
    assert hvdmagic.last_run().results[0][1] == ["id", "twice"]
    assert len(shards[0]) == len(shards[1]) == 501  # equal size: 1001 rows, one padded
    every = shards[0] + shards[1]
    assert set(every) == set(range(1001))  # every row ...
    assert len(every) - len(set(every)) == 1  # ... once, plus the one padding row
    assert "data: 1001 rows over 2 ranks, 501 per rank (1 repeated as padding)" in hvdmagic.last_run().notes


@pytest.mark.unit
def test_data_must_name_a_dataframe(ip):
    from IPython.core.error import UsageError

    ip.user_ns["not_a_frame"] = [1, 2]
    _, error = run(ip, "%%horovod --np 2 --data not_a_frame\nx = 1")
    assert isinstance(error, UsageError) and "Spark DataFrame" in str(error) and "list" in str(error)


def test_shard_without_data_explains_itself(ip):
    _, error = run(ip, "%%horovod --np -1\nimport hvdmagic\nhvdmagic.shard()")
    assert "run the cell with --data NAME" in str(error)
