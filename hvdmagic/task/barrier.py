"""The functions Spark runs in each task: find the task's GPUs, start its supervisor.

A job runs them in a barrier stage; an elastic job in a plain one (launch.elastic).

The driver (``hvdmagic.launch.spark``) ships them in the stage's closure; they run
in the executor's Python worker. On a Spark Connect session, which has no RDDs, the
stage is ``mapInArrow`` over a range with one row per task: ``arrow_task`` adapts a
task to it.

A task that cannot connect back to the kernel's job channel fails with one line that
starts with ``UNREACHABLE``, which the driver turns into a paragraph that says why and
what works instead (the kernel outside the cluster's network, on Spark Connect).
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from hvdmagic.protocol import TaskSpec
from hvdmagic.task.shards import write_shard
from hvdmagic.task.supervisor import run_task as supervise

UNREACHABLE = "hvdmagic-unreachable"
TASK_SCHEMA = "task int, code int"  # what each task sends back through Spark: its index and exit code
# Errors of a connect() that did not get through; on a connection already open, the errors differ.
_CONNECT_ERRNOS = {errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL}


class Unreachable(ConnectionError):
    """The task could not connect to the kernel's job channel."""


def run_task(spec: TaskSpec, task_index: int, gpus: list[str] | None = None,
             shard: tuple[str, int] | None = None, attempt: int = 0) -> int:
    """The task's supervisor; a channel it cannot connect to becomes ``Unreachable``, in one line
    that names this host and the kernel's address."""
    try:
        return supervise(spec, task_index, gpus, shard, attempt)
    except OSError as exc:
        if isinstance(exc, TimeoutError) or exc.errno in _CONNECT_ERRNOS:
            raise Unreachable(f"{UNREACHABLE}: the task on {socket.gethostname()} could not connect to "
                              f"{spec.driver_host}:{spec.channel_port}: {exc.strerror or exc}") from None
        raise


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


def arrow_task(task: Callable[[Iterator], Iterator[tuple[int, int]]]):
    """``task`` as ``mapInArrow`` runs it: Arrow batches in (the range's one row, read and dropped),
    and its (index, exit code) out as one batch typed as ``TASK_SCHEMA`` says."""

    def arrow(batches):
        import pyarrow as pa

        # Read the input to its end first: a Python worker whose input was left unread is not
        # reused, and starting a new one cost the next cell seconds.
        for _ in batches:
            pass
        schema = pa.schema([("task", pa.int32()), ("code", pa.int32())])
        for index, code in task(iter(())):
            yield pa.RecordBatch.from_pydict({"task": [index], "code": [code]}, schema=schema)

    return arrow


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
