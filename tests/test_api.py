"""The Python API shares the launcher with the magic: HorovodRunner and hvdmagic.run."""

from __future__ import annotations

import re

import pytest

import hvdmagic
from hvdmagic import HorovodRunner
from hvdmagic.errors import JobInterrupted


def train(learning_rate, scale=1.0):
    import horovod.torch as hvd
    import torch

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
    return {"rank": hvd.rank(), "lr": learning_rate * scale, "sum": total}


@pytest.mark.profile
def test_horovodrunner_is_a_drop_in_returning_rank0_value(spark_kind):
    hr = HorovodRunner(np=2, driver_log_verbosity="log_callback_only")
    assert hr.run(train, learning_rate=0.1, scale=2.0) == {"rank": 0, "lr": 0.2, "sum": 1.0}


def test_horovodrunner_local_mode_with_negative_np():
    assert HorovodRunner(np=-2).run(train, learning_rate=1.0)["sum"] == 1.0


@pytest.mark.profile
def test_run_returns_every_rank_in_rank_order(spark_kind):
    results = hvdmagic.run(train, 2, 0.5)
    assert [r["rank"] for r in results] == [0, 1]
    assert hvdmagic.last_run().results == results


class _StopLandsHere:
    def __reduce__(self):
        raise KeyboardInterrupt  # as SIGINT would, while the call's arguments are pickled


@pytest.mark.unit
@pytest.mark.parametrize("call", ["run", "HorovodRunner"])
def test_stop_while_the_arguments_are_pickled_is_one_line_and_starts_no_run(call):
    """Large arguments take seconds to pickle, before anything is launched: a Stop then ends the call
    as a Stop during the run does, with a one-line JobInterrupted, and no run began."""
    before = hvdmagic.last_run()
    with pytest.raises(JobInterrupted, match=r"^interrupted before anything was started\.$"):
        if call == "run":
            hvdmagic.run(len, -2, _StopLandsHere())
        else:
            HorovodRunner(np=-2).run(len, value=_StopLandsHere())
    assert hvdmagic.last_run() is before, "a run began"


@pytest.mark.unit
@pytest.mark.parametrize("np, verbosity, message", [
    (0, "all", "np must be a positive number of Spark ranks, or negative for local mode (e.g. -2: two processes "
               "on the driver), not 0."),
    (2.5, "all", "np must be a whole number of ranks, not 2.5."),
    (True, "all", "np must be a whole number of ranks, not True."),
    (2, "loud", "driver_log_verbosity must be one of ('all', 'log_callback_only'), not 'loud'"),
], ids=["0-all", "2.5-all", "True-all", "2-loud"])
def test_horovodrunner_rejects_bad_arguments(np, verbosity, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        HorovodRunner(np=np, driver_log_verbosity=verbosity)
