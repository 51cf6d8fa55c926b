"""Where a run's ranks go, and how many: one value, built and checked where the run is asked for.

The magics, ``hvdmagic.run``, ``HorovodRunner``, the TorchDistributor drop-in and
``%horovod start`` each turn their arguments into a ``Placement`` (``Placement.of``);
everything below them reads it. The user's signed ``np`` (negative: local mode)
is decoded here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from hvdmagic.errors import LaunchError
from hvdmagic.protocol import Framework

CONTROLLERS = ("gloo", "mpi")


class PlacementError(LaunchError, ValueError):
    """Arguments that describe no possible run: a LaunchError, and a ValueError for the Python API."""


class Where(StrEnum):
    SPARK = "spark"  # one task per rank in a Spark stage (a barrier stage; a plain one for elastic runs)
    LOCAL = "local"  # processes on the driver, without Spark


@dataclass(frozen=True)
class Elastic:
    """Horovod elastic training: start on np ranks, go on while ``min_np`` remain, grow to ``max_np``.

    ``reset_limit``: how many resets the run may go through before it fails (None: no limit).
    ``timeout``: seconds Horovod waits for at least ``min_np`` slots (at the start and after a loss).
    ``cooldown``: the range of seconds a task whose rank died sits out before it gets a rank again.
    """

    min_np: int
    max_np: int
    reset_limit: int | None = None
    timeout: float = 60.0
    cooldown: tuple[int, int] = (5, 300)  # the first return comes 10-15 s after a loss, the next 20-25 s ...

    @classmethod
    def from_arguments(cls, np: int, *, min_np: int | None = None, max_np: int | None = None,
                       reset_limit: int | None = None, timeout: float | None = None) -> Elastic:
        """The settings a user gave, the rest defaulted: min_np and max_np to |np|."""
        return cls(min_np=abs(np) if min_np is None else min_np, max_np=abs(np) if max_np is None else max_np,
                   reset_limit=reset_limit, **({} if timeout is None else {"timeout": timeout}))


@dataclass(frozen=True)
class Placement:
    """``np`` ranks (the ranks an elastic run starts with), ``where`` they run, and how.

    ``gpus``: every rank must get a GPU (Spark's task resources, or the driver's in local mode).
    """

    np: int
    where: Where
    framework: Framework = Framework.HOROVOD
    controller: str = "gloo"
    elastic: Elastic | None = None
    gpus: bool = False
    asked: str = field(default="--np", compare=False)  # how the user wrote np, for errors: --np, num_proc

    @classmethod
    def of(cls, np, *, framework: Framework = Framework.HOROVOD, controller: str = "gloo",
           elastic: Elastic | None = None, gpus: bool = False, name: str = "--np") -> Placement:
        """The placement a signed ``np`` asks for: np > 0 ranks on Spark, np < 0 |np| local processes.

        ``name``: how the caller's user wrote np, for the error (``--np``, ``np``)."""
        if not isinstance(np, int) or isinstance(np, bool):
            raise PlacementError(f"{name} must be a whole number of ranks, not {np!r}.")
        if np == 0:
            raise PlacementError(f"{name} must be a positive number of Spark ranks, or negative for local mode "
                                 "(e.g. -2: two processes on the driver), not 0.")
        return cls(abs(np), Where.SPARK if np > 0 else Where.LOCAL, Framework(framework), controller, elastic, gpus,
                   asked=name)

    def __post_init__(self) -> None:
        if not isinstance(self.np, int) or isinstance(self.np, bool) or self.np < 1:
            raise PlacementError(f"a placement needs a positive number of ranks, not {self.np!r}.")
        if self.controller not in CONTROLLERS:
            raise PlacementError(f"controller must be one of {', '.join(CONTROLLERS)}, not {self.controller!r}.")
        if self.framework == Framework.TORCH and self.controller != "gloo":
            raise PlacementError(f"controller {self.controller!r} is for Horovod; torch.distributed ranks choose "
                                 "their backend in init_process_group (gloo, nccl).")
        elastic = self.elastic
        if elastic is None:
            return
        if not 1 <= elastic.min_np <= self.np <= elastic.max_np:
            raise PlacementError(f"elastic training needs 1 <= --min-np <= --np <= --max-np; got --min-np "
                                 f"{elastic.min_np}, --np {self.np}, --max-np {elastic.max_np}.")
        if self.framework != Framework.HOROVOD or self.controller != "gloo":
            raise PlacementError("elastic training is Horovod's, over Gloo (hvd.elastic.run); %%torchrun and "
                                 "--controller mpi run a fixed number of ranks.")
        if elastic.reset_limit is not None and elastic.reset_limit < 0:
            raise PlacementError(f"--reset-limit must be 0 or more, not {elastic.reset_limit}.")
        if elastic.timeout <= 0:
            raise PlacementError(f"--elastic-timeout must be a positive number of seconds, not "
                                 f"{elastic.timeout:g}.")

    def check_options(self, *, data=None, stall_timeout: float | None = None) -> None:
        """The run's other options that this placement cannot honour."""
        if self.elastic is None:
            return
        if data is not None:
            raise PlacementError("--data deals a fixed number of shards, one per rank, so it cannot be combined "
                                 "with elastic training; read the data in the cell (e.g. with "
                                 "hvd.elastic.ElasticSampler).")
        if stall_timeout is not None:
            raise PlacementError("--stall-timeout is not applied to elastic runs (a rank waiting for a reset is "
                                 "not a stall); use --timeout to bound the run.")

    @property
    def local(self) -> bool:
        return self.where == Where.LOCAL

    @property
    def signed_np(self) -> int:
        """``np`` as the user writes it: negative for local mode (``--np -2``)."""
        return -self.np if self.local else self.np

    @property
    def tasks(self) -> int:
        """The tasks (or local processes) the run needs: an elastic run's ``max_np``, else ``np``."""
        return self.elastic.max_np if self.elastic else self.np
