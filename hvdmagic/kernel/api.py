"""The Python API: ``hvdmagic.run``, and drop-ins for ``HorovodRunner``, ``TorchDistributor`` and
``DeepspeedTorchDistributor``.

All go through the same runner as the magics: one launcher core, the same
streaming, dashboard and error reporting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hvdmagic.kernel.capture import users_module_by_value, with_notebook_sources
from hvdmagic.kernel.hang_notices import stall_check_env
from hvdmagic.kernel.runner import execute
from hvdmagic.launch import Elastic, Placement, ResultPolicy, Where, shipment
from hvdmagic.launch.interrupts import before_launch
from hvdmagic.launch.shipment import Shipment
from hvdmagic.protocol import Framework
from hvdmagic.rank.databricks_apis import run_deepspeed_script
from hvdmagic.rank.scripts import run_script

_VERBOSITIES = ("all", "log_callback_only")


def run(fn: Callable, np: int | None = None, *args, timeout: float | None = None,
        stall_timeout: float | None = None, data=None, controller: str = "gloo", backend: str = "horovod",
        session=None, min_np: int | None = None, max_np: int | None = None, reset_limit: int | None = None,
        elastic_timeout: float | None = None, stall_check: int | None = None, ranks: list[int] | None = None,
        **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on |np| ranks and return every rank's result in rank order.

    The Python twin of a ``%%horovod`` cell: the same launcher, live dashboard and error
    reporting, and ``hvdmagic.last_run()`` holds the run's record afterwards.

    Args:
        fn: the function each rank calls. A function defined in the notebook, or in the
            user's own module beside it, is shipped by value with cloudpickle.
        np: the number of ranks. ``np > 0`` runs them as one Spark barrier stage (the active
            SparkSession, or an embedded local one); ``np < 0`` runs |np| processes on the
            driver without Spark (local mode). 0 is an error.
        *args: positional arguments for ``fn``; they must be picklable.
        timeout: seconds after which every rank is stopped and the run fails; None (the
            default) waits for as long as the ranks run.
        stall_timeout: fail as soon as a rank makes no progress (output, progress, metrics)
            for this many seconds, e.g. in a deadlocked collective, counted from the rank's
            start, so a rank that never printed is caught too; while a rank imports a framework
            the clock is held (``timeout`` bounds that). None (the default) never checks.
        data: a Spark DataFrame; each rank gets an equal-size shard of it, read in the rank
            with ``hvdmagic.shard()``. None (the default) sends no data.
        controller: "gloo" (the default), or "mpi" to run the ranks under Open MPI's mpirun.
        backend: "horovod" (the default): the ranks get Horovod's rendezvous and variables; or
            "torch": they get torchrun's (RANK, WORLD_SIZE, MASTER_ADDR, ...) for
            ``torch.distributed.init_process_group``, and no horovod is needed.
        session: a running ``hvdmagic.session(...)``: ``fn`` runs on its warm ranks (leave out
            ``np``, ``data``, ``controller`` and ``backend``: the session has its own).
        ranks: with ``session``, call ``fn`` on these of its ranks only (``[0]``); the others stay
            idle and keep their state. A collective called there fails at once, naming it (the
            others would never join it), and the session keeps its ranks and state.
        min_np: elastic training (``fn`` uses ``hvd.elastic.run``): the run goes on after a
            rank or executor is lost while at least ``min_np`` ranks remain. Default: ``np``.
        max_np: elastic training: up to ``max_np`` ranks, added at a commit as slots come
            back (Spark runs ``max_np`` tasks). Default: ``np``. Giving ``min_np``,
            ``max_np`` or ``reset_limit`` makes the run elastic (docs/reliability.md).
        reset_limit: elastic training: fail after this many resets. None: no limit.
        elastic_timeout: elastic training: seconds to wait for ``min_np`` slots after a loss,
            before failing. Default 60. (The first ``np`` tasks are waited for as a
            fixed-size run's are: within ``timeout``.)
        stall_check: Horovod's stall check, in whole seconds (``HOROVOD_STALL_CHECK_TIME_SECONDS``;
            Horovod's default is 60): when some ranks have waited this long in a collective that
            others have not entered, the dashboard shows which (``last_run().hang_notices``).
            Horovod ranks only, and new ones: not with ``backend="torch"`` or ``session``.
        **kwargs: keyword arguments for ``fn``; they must be picklable, and cannot be named
            as the arguments above.

    Returns:
        A list of |np| values: what ``fn`` returned on each rank, rank 0's first (with ``ranks``:
        the chosen ranks' values, in rank order). Every
        rank's value must be picklable, or that rank fails with a TypeError (on a session's
        ranks, which outlive the call, the value becomes an ``UnsentResult`` with its repr
        instead). An elastic run returns the values of the ranks it ended with, in their
        final rank order.

    Raises:
        hvdmagic.errors.JobFailed: a rank raised or died; the error names it and shows its traceback.
        hvdmagic.errors.JobTimeout: (a JobFailed) ``timeout`` or ``stall_timeout`` ran out.
        hvdmagic.errors.JobInterrupted: the kernel was interrupted; every rank was stopped.
        hvdmagic.errors.LaunchError: the job could not start (np is 0, an unknown ``controller``,
            no Spark slots, no horovod, no Java).

    Example::

        import hvdmagic

        def train(lr, epochs=3):
            import horovod.torch as hvd
            hvd.init()
            ...
            return accuracy

        accuracies = hvdmagic.run(train, 2, 0.1, epochs=5, timeout=600)  # [rank 0's, rank 1's]
    """
    try:
        framework = Framework(backend)
    except ValueError:
        raise ValueError(f"backend must be one of {', '.join(Framework)}, not {backend!r}") from None
    if (np is None) == (session is None):
        raise ValueError("give hvdmagic.run either np (new ranks) or session= (a session's warm ranks)")
    if ranks is not None and session is None:
        raise ValueError("ranks= picks ranks of a session (session=s), which keep their state between calls; new "
                         "ranks (np) all run fn and wait for each other in hvd.init(): to run code on one of "
                         "them, put it under `if hvd.rank() == 0:`")
    elastic = None
    if (min_np, max_np, reset_limit, elastic_timeout) != (None, None, None, None):
        if np is None:
            raise ValueError("an elastic run (min_np, max_np, reset_limit, elastic_timeout) needs np: the ranks "
                             "it starts with")
        elastic = Elastic.from_arguments(np, min_np=min_np, max_np=max_np, reset_limit=reset_limit,
                                         timeout=elastic_timeout)
    env = stall_check_env(stall_check, "stall_check")
    if env and (framework != Framework.HOROVOD or session is not None):
        raise ValueError("stall_check sets Horovod's stall check as new ranks start: it needs backend='horovod' "
                         "and np (a session's ranks are already running)")
    placement = None
    if session is None:
        placement = Placement.of(np, framework=framework, controller=controller, elastic=elastic, name="np")
        placement.check_options(data=data, stall_timeout=stall_timeout)
    payload = pack_call((fn, args, kwargs), fn)
    return execute(payload, placement, timeout=timeout, stall_timeout=stall_timeout, data=data, session=session,
                   command="hvdmagic.run", env=env, ranks=ranks).results


