"""Issue 60: checkpoints, a Store and saved stages on a URL that fsspec opens, against a real S3-protocol
server on loopback (moto's, tests/s3_server.py); the missing driver named before anything starts.

The fit that checkpoints to s3://, is stopped and resumes is in tests/test_spark_estimators.py."""

from __future__ import annotations

import numpy as np
import pytest

from hvdmagic.file_urls import Folder
from hvdmagic.rank import training
from hvdmagic.spark.common.store import Store


def _objects(url: str) -> list[str]:
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    return sorted(path.rsplit("/", 1)[1] for path in fs.find(url))


def test_checkpoints_go_to_s3_whole_and_the_newest_comes_back(s3_bucket):
    import torch

    directory = f"{s3_bucket}/runs/r1/checkpoint"
    assert training.load_checkpoint(directory) == (None, None)
    for step in range(3):
        written = training.save_checkpoint({"w": torch.full((2,), float(step))}, directory, step=step, keep=2)
        assert written == f"{directory}/checkpoint-{step}.pt"
    assert _objects(directory) == ["checkpoint-1.pt", "checkpoint-2.pt"]  # keep=2: the oldest went
    state, step = training.load_checkpoint(directory)
    assert step == 2 and torch.equal(state["w"], torch.full((2,), 2.0))

    def dies_mid_write(path):
        path.write_bytes(b"half a checkp")
        raise KeyboardInterrupt  # Stop, mid-write

    with pytest.raises(KeyboardInterrupt):
        Folder(directory).write("checkpoint-3.pt", dies_mid_write)
    assert _objects(directory) == ["checkpoint-1.pt", "checkpoint-2.pt"], "a half-written checkpoint was uploaded"


def test_a_store_on_a_url_keeps_it_and_a_missing_driver_is_named_before_any_rank_starts(s3_bucket, tmp_path):
    store = Store.create(f"{s3_bucket}/runs/")
    assert store.get_checkpoint_path("r1") == f"{s3_bucket}/runs/runs/r1/checkpoint"
    assert store.get_logs_path("r1") == f"{s3_bucket}/runs/runs/r1/logs"
    assert not store.exists(store.get_run_path("r1"))
    assert Store.create(f"file://{tmp_path}").get_checkpoint_path("r1") == str(tmp_path / "runs" / "r1" / "checkpoint")

    with pytest.raises(ValueError) as raised:
        Store.create("gs://bucket/runs")  # gcsfs is not installed here
    assert "install gcsfs on the driver and on every host" in str(raised.value)
    with pytest.raises(ValueError, match=r"no file system for nofs://.*Protocol not known"):
        Store.create("nofs://bucket/runs")
    with pytest.raises(ValueError, match=r"Databricks' /dbfs mount \(/dbfs/tmp/runs\), which this machine lacks"):
        Store.create("dbfs:/tmp/runs")


def test_a_model_saves_to_s3_through_fsspec_where_spark_has_no_s3_and_loads_back(s3_bucket, tmp_path, monkeypatch):
    """Whether or not a SparkSession is active in this process: a laptop's Spark has no s3:// file system,
    so fsspec's driver writes the stage; never a local directory named after the scheme."""
    import torch

    from hvdmagic.spark.common.persistence import StageIOError
    from hvdmagic.spark.torch import TorchModel

    torch.manual_seed(0)
    model = TorchModel(history={"loss": [1.0, 0.5]}, output_sizes=[1])
    model._set(model=torch.nn.Linear(2, 1), feature_cols=["features"], label_cols=["y"])
    monkeypatch.chdir(tmp_path)
    url = f"{s3_bucket}/models/linear"
    model.write().save(url)
    assert _objects(url) == ["_SUCCESS", "architecture.pkl", "model.pt", "objects.pkl", "part-00000"]
    assert not (tmp_path / "s3:").exists()
    with pytest.raises(FileExistsError, match="overwrite"):
        model.write().save(url)
    model.write().overwrite().save(url)

    loaded = TorchModel.load(url)
    assert loaded.uid == model.uid and loaded.getHistory() == {"loss": [1.0, 0.5]}
    weights = (np.asarray(m.getModel().weight.detach()) for m in (model, loaded))
    assert np.array_equal(*weights)

    with pytest.raises(StageIOError) as raised:
        TorchModel.load(f"{s3_bucket}/models/absent")
    assert "absent: no such directory" in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(StageIOError) as raised:
        model.write().save("nofs://bucket/model")
    message = str(raised.value)
    assert message.startswith("nofs://bucket/model: no file system here writes nofs:// ("), message
    assert "fsspec: Protocol not known: nofs" in message and "\n" not in message
    assert not (tmp_path / "nofs:").exists()
