"""The driver's side of a job: the one launcher core behind the magics, the Python API and local mode.

Runs in the notebook kernel (or any driver process). ``launch()`` runs one job where
its ``Placement`` says; the modules:

- ``placement``: ``Placement`` (how many ranks, where, which framework and controller,
  the elastic range) and ``Elastic``: built and checked once, where a run is asked for.
- ``job``: ``Job``, one job: the channel, the rendezvous, the tasks' hellos and gos, the
  events until every rank has exited, fail-fast and the watchdogs.
- ``elastic``: ``ElasticJob``, Horovod's elastic driver with Spark tasks as its hosts.
- ``warm_ranks``: ``Session``, one job whose ranks stay up and run cells as they come.
- ``pdb_relay``: ``PdbRelay``, the kernel's side of a rank's pdb (``Session.debug``).
- ``breakpoint_prompts``: ``BreakpointPrompts``, the prompts of a running cell's ranks stopped at
  ``breakpoint()``, one rank at a time, on the kernel's ``Console``.
- ``held_rank``: ``HeldRank``, a fresh cell's failed rank kept for ``%debug`` (``--hold-on-error``).
- ``backend``: what a job asks of a backend (``Backend``); ``make_backend`` picks one.
  ``spark`` (a Spark stage, on a classic or a Spark Connect session) and ``local``
  (threads on the driver).
- ``spark_session``: finds, starts or replaces the SparkSession ``spark`` runs on (the
  Java check, the JVM's log); ``spark_connect``: what differs on a Spark Connect session
  (the session, the kernel's address, the slot count); ``slots`` counts a Spark cluster's
  task slots.
- ``shipment``: what a run ships: the payload, its large buffers out of band and named by
  content, for the job's blob server (``hvdmagic.blob_transfer``) to send once per host.
- ``layout``: Horovod's ranks, local ranks and cross ranks from the tasks' hosts.
- ``rendezvous`` (Horovod's Gloo rendezvous) and ``torch_store`` (torch.distributed's).
- ``versions``: the tasks' Python and packages against the kernel's, before any rank starts.
- ``mpi`` and ``mpi_rsh``: ``--controller mpi``; ``interrupts``: Ctrl-C while launching.

Modules here may import ``hvdmagic.protocol``, ``channel``, ``blob_transfer``, ``errors``, ``pickling``,
``hvdmagic.task`` (whose code they ship to the tasks), pyspark, torch and horovod's
runner (lazily: importing this package must work without them); never
``hvdmagic.kernel``, IPython or widgets.
"""

from __future__ import annotations

from collections.abc import Callable

from hvdmagic import protocol
from hvdmagic.errors import LaunchError
from hvdmagic.launch import held_rank
from hvdmagic.launch.backend import Backend
from hvdmagic.launch.breakpoint_prompts import Console
from hvdmagic.launch.elastic import ElasticJob
from hvdmagic.launch.interrupts import before_launch, interruptible
from hvdmagic.launch.job import Job, JobResult, UnsentResult
from hvdmagic.launch.placement import Elastic, Placement, PlacementError, Where
from hvdmagic.launch.shipment import Shipment
from hvdmagic.protocol import Framework, ResultPolicy, Stage


def launch(payload: Shipment, placement: Placement, *, timeout: float | None = None,
           stall_timeout: float | None = None, env: dict[str, str] | None = None,
           on_event: Callable[[dict], None] | None = None, spark=None, data=None,
           results: ResultPolicy = ResultPolicy.ALL, requests=None,
           reconnect_grace: float | None = None, console: Console | None = None) -> JobResult:
    """Run a packed ``(fn, args, kwargs)`` (``shipment.pack``) as ``placement`` says (whose ``check_options``
    the caller ran on ``data`` and ``stall_timeout``, where it took them from the user).

    ``spark``: the SparkSession to use (default: the active one, or an embedded local one).
    ``data``: a Spark DataFrame; each rank gets an equal-size shard (hvdmagic.shard()).
    ``results``: which ranks send their value back (``ResultPolicy``). ``requests``: a queue
    the views put requests in while the job runs (``Event.STACKS``). ``reconnect_grace``: seconds a task
    whose connection to the kernel broke may take to come back (default: the backend's, from
    ``spark.hvdmagic.reconnectGrace``). ``console``: where a rank's ``breakpoint()`` asks the user
    (``breakpoint_prompts``); None: each breakpoint is passed, with a note.
    """
    preflight(placement)
    options = dict(timeout=timeout, stall_timeout=stall_timeout, env=env, results=results, on_event=on_event,
                   requests=requests, reconnect_grace=reconnect_grace, console=console)
    backend = make_backend(placement, on_event, spark=spark, data=data)
    if placement.elastic is None:
        return Job(backend, payload, placement, **options).run()
    return ElasticJob(backend, payload, placement, **options).run()


def preflight(placement: Placement) -> None:
    """What the kernel must be able to import for this placement: one paragraph if it cannot."""
    if placement.framework == Framework.TORCH:
        _require("torch.distributed", "torch", "pip install the project plus torch (e.g. 'pip install "
                 "torch==2.13.0'): %%torchrun needs no horovod")
    else:
        # The driver hosts horovod's rendezvous.
        _require("horovod.runner.http.http_server", "horovod",
                 "hvdmagic needs horovod built with PyTorch and Gloo: run the set-up command from the README "
                 "(make demo), or build it with 'python -m hvdmagic.build_horovod' (docs/frameworks.md); "
                 "%%torchrun needs no horovod")
    if placement.controller == "mpi":
        from hvdmagic.launch.mpi import check_available

        check_available()


def make_backend(placement: Placement, on_event: Callable[[dict], None] | None, *, spark=None, data=None
                 ) -> Backend:
    """The backend ``placement.where`` names, ready to start the run's tasks.

    Finding or starting the Spark session and checking its slots happen here, and an
    interrupt here ends in one line that says what it left behind.
    """
    notify = on_event or (lambda event: None)
    held_rank.end_for_next_run(notify)
    reached: list[Stage] = []

    def on_stage(stage: Stage) -> None:
        reached.append(stage)
        notify(protocol.stage_reached(stage))

    with interruptible(), before_launch(lambda: reached[-1] if reached else None):
        if placement.where == Where.LOCAL:
            from hvdmagic.launch.local import LocalBackend

            backend = LocalBackend(placement.tasks, data, gpus=placement.gpus)
        else:
            _require("pyspark", f"pyspark, which --np {placement.np} runs the ranks on,",
                     f"In a new virtualenv, pip install 'hvdmagic[spark]' (pyspark 3.5 or 4.x; the embedded Spark "
                     f"also needs Java 17); on Databricks or another Spark runtime the runtime's own pyspark is "
                     f"there; or use "
                     f"local mode, --np -{abs(placement.np)}, which runs the ranks on this machine without Spark")
            from hvdmagic.launch.spark import SparkBackend

            backend = SparkBackend(placement.tasks, spark, data, on_stage=on_stage, gpus=placement.gpus,
                                   elastic_start=placement.np if placement.elastic else None,
                                   asked=placement.asked)
        for note in backend.notes:
            notify(protocol.note(note))
        return backend


def _require(module: str, name: str, how: str) -> None:
    """A one-paragraph LaunchError when the kernel cannot import ``module``."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise LaunchError(f"{name} is not importable in this kernel's environment ({exc}). {how}.") from None


__all__ = ["Elastic", "Framework", "JobResult", "Placement", "PlacementError", "ResultPolicy", "UnsentResult",
           "Where", "launch"]
