"""``SparkBackend``: how many processes a fit trains on, with horovod.spark's signature.

horovod.spark's backend starts its own Spark job and prints the ranks' output to ``stdout`` and
``stderr``. Here every fit runs through the launcher that ``%%horovod`` cells use, whose dashboard
shows the ranks' output and progress, so of its arguments only ``num_proc`` and ``env`` change
anything; the others are accepted so that existing code runs unchanged.
"""

from __future__ import annotations

from hvdmagic.errors import BadArgument


class SparkBackend:
    """The processes a fit runs on.

    Args:
        num_proc: the number of training processes (Spark barrier tasks); None (the default) takes
            the session's default parallelism, as horovod.spark does.
        env: environment variables for every rank.
        stdout, stderr, prefix_output_with_timestamp, verbose, **kwargs: horovod.spark's; accepted
            and not used (the dashboard shows every rank's output, and keeps it in
            ``hvdmagic.last_run().logs``).
    """

    def __init__(self, num_proc: int | None = None, env: dict | None = None, stdout=None, stderr=None,
                 prefix_output_with_timestamp: bool = False, verbose: int = 1, **kwargs):
        if num_proc is not None and (not isinstance(num_proc, int) or num_proc < 1):
            raise BadArgument(f"SparkBackend(num_proc=...) takes a positive number of processes, not {num_proc!r}.")
        self._num_proc = num_proc
        self.env = dict(env or {})

    def num_processes(self, session=None) -> int:
        """``num_proc``, or the session's default parallelism when it was not given."""
        if self._num_proc is not None:
            return self._num_proc
        if session is None:
            raise BadArgument("SparkBackend() without num_proc needs a SparkSession to count its slots")
        from hvdmagic.launch import spark_connect

        if spark_connect.is_connect(session):
            return spark_connect.available(session) or 1
        return session.sparkContext.defaultParallelism
