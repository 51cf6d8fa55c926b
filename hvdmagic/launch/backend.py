"""What the job core asks of a backend, the place where one job's task supervisors run.

Runs in the kernel. ``Job`` (launch.job), ``ElasticJob`` (launch.elastic) and a warm
session's job (launch.warm_ranks) use a backend only through ``Backend``, and
``launch.make_backend`` is the one place that chooses one: ``spark.SparkBackend`` (a
barrier stage on the kernel's SparkSession) or ``local.LocalBackend`` (threads on the
driver). A Spark Connect session, which has no SparkContext in the kernel, is the Spark
backend with a small seam (``spark.SparkBackend.connect``); the job core stays as it is.
Imports ``hvdmagic.protocol`` only.
"""

from __future__ import annotations

from typing import Protocol

from hvdmagic.protocol import TaskSpec


class Backend(Protocol):
    """Runs ``np`` task supervisors (``hvdmagic.task.supervisor.run_task``) for one job.

    The job core calls ``describe()``, then ``start(spec)`` once, polls ``failure()``
    while the ranks run, calls ``cancel()`` when the job did not end cleanly, and
    ``join(timeout)`` last, always. Everything else (ranks, results, aborts) travels on
    the job's channel, which each supervisor dials back to ``bind_host``.
    """

    name: str
    """A short name for messages and the run's header (``"spark"``, ``"spark connect"``, ``"local"``);
    ``"local"`` also says that no cluster job exists to cancel."""

    np: int
    """How many task supervisors ``start`` runs: the job's ranks (an elastic job's ``max_np``)."""

    bind_host: str
    """The driver's address that the tasks reach; the job's channel and rendezvous listen on it."""

    job_group: str | None
    """The cluster's name for the job, for the run's record and its view; None where there is none."""

    notes: list[str]
    """Lines for the run's record about how the backend came to be (e.g. that it replaced a broken
    Spark session); ``make_backend`` sends them as ``Event.NOTE`` once the backend is made."""

    failure_details: str
    """The whole error behind ``failure()`` (a Java stack included), for ``LaunchError.details``;
    empty while there is none."""

    reconnect_grace: float
    """Seconds a task whose connection to the kernel broke may take to come back, unless the cell
    says (``--reconnect-grace``): ``spark.hvdmagic.reconnectGrace`` on Spark, else the default."""

    def describe(self) -> str:
        """Where the tasks run, in one line, for the job's LAUNCHING event."""
        ...

    def start(self, spec: TaskSpec) -> None:
        """Start ``np`` task supervisors with ``spec`` and return without waiting for them.

        A task that fails to run is reported through ``failure()``, not raised here.
        """
        ...

    def failure(self) -> str | None:
        """Why the tasks cannot run or report (e.g. the Spark stage failed), in one line; None while
        nothing failed. Polled by the job loop, which then fails the job with it."""
        ...

    def ended(self) -> bool:
        """Whether every task has ended (the Spark stage is over, the local threads returned), for
        whatever reason. The job loop fails the ranks whose end never reached it, rather than wait."""
        ...

    def cancel(self) -> None:
        """Stop what still runs of the tasks after a job that did not end cleanly. Never raises:
        there may be nothing left to cancel."""
        ...

    def join(self, timeout: float) -> None:
        """Wait for the tasks to end, up to ``timeout`` seconds for each thread that runs them,
        and free what the backend holds for them (local mode's shard files)."""
        ...
