"""A fitted model's ``transform`` on the executors: the model's way there, and its progress in the notebook.

The model here is made, not fitted (fit is tests/test_spark_estimators.py's): a ``TorchModel`` over a
fresh torch module, so its bytes are new each run and no host's blob cache has them yet.
"""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest
from helpers import shell_reply, wait_until

from hvdmagic.launch.spark import kernel_host
from hvdmagic.spark.common import model_delivery, transform_progress
from hvdmagic.spark.torch import TorchModel

FEATURES = 64


def _frame(spark, rows: int, partitions: int):
    from pyspark.ml.functions import array_to_vector
    from pyspark.sql import functions as F

    return spark.range(rows, numPartitions=partitions).select(
        array_to_vector(F.array(*[((F.col("id") * (i + 3)) % 17 / 17.0).cast("double")
                                  for i in range(FEATURES)])).alias("features"),
        (F.col("id") % 5).cast("double").alias("y"))


def _model(hidden: int):
    import torch
    from pyspark.sql import types as T

    module = torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1))
    fitted = TorchModel(history={}, output_sizes=[1], label_types=[T.DoubleType()], fit_info={})
    fitted._set(model=module, feature_cols=["features"], label_cols=["y"], batch_size=64)
    return fitted, module


def _expected(module, frame) -> np.ndarray:
    import torch

    features = np.stack([row.features.toArray() for row in frame.select("features").collect()]).astype(np.float32)
    with torch.no_grad():
        return module(torch.from_numpy(features)).numpy()[:, 0]


def _progress_rows(host: str, before: set[str]) -> tuple[int, list[str]]:
    """The rows and states of the tasks reported to the progress server since ``before`` (task names)."""
    tasks = {name: value for cell in transform_progress.server_at(host).cells.values()
             for name, value in cell.tasks.items() if name not in before}
    return sum(rows for rows, _ in tasks.values()), sorted(state for _, state in tasks.values())


def _reported_tasks(host: str) -> set[str]:
    return {name for cell in transform_progress.server_at(host).cells.values() for name in cell.tasks}


@pytest.mark.profile
@pytest.mark.parametrize("spark_kind", ["connect"], indirect=True)  # where a UDF's bytes go with every task
def test_a_large_model_reaches_each_host_once_and_every_task_reports_its_rows(spark_kind):
    """Four tasks on one host: the model's 2 MiB come from the kernel once, and a second action and a
    second transform of the same model fetch nothing; each task's rows reach the progress server.
    On a classic session only the kernel's address differs (``kernel_host``, which every Spark cell's
    launch uses too); the test passed there as well when it was written, and runs on Connect alone to
    spare CI a minute."""
    spark_kind.makes_runs = False
    spark = spark_kind.session
    assert type(spark).__module__.startswith("pyspark.sql.connect")
    frame = _frame(spark, rows=2000, partitions=4)
    fitted, module = _model(hidden=8192)
    host = kernel_host(spark)
    before = _reported_tasks(host)

    predicted = fitted.transform(frame)
    model_bytes = len(fitted._model_bytes())
    assert model_bytes > model_delivery.INLINE_MAX
    server = model_delivery._servers[host].blobs
    server.reset_progress()
    got = np.array([row.y__output for row in predicted.select("y__output").collect()])
    assert np.allclose(got, _expected(module, frame), atol=1e-5), (got[:4], _expected(module, frame)[:4])
    sent = server.progress()
    assert sent.sent == model_bytes and len(sent.hosts) == 1, sent

    wait_until(lambda: _progress_rows(host, before) == (2000, ["done"] * 4), 30,
               lambda: f"the progress server has {_progress_rows(host, before)} for this action's tasks")

    server.reset_progress()
    assert fitted.transform(frame).select("y__output").count() == 2000
    assert predicted.write.format("noop").mode("overwrite").save() is None
    assert server.progress().sent == 0 and server.progress().requested == 0, server.progress()


@pytest.mark.unit
def test_a_small_model_travels_inside_the_udf_and_a_large_one_by_name():
    """The small models of tests/test_spark_estimators.py's transforms take the inline way."""
    small = model_delivery.source_for(b"s" * model_delivery.INLINE_MAX, "127.0.0.1", "a small model")
    assert small.inline is not None and small.blob is None and small.address is None
    large = model_delivery.source_for(b"l" * (model_delivery.INLINE_MAX + 1), "127.0.0.1", "a large model")
    assert large.inline is None and large.blob.size == model_delivery.INLINE_MAX + 1
    assert large.blob.digest == large.digest and large.address[0] == "127.0.0.1" and len(large.secret) == 32


