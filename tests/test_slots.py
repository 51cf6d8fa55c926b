"""The slot check's waiting rule (launch.slots.wait), on a clock of its own: no Spark, no sleeping."""

from __future__ import annotations

import threading

import pytest

from hvdmagic.errors import LaunchError
from hvdmagic.launch import slots
from hvdmagic.launch.slots import Coming

pytestmark = pytest.mark.unit


class Clock:
    """time.monotonic and time.sleep for launch.slots: sleeping only moves the clock."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(slots, "time", clock)
    return clock


def test_a_cluster_that_is_not_growing_fails_after_slot_wait(clock):
    waited = slots.wait(5, 4, 0, lambda: 4, lambda now: None, bound=600)
    assert waited.slots == 4 and not waited.ran_out
    assert slots.SLOT_WAIT <= waited.seconds < slots.SLOT_WAIT + 1
    assert waited.reason(5) == "and no more were on their way after 3 s"


def test_slots_on_their_way_are_waited_for_and_noted(clock):
    coming = Coming(2, "1 executor(s) that the standalone master started on its workers")
    waited = slots.wait(4, 2, 0, lambda: 4 if clock.now >= 20 else 2,
                        lambda now: coming if clock.now < 20 else None, bound=60)
    assert waited.slots == 4
    assert 20 <= waited.seconds < 21
    assert waited.note() == "the slot check waited 20 s for " + coming.what


def test_the_bound_ends_the_wait_and_the_error_says_for_what(clock):
    coming = Coming(3, "3 more core(s) that spark.cores.max=5 asks for")
    waited = slots.wait(5, 2, 0, lambda: 2, lambda now: coming, bound=10)
    assert waited.ran_out and waited.slots == 2
    assert 10 <= waited.seconds < 11
    assert waited.reason(5) == ("after waiting 10 s for 3 more core(s) that spark.cores.max=5 asks for (the bound, "
                                "spark.hvdmagic.slotWait=10; set it higher for a cluster that takes longer to grow)")
    assert waited.note() is None


def test_too_little_on_its_way_is_not_waited_for(clock):
    coming = Coming(1, "1 more executor(s) that spark.executor.instances=3 asks for")
    waited = slots.wait(5, 2, 0, lambda: 2, lambda now: coming, bound=600)
    assert waited.seconds < slots.SLOT_WAIT + 1
    assert waited.reason(5) == f"and the 1 more on their way ({coming.what}) would not make 5, after 3 s"


def test_a_new_session_gets_the_bound_for_its_first_executors(clock):
    waited = slots.wait(2, 0, 0, lambda: 2 if clock.now >= 30 else 0, lambda now: None, bound=60)
    assert waited.slots == 2 and 30 <= waited.seconds < 31
    assert waited.note() == "the slot check waited 30 s for the session's first executors"


def test_a_short_bound_never_waits_less_than_slot_wait(clock):
    waited = slots.wait(4, 2, 0, lambda: 2, lambda now: Coming(2, "2 executor(s)"), bound=0)
    assert waited.ran_out and slots.SLOT_WAIT <= waited.seconds < slots.SLOT_WAIT + 1


def test_an_interrupted_cell_stops_the_wait(clock):
    stop = threading.Event()
    stop.set()
    waited = slots.wait(4, 2, 0, lambda: 2, lambda now: Coming(2, "2 executor(s)"), bound=600, stop=stop)
    assert waited.seconds == 0 and waited.slots == 2


class Session:
    def __init__(self, value):
        self.conf = self
        self.value = value

    def get(self, key, default):
        assert key == "spark.hvdmagic.slotWait"
        return default if self.value is None else self.value


@pytest.mark.parametrize(("value", "seconds"), [(None, slots.DEFAULT_BOUND), ("120", 120.0), ("45s", 45.0),
                                                ("0", 0.0)])
def test_the_bound_is_a_spark_setting_in_seconds(value, seconds):
    assert slots.bound(Session(value)) == seconds


@pytest.mark.parametrize("value", ["soon", "-5", "nan"])
def test_a_bad_bound_is_a_one_paragraph_error(value):
    with pytest.raises(LaunchError, match=r"spark.hvdmagic.slotWait is how many seconds .* not '"):
        slots.bound(Session(value))