def pack_call(obj, fn: Callable) -> Shipment:
    """Pack ``(fn, args, kwargs)``, shipping ``fn``'s module by value when it is the user's own file."""
    fn_, args, kwargs = obj
    # Functions from notebook cells carry their cells' source, so tracebacks show it.
    with before_launch():  # pickling large arguments takes seconds: a Stop then is one line too
        obj = (with_notebook_sources(fn_, *args, *kwargs.values()), args, kwargs)
        with users_module_by_value(fn):
            return shipment.pack(obj)


class HorovodRunner:
    """Databricks' ``sparkdl.HorovodRunner``, as a drop-in: change only the import line.

    ``HorovodRunner(np=2).run(main, **kwargs)`` returns rank 0's value.

    Args:
        np: the number of ranks. ``np > 0`` runs them as one Spark barrier stage;
            ``np < 0`` runs |np| processes on the driver without Spark (local mode).
        driver_log_verbosity: accepted for compatibility. "all" (the default here) streams
            every rank's output, as hvdmagic always does; "log_callback_only" behaves the
            same, because hvdmagic's output is already labelled and capped per rank.

    Raises:
        ValueError: ``np`` is not a non-zero int, or ``driver_log_verbosity`` is neither value.

    Example::

        from hvdmagic import HorovodRunner  # instead of: from sparkdl import HorovodRunner

        hr = HorovodRunner(np=-2)  # two local processes on the driver, to try it out
        accuracy = hr.run(train, lr=0.1)
    """

    def __init__(self, np: int, driver_log_verbosity: str = "all"):
        self.placement = Placement.of(np, name="np")  # a PlacementError (a ValueError) for 0, 2.5, True
        if driver_log_verbosity not in _VERBOSITIES:
            raise ValueError(f"driver_log_verbosity must be one of {_VERBOSITIES}, not {driver_log_verbosity!r}")
        self.num_processor = np
        self.driver_log_verbosity = driver_log_verbosity

    def run(self, main: Callable, **kwargs: Any) -> Any:
        """Run ``main(**kwargs)`` on ``np`` ranks and return rank 0's value (the others' are not sent back).

        Args:
            main: the training function. A function defined in the notebook, or in the
                user's own module beside it, is shipped by value with cloudpickle.
            **kwargs: keyword arguments for ``main``; they must be picklable.

        Returns:
            What ``main`` returned on rank 0.

        Raises:
            hvdmagic.errors.JobFailed: a rank raised or died; the error names it and shows its traceback.
            hvdmagic.errors.LaunchError: the job could not start (no Spark slots, no horovod, no Java).

        Example::

            from hvdmagic import HorovodRunner

            def train(lr):
                import horovod.torch as hvd
                hvd.init()
                ...
                return accuracy

            accuracy = HorovodRunner(np=2).run(train, lr=0.1)
        """
        payload = pack_call((main, (), kwargs), main)
        return execute(payload, self.placement, results=ResultPolicy.RANK0, command="HorovodRunner").result


