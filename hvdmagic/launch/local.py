"""Local mode (np < 0): the rank supervisors run as threads on the driver, no Spark."""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path

from hvdmagic.protocol import TaskSpec
from hvdmagic.task.shards import write_shard
from hvdmagic.task.supervisor import run_task


class LocalBackend:
    name = "local"
    bind_host = "127.0.0.1"

    def __init__(self, np: int, data=None):
        self.np = np
        self.data = data
        self._threads: list[threading.Thread] = []
        self._errors: list[str] = []
        self._shard_dir: str | None = None

    def describe(self) -> str:
        return f"local mode, {self.np} processes on the driver"

    def _write_shards(self) -> list[tuple[str, int] | None]:
        if self.data is None:
            return [None] * self.np
        table = self.data.toArrow()
        if table.num_rows < self.np:
            raise ValueError(f"--data has {table.num_rows} rows, fewer than the {self.np} ranks")
        self._shard_dir = tempfile.mkdtemp(prefix="hvdmagic-shards-")
        shards = []
        for task, part in enumerate(_split_round_robin(table, self.np)):
            path = Path(self._shard_dir) / f"shard-{task}.arrow"
            shards.append((str(path), write_shard(part.to_batches(), part.schema, path)))
        return shards

    def start(self, spec: TaskSpec) -> None:
        for task, shard in enumerate(self._write_shards()):
            thread = threading.Thread(target=self._run, args=(spec, task, shard), name=f"hvdmagic-local-{task}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()

    def _run(self, spec: TaskSpec, task: int, shard: tuple[str, int] | None) -> None:
        try:
            run_task(spec, task, shard=shard)
        except Exception as exc:  # reported through failure(); the job loop decides
            self._errors.append(f"local task {task} failed: {type(exc).__name__}: {exc}")

    def failure(self) -> str | None:
        return self._errors[0] if self._errors else None

    def cancel(self) -> None:
        pass  # supervisors obey the channel's abort; there is no scheduler to tell

    def join(self, timeout: float) -> None:
        for thread in self._threads:
            thread.join(timeout)
        if self._shard_dir:
            shutil.rmtree(self._shard_dir, ignore_errors=True)


def _split_round_robin(table, parts: int) -> list:
    """Row i goes to part i % parts, as Spark's repartition(np) deals rows: shards differ by a row at most."""
    return [table.take(list(range(i, table.num_rows, parts))) for i in range(parts)]
