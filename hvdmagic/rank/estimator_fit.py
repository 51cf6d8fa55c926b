"""What an estimator's training does alike in every rank, whatever its framework: the skeleton that
``estimator_torch``, ``estimator_keras`` and ``estimator_lightning`` fill in with what differs (building
the model, the step, saving the weights).

``RankFit`` is one rank's fit, from its notes to its result:

- the start: the run's notes, said by rank 0; the framework's seed; the rank's own generator for the
  shuffles, seeded apart from the other ranks';
- the steps of an epoch, the same on every rank (``epoch_steps``);
- the line that says a run takes up from its checkpoint;
- each epoch's bars, its metrics averaged over the ranks into the history, and rank 0's chart row and
  line;
- rank 0's ``FitResult``, with the time the epochs took.

A framework brings its collectives as a ``RankGroup``: Horovod's over its own tensors, or
torch.distributed's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from hvdmagic import protocol
from hvdmagic.rank import telemetry
from hvdmagic.rank.estimator_data import FitResult, FitSpec, ShardRows
from hvdmagic.rank.trainers import logged_numbers


class RankGroup(Protocol):
    """The fit's ranks and the two reductions the skeleton makes over them."""

    name: str  # "horovod" or "torch.distributed": the run's notes and the fitted model's fit_info say it
    rank: int
    size: int

    def largest(self, values: list[int]) -> list[int]:
        """Each of ``values``' largest over the ranks."""

    def mean(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each of ``metrics``' mean over the ranks."""


@dataclass(frozen=True)
class EpochSteps:
    """The batches of an epoch, the same on every rank."""

    train: int
    val: int  # 0 without validation rows
    val_batch_size: int


class RankFit:
    """One rank's fit: the parts every framework shares, called by the framework's module as its training goes."""

    def __init__(self, spec: FitSpec, group: RankGroup, device: str, seed: Callable[[int], Any], *,
                 about: str = "", notes: Iterable[str] = ()):
        """Say the run's notes (rank 0), then seed the framework with ``spec.random_seed``. ``about`` follows
        the device in the note on the collectives; ``notes`` come after it."""
        import numpy as np

        self.spec, self.group, self.device = spec, group, device
        self.history: dict[str, list[float]] = {}
        self.start = 0  # the first epoch to train: the one after a resumed run's checkpoint
        self.epochs_run = 0
        self.steps = EpochSteps(0, 0, spec.val_batch_size or spec.batch_size)
        self.training_seconds = 0.0
        self._epoch_started = time.monotonic()
        if group.rank == 0:
            training = f"hvdmagic: training on {group.size} rank(s) with {group.name}'s collectives, on {device}"
            for text in [*spec.notes, training + (f" ({about})" if about else ""), *notes]:
                telemetry.emit(protocol.note(text))
        if spec.random_seed is not None:
            seed(spec.random_seed)
        # Each rank reshuffles its own rows: reproducible from the seed, and not in step with the other ranks.
        self.rng = np.random.default_rng(None if spec.random_seed is None else spec.random_seed + group.rank)

    @property
    def shuffles(self):
        """The generator that reshuffles the training rows each epoch; None where ``shuffle=False``."""
        return self.rng if self.spec.shuffle else None

    def epoch_steps(self, rows: ShardRows) -> EpochSteps:
        """The batches of an epoch: ``train_steps_per_epoch`` and ``validation_steps_per_epoch`` where given, else
        what the rank with the most rows needs, so that no rank waits in a collective for another's extra batch
        (a rank with fewer rows goes round its own again)."""
        spec = self.spec
        most_train, most_val = self.group.largest([len(rows.train), len(rows.val)])
        val_batch_size = spec.val_batch_size or spec.batch_size
        self.steps = EpochSteps(
            train=spec.train_steps_per_epoch or math.ceil(most_train / spec.batch_size),
            val=(spec.validation_steps_per_epoch or math.ceil(most_val / val_batch_size)) if spec.validation else 0,
            val_batch_size=val_batch_size)
        return self.steps

    def resumed(self, epoch: int, history: dict[str, list[float]]) -> None:
        """Take up after the checkpoint of ``epoch``, with the history until then."""
        self.history, self.start = history, epoch + 1
        if self.group.rank == 0:
            print(f"resuming from the checkpoint of epoch {epoch + 1} in {self.spec.checkpoint_dir}", flush=True)

    @contextmanager
    def training(self) -> Iterator[None]:
        """Times the epochs, for the result's ``training_seconds``: the rank's start and the result are not in it."""
        started = time.monotonic()
        yield
        self.training_seconds = time.monotonic() - started

    def epoch_started(self, epoch: int) -> None:
        self._epoch_started = time.monotonic()
        telemetry.progress(epoch, self.spec.epochs, "epoch")

    def batch_done(self, batch: int) -> None:
        telemetry.progress(batch + 1, self.steps.train, "batch")

    def epoch_done(self, epoch: int, metrics: dict[str, float]) -> dict[str, float]:
        """This rank's ``metrics`` of ``epoch`` averaged over the ranks, kept in the history and returned; rank 0
        charts them and, when verbose, prints the epoch's line."""
        averaged = self.group.mean(metrics)
        for name, value in averaged.items():
            self.history.setdefault(name, []).append(value)
        self.epochs_run += 1
        telemetry.progress(epoch + 1, self.spec.epochs, "epoch")
        if self.group.rank == 0:
            if charted := logged_numbers(averaged):  # inf or nan (an empty epoch's mean) charts nothing
                telemetry.log_metrics(step=epoch, **charted)
            if self.spec.verbose:
                shown = ", ".join(f"{name} {value:.4g}" for name, value in averaged.items())
                print(f"epoch {epoch + 1}/{self.spec.epochs}: {shown} "
                      f"({time.monotonic() - self._epoch_started:.1f} s)", flush=True)
        return averaged

    def result(self, weights, optimizer_state: dict | None, output_sizes: list[int]) -> FitResult:
        """Rank 0's result: the framework's weights and what the skeleton kept of the fit."""
        return FitResult(weights=weights, optimizer_state=optimizer_state, history=self.history,
                         output_sizes=output_sizes, collectives=self.group.name, epochs_run=self.epochs_run,
                         device=self.device, training_seconds=self.training_seconds)