class TorchDistributor:
    """pyspark's ``TorchDistributor``, as a drop-in: change only the import line.

    ``TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train_fn, *args)``
    runs ``train_fn`` as torchrun would, on hvdmagic's launcher: the live dashboard,
    fail-fast, ``--stall-timeout``-style checks through ``hvdmagic.run``, and rank 0's
    value back. Each process gets torchrun's environment, so
    ``torch.distributed.init_process_group("gloo")`` (or "nccl") works unchanged.

    Args:
        num_processes: how many processes (ranks) to run.
        local_mode: True (pyspark's default) runs them on the driver without Spark;
            False runs them as one Spark barrier stage on the executors.
        use_gpu: True (pyspark's default) gives each process one GPU: from Spark's task
            resources (``spark.task.resource.gpu.amount``) on the executors, or one of the
            driver's GPUs in local mode; without GPUs it fails before starting.

    Example::

        from hvdmagic import TorchDistributor

        def train(lr):
            import torch.distributed as dist
            dist.init_process_group("gloo")
            ...
            return accuracy

        accuracy = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(train, 0.1)
    """

    def __init__(self, num_processes: int = 1, local_mode: bool = True, use_gpu: bool = True, _ssl_conf=None):
        if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
            raise ValueError(f"num_processes must be a positive integer, not {num_processes!r}")
        self.num_processes = num_processes
        self.local_mode = bool(local_mode)
        self.use_gpu = bool(use_gpu)

    def run(self, train_object: Callable | str, *args: Any, **kwargs: Any) -> Any:
        """Run ``train_object(*args, **kwargs)`` on every process; return rank 0's value.

        Args:
            train_object: a function, or the path of a Python script that every process runs
                as ``__main__`` with ``args`` as its command-line arguments (as torchrun would).
            *args: the function's positional arguments, or the script's arguments.
            **kwargs: the function's keyword arguments.

        Returns:
            What the function returned on rank 0; None for a script.
        """
        if isinstance(train_object, str):
            if kwargs:
                raise TypeError("a script takes command-line arguments only, not keyword arguments")
            train_object, args = run_script, (train_object, *map(str, args))
        return self._run(train_object, args, kwargs)

    def _run(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        placement = Placement(self.num_processes, Where.LOCAL if self.local_mode else Where.SPARK, Framework.TORCH,
                              gpus=self.use_gpu)
        payload = pack_call((fn, args, kwargs), fn)
        return execute(payload, placement, results=ResultPolicy.RANK0, command=type(self).__name__).result


class DeepspeedTorchDistributor(TorchDistributor):
    """pyspark's ``DeepspeedTorchDistributor``, as a drop-in: change only the import line.

    ``DeepspeedTorchDistributor(numGpus=2, nnodes=1, localMode=True, useGpu=False,
    deepspeedConfig={...}).run(train_object, *args)`` runs ``numGpus × nnodes`` processes as
    ``TorchDistributor`` does, with hvdmagic's live view, errors that name the rank, and Stop.

    As pyspark's: a script (``train_object`` a path) gets its arguments, then ``--deepspeed`` and
    ``--deepspeed_config PATH`` (a dict config is written to a JSON file, on each rank's own host
    here); a function gets its arguments only, and calls ``deepspeed.initialize(config=...)`` itself.

    Args:
        numGpus: processes per node (one GPU each with ``useGpu``).
        nnodes: nodes; ``numGpus × nnodes`` processes in all, which Spark places on its executors.
        localMode: True (the default) runs them on the driver without Spark; False on the executors.
        useGpu: True (the default) gives each process a GPU; without GPUs it fails before starting.
        deepspeedConfig: a dict, the path of a JSON file, or None (DeepSpeed's defaults).
    """

    def __init__(self, numGpus: int = 1, nnodes: int = 1, localMode: bool = True, useGpu: bool = True,
                 deepspeedConfig: dict | str | None = None):
        for name, value in (("numGpus", numGpus), ("nnodes", nnodes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if deepspeedConfig is not None and not isinstance(deepspeedConfig, (dict, str)):
            raise TypeError(f"deepspeedConfig must be a dict, the path of a JSON file or None, not "
                            f"{type(deepspeedConfig).__name__}")
        super().__init__(numGpus * nnodes, localMode, useGpu)
        self.deepspeed_config = deepspeedConfig

    def run(self, train_object: Callable | str, *args: Any, **kwargs: Any) -> Any:
        """Run ``train_object`` on every process; rank 0's value (None for a script)."""
        if isinstance(train_object, str):
            if kwargs:
                raise ValueError("DeepspeedTorchDistributor with a script takes command-line arguments only, "
                                 "not keyword arguments")
            return self._run(run_deepspeed_script, (train_object, [str(a) for a in args], self.deepspeed_config),
                             {})
        return self._run(train_object, args, kwargs)


def where(timeout: float = 10.0) -> str:
    """Where every rank of the live run is now: each one's Python stacks (and, where py-spy is
    installed, its native frames), ranks in the same place grouped.

    A running cell holds the kernel, so a notebook cell that asks waits until the run is over: ask
    from a subshell console (JupyterLab >= 4.4 with ipykernel >= 7, "New Subshell Console for
    Notebook", opened while the kernel is idle), which runs beside the cell, or press the dashboard's
    "where are the ranks?" button.
    The answers also stay in ``last_run().where``. With no run live, it shows where the last run's
    ranks were when last asked, or when the run was stopped. ``timeout``: seconds to wait for the
    ranks' answers (py-spy takes about a second, more on a busy host; it ends once every rank answered).
    """
    from hvdmagic import stacks
    from hvdmagic.kernel.record import last_run

    record = last_run()
    if record is None or record.state not in ("launching", "running"):
        return _where_they_were(record)
    record.ask_where()
    running = {rank.rank for rank in record.ranks if rank.state in ("launching", "running")}
    deadline = time.monotonic() + timeout
    while not running <= record.where.keys() and time.monotonic() < deadline:
        time.sleep(0.05)  # the answers arrive on the job's thread; there is no event to wait on here
    return "\n".join(stacks.describe(dict(record.where), "task" if record.elastic else "rank"))


WHERE_LIVE = ("While a cell runs, a notebook cell that asks waits behind it: press the cell's \"where are the "
              "ranks?\" button, or ask in a subshell console, which runs beside the cell (JupyterLab >= 4.4: "
              "\"New Subshell Console for Notebook\", opened before the long cell starts: its own start waits for "
              "an idle kernel).")


def _where_they_were(record) -> str:
    """With no run live: what the last run kept (its ranks' last answers, else their stacks when it was
    stopped), and how to ask while a run is live."""
    from hvdmagic import stacks

    noun = "task" if record is not None and record.elastic else "rank"
    if record is not None and record.stacks:
        kept = ["hvdmagic: no run is live. Where the last run's ranks were when it was stopped:",
                *stacks.describe(dict(record.stacks), noun)]
    elif record is not None and record.where:
        asked = f" at {time.strftime('%H:%M:%S', time.localtime(record.where_asked))}" if record.where_asked else ""
        kept = [f"hvdmagic: no run is live. The last run's ranks when last asked{asked}:",
                *stacks.describe(dict(record.where), noun)]
    else:
        kept = ["hvdmagic: no run is live, and the last run kept no stacks."]
    return "\n".join([*kept, WHERE_LIVE])
