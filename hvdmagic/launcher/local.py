"""Local mode (np < 0): the rank supervisors run as threads on the driver, no Spark."""

from __future__ import annotations

import threading

from hvdmagic.launcher.supervisor import TaskSpec, run_task


class LocalBackend:
    name = "local"
    bind_host = "127.0.0.1"

    def __init__(self, np: int):
        self.np = np
        self._threads: list[threading.Thread] = []
        self._errors: list[str] = []

    def describe(self) -> str:
        return f"local mode, {self.np} processes on the driver"

    def start(self, spec: TaskSpec) -> None:
        for task in range(self.np):
            thread = threading.Thread(target=self._run, args=(spec, task), name=f"hvdmagic-local-{task}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _run(self, spec: TaskSpec, task: int) -> None:
        try:
            run_task(spec, task, lambda message: [message] * self.np)
        except Exception as exc:  # reported through failure(); the job loop decides
            self._errors.append(f"local task {task} failed: {type(exc).__name__}: {exc}")

    def failure(self) -> str | None:
        return self._errors[0] if self._errors else None

    def cancel(self) -> None:
        pass  # supervisors obey the channel's abort; there is no scheduler to tell

    def join(self, timeout: float) -> None:
        for thread in self._threads:
            thread.join(timeout)