@pytest.mark.unit
def test_a_model_let_go_by_the_kernel_fails_in_one_paragraph_that_says_to_transform_again(monkeypatch, tmp_path):
    from hvdmagic.task import batch_inference

    monkeypatch.setattr(model_delivery, "KEPT_BYTES", 3 << 20)
    first = model_delivery.source_for(b"a" * (2 << 20), "127.0.0.1", "TorchModel's model")
    model_delivery.source_for(b"b" * (2 << 20), "127.0.0.1", "another model")  # the two exceed KEPT_BYTES
    monkeypatch.setenv("HVDMAGIC_BLOB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"(?s)TorchModel's model.*could not be fetched.*call transform on the "
                                           r"model again"):
        batch_inference._model_bytes(first)


@pytest.mark.unit
def test_outside_a_kernel_the_progress_server_keeps_a_bounded_number_of_ended_tasks(monkeypatch):
    """A script's transforms all report to the one cell "" that is never shown: its oldest ended tasks go,
    and a running one stays."""
    from hvdmagic.task import transform_reports

    names = iter(f"0.{partition}.0" for partition in range(100))  # as Spark names a stage's tasks
    monkeypatch.setattr(transform_reports, "_task_name", lambda: next(names))
    monkeypatch.setattr(transform_progress, "KEPT_UNSHOWN", 3)
    server = transform_progress.ProgressServer("127.0.0.1")
    running = transform_reports.TaskReport(server.report_to)
    for _ in range(5):
        report = transform_reports.TaskReport(server.report_to)
        report.add(10)
        report.end(failed=False)
    # One link from this process, so the reports arrive in order: the last task's end is the last.
    wait_until(lambda: "" in server.cells and list(server.cells[""].tasks.values())[-1:] == [(10, "done")], 30,
               lambda: f"the server has {server.cells}")
    tasks = {task: state for (_, task), (_, state) in server.cells[""].tasks.items()}
    assert tasks == {"0.0.0": "running", "0.4.0": "done", "0.5.0": "done"}, tasks
    assert sorted(task for _, task in server._task_cell) == sorted(tasks), server._task_cell
    running.end(failed=False)


# -- the progress line in a real kernel -------------------------------------------------------------------------
# Two tasks as executors' workers run them (task.transform_reports), started in the cell; the cell waits until
# their first reports have reached the kernel's progress server, as an action's cell would be running then.
TASKS = """
import threading, time
from hvdmagic.spark.common import transform_progress
from hvdmagic.task.transform_reports import TaskReport

server = transform_progress.server_at("127.0.0.1")

def task(rows_each, steps):
    report = TaskReport(server.report_to)
    for _ in range(steps):
        time.sleep(0.25)
        report.add(rows_each)
    report.end(failed=False)

workers = [threading.Thread(target=task, args=(100, 14)), threading.Thread(target=task, args=(50, 4))]
for w in workers:
    w.start()
deadline = time.monotonic() + 30
while sum(len(cell.tasks) for cell in server.cells.values()) < 2:
    assert time.monotonic() < deadline, "the tasks' first reports did not reach the kernel's progress server"
    time.sleep(0.05)
"""


@pytest.mark.profile
def test_the_progress_line_shows_in_the_cell_that_ran_the_action_and_ends_with_the_totals(kernel):
    """The tasks start in one cell and end while the next runs: the line appears once they have run 2 s,
    in the first cell's output, is updated in place there, and its last update gives the totals."""
    _, client = kernel
    first = client.execute(TASKS)
    assert shell_reply(client, first, timeout=90)["status"] == "ok"
    second = client.execute("for w in workers:\n    w.join()")
    shown = []  # (the request it went to, its message type, its text)
    deadline = time.monotonic() + 60
    while not shown or "predicted by" not in shown[-1][2]:
        assert time.monotonic() < deadline, f"no final progress line within 60 s; shown: {shown}"
        try:
            msg = client.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if msg["msg_type"] in ("display_data", "update_display_data"):
            shown.append((msg["parent_header"].get("msg_id"), msg["msg_type"],
                          msg["content"]["data"]["text/plain"]))
        elif msg["msg_type"] == "error":
            raise AssertionError("\n".join(msg["content"]["traceback"]))
    assert shell_reply(client, second, timeout=30)["status"] == "ok"
    assert {request for request, _, _ in shown} == {first}, shown
    assert shown[0][1] == "display_data" and "task(s) running" in shown[0][2], shown
    assert all(kind == "update_display_data" for _, kind, _ in shown[1:]), shown
    assert shown[-1][2].startswith("transform: 1,600 rows predicted by 2 task(s) in "), shown
