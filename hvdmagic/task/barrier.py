"""The functions Spark runs in each task: find the task's GPUs, start its supervisor.

A job runs them in a barrier stage; an elastic job in a plain one (launch.elastic).

The driver (``hvdmagic.launch.spark``) ships them in the stage's closure; they run
in the executor's Python worker.
"""

from __future__ import annotations

import os
from pathlib import Path

from hvdmagic.protocol import TaskSpec
from hvdmagic.task.shards import write_shard
from hvdmagic.task.supervisor import run_task


def task_gpus(context) -> list[str]:
    """The task's GPU addresses, as physical device numbers.

    Spark's addresses index the executor's own view; when the executor already
    runs under CUDA_VISIBLE_DEVICES, address i means the i-th device listed there.
    """
    resource = context.resources().get("gpu")
    if resource is None:
        return []
    addresses = list(resource.addresses)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        listed = [d.strip() for d in visible.split(",") if d.strip()]
        addresses = [listed[int(a)] if a.isdigit() and int(a) < len(listed) else a for a in addresses]
    return addresses


def barrier_task(spec: TaskSpec):
    def task(_partition):
        from pyspark import BarrierTaskContext

        context = BarrierTaskContext.get()
        code = run_task(spec, context.partitionId(), task_gpus(context))
        yield context.partitionId(), code

    return task


def elastic_task(spec: TaskSpec):
    """An elastic job's task: a plain one, since a barrier stage fails as a whole when one task does."""

    def task(_partition):
        from pyspark import TaskContext

        context = TaskContext.get()
        code = run_task(spec, context.partitionId(), task_gpus(context), attempt=context.attemptNumber())
        yield context.partitionId(), code

    return task


def sharded_barrier_task(spec: TaskSpec, schema):
    """The barrier task for --data: its partition arrives as Arrow batches and becomes the rank's shard."""

    def task(batches):
        import shutil
        import tempfile

        import pyarrow as pa
        from pyspark import BarrierTaskContext

        context = BarrierTaskContext.get()
        directory = Path(tempfile.mkdtemp(prefix="hvdmagic-shard-"))
        try:
            path = directory / "shard.arrow"
            rows = write_shard(batches, schema, path)
            code = run_task(spec, context.partitionId(), task_gpus(context), (str(path), rows))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        # Typed as the stage declares them: pyarrow's default int64 makes Spark fail reading "int".
        yield pa.RecordBatch.from_pydict({"task": [context.partitionId()], "code": [code]},
                                         schema=pa.schema([("task", pa.int32()), ("code", pa.int32())]))

    return task
