"""Stragglers and what each rank uses: the detector, the supervisor's sampler, the views, real runs.

The detector and the views are unit tests on a record fed the events a run sends, with the
kernel's clock given explicitly. The sampler runs on real processes. The GPU part runs on a
small stand-in for NVML (this machine has no GPU): the only stand-in in this file. The real
runs are local-mode ranks in ``hvdmagic.track`` loops, one of them sleeping longer per step,
and a balanced run, so the check can fail both ways.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest
from conftest import run
from helpers import wait_until

import hvdmagic
from hvdmagic import protocol
from hvdmagic.kernel import stragglers
from hvdmagic.kernel.record import RunRecord
from hvdmagic.kernel.stragglers import StragglerDetector
from hvdmagic.kernel.ui import progress_text
from hvdmagic.kernel.ui.snapshot import Snapshot, summary
from hvdmagic.launch.placement import Placement
from hvdmagic.task import resources

HOSTS = {0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.3", 3: "10.0.0.4"}


def _windows(detector: StragglerDetector, rates: dict[int, float], windows: int, start: float = 0.0,
             steps: dict[int, float] | None = None) -> tuple[float, dict[int, float]]:
    """Feed ``windows`` windows in which each rank makes ``rates[rank]`` steps a second; returns
    the clock and the step counts where it stopped, to go on from there."""
    steps = dict(steps or {rank: 0.0 for rank in rates})
    now = start
    if start == 0.0:
        detector.check(now, {rank: (steps[rank], now) for rank in rates}, HOSTS)  # opens the first window
    for _ in range(windows):
        now += stragglers.WINDOW_SECONDS
        for rank, rate in rates.items():
            steps[rank] += rate * stragglers.WINDOW_SECONDS
        assert detector.due(now)
        detector.check(now, {rank: (steps[rank], now) for rank in rates}, HOSTS)
    return now, steps


# -- the detector ------------------------------------------------------------------------------
@pytest.mark.unit
def test_a_rank_35_percent_slower_is_flagged_at_its_third_window_not_before():
    detector = StragglerDetector()
    rates = {0: 20.0, 1: 20.0, 2: 13.0, 3: 20.0}
    now, steps = _windows(detector, rates, 2)
    assert detector.flags == [], "flagged after two windows: the rule is three in a row"
    now, steps = _windows(detector, rates, 1, now, steps)
    [flag] = detector.flags
    assert (flag.rank, flag.host, round(flag.slower, 2), flag.until) == (2, "10.0.0.3", 0.35, None)
    assert flag.describe() == "rank 2 is 35 % slower than the median: host 10.0.0.3"
    assert detector.rates[2] == pytest.approx(13.0) and detector.rates[0] == pytest.approx(20.0)


@pytest.mark.unit
def test_ranks_in_step_are_told_apart_by_the_seconds_they_waited_in_collectives():
    """All four make 10 steps a second; ranks 0, 1, 3 wait 60 % of each window for rank 2."""
    detector = StragglerDetector()
    now, steps, waited = 0.0, 0.0, {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}
    share = {0: 0.6, 1: 0.6, 2: 0.02, 3: 0.6}
    detector.check(now, {rank: (steps, now, 0.0) for rank in waited}, HOSTS)
    for _ in range(3):
        now += stragglers.WINDOW_SECONDS
        steps += 10 * stragglers.WINDOW_SECONDS
        for rank in waited:
            waited[rank] += share[rank] * stragglers.WINDOW_SECONDS
        detector.check(now, {rank: (steps, now, waited[rank]) for rank in waited}, HOSTS)
    assert [flag.rank for flag in detector.current] == [2]
    assert detector.current[0].slower == pytest.approx(1 - 0.4 / 0.98, abs=0.01)
    # Without the waits (not timed: TensorFlow, DDP) the same ranks look alike.
    untimed = StragglerDetector()
    _windows(untimed, {0: 10.0, 1: 10.0, 2: 10.0, 3: 10.0}, 3)
    assert untimed.current == []


@pytest.mark.unit
def test_a_balanced_run_with_jitter_flags_no_rank():
    detector = StragglerDetector()
    now, steps = 0.0, None
    # Each window a different rank is the slowest, by up to 15 %: noise, never three in a row.
    for window in range(12):
        rates = {rank: 20.0 * (0.85 if rank == window % 4 else 1.0) for rank in range(4)}
        now, steps = _windows(detector, rates, 1, now, steps)
    assert detector.flags == []


@pytest.mark.unit
def test_a_rank_slow_for_two_windows_at_a_time_is_never_flagged():
    detector = StragglerDetector()
    now, steps = 0.0, None
    for window in range(9):
        slow = window % 3 != 2  # two windows behind, one caught up, again and again
        now, steps = _windows(detector, {0: 20.0, 1: 20.0, 2: 10.0 if slow else 20.0}, 1, now, steps)
    assert detector.flags == []


@pytest.mark.unit
def test_a_straggler_that_catches_up_is_unflagged_after_three_windows_and_stays_on_record():
    detector = StragglerDetector()
    now, steps = _windows(detector, {0: 20.0, 1: 20.0, 2: 10.0}, 3)
    assert [flag.rank for flag in detector.current] == [2]
    now, steps = _windows(detector, {0: 20.0, 1: 20.0, 2: 19.0}, 2, now, steps)
    assert [flag.rank for flag in detector.current] == [2], "unflagged before three windows back"
    now, steps = _windows(detector, {0: 20.0, 1: 20.0, 2: 19.0}, 1, now, steps)
    assert detector.current == []
    [flag] = detector.flags
    assert flag.until == now and flag.worst == pytest.approx(0.5)
    assert flag.describe() == "rank 2 was 50 % slower than the median: host 10.0.0.3"


@pytest.mark.unit
def test_a_window_of_slow_steps_stretches_until_the_median_rank_made_enough_of_them():
    detector = StragglerDetector()
    detector.check(0.0, {0: (0, 0.0), 1: (0, 0.0), 2: (0, 0.0)}, HOSTS)
    # One step every 1.5 s: after 2 s the median rank has made one step, too few to judge.
    assert not detector.check(2.0, {0: (1, 1.5), 1: (1, 1.5), 2: (0, 0.0)}, HOSTS)
    assert detector.rates == {} and not detector.due(2.0) and detector.due(2.0 + stragglers.CHECK_INTERVAL)
    detector.check(6.5, {0: (4, 6.0), 1: (4, 6.0), 2: (2, 6.0)}, HOSTS)
    assert detector.rates == {0: pytest.approx(4 / 6), 1: pytest.approx(4 / 6), 2: pytest.approx(2 / 6)}


@pytest.mark.unit
def test_a_stopped_rank_is_slowest_and_no_window_without_two_ranks_to_compare():
    detector = StragglerDetector()
    _windows(detector, {0: 20.0, 1: 20.0, 2: 0.0}, 3)
    assert [(flag.rank, flag.slower) for flag in detector.flags] == [(2, 1.0)]
    # A rank whose bar has no total and that stops may have finished its loop: left out, not flagged.
    open_ended = StragglerDetector()
    now, steps = _windows(open_ended, {0: 20.0, 1: 20.0, 2: 20.0}, 1)
    for _ in range(4):
        now += stragglers.WINDOW_SECONDS
        steps = {0: steps[0] + 40, 1: steps[1] + 40, 2: steps[2]}
        open_ended.check(now, {rank: (count, now if rank < 2 else 2.0) for rank, count in steps.items()}, HOSTS,
                         open_ended={0, 1, 2})
    assert open_ended.flags == [] and open_ended.rates[0] == pytest.approx(20.0)
    alone = StragglerDetector()
    _windows(alone, {0: 20.0}, 5)
    assert alone.flags == [] and alone.rates == {}


# -- the record --------------------------------------------------------------------------------
def _record(np: int = 3) -> RunRecord:
    record = RunRecord(Placement.of(-np))
    for rank in range(np):
        record.apply(protocol.placed(rank, HOSTS[rank]))
    return record


def _report(record: RunRecord, rank: int, bars: dict) -> None:
    record.apply({"type": "report", "rank": rank, "progress": bars})


@pytest.mark.unit
def test_the_record_counts_every_bars_steps_across_restarts_and_nested_loops():
    record = _record(1)
    _report(record, 0, {"epoch": [0, 2, 100.0], "train": [0, 10, 100.0]})
    _report(record, 0, {"train": [6, 10, 101.0]})
    _report(record, 0, {"train": [10, 10, 102.0], "epoch": [1, 2, 102.0]})
    _report(record, 0, {"train": [3, 10, 103.0]})  # restarted for epoch 2: three steps since
    rank = record.ranks[0]
    assert (rank.steps, rank.steps_time) == (10 + 1 + 3, 103.0)


def _straggling_record() -> RunRecord:
    """Three ranks training, rank 2 at half the others' rate, through four windows of the kernel's clock."""
    record = _record(3)
    steps = [0, 0, 0]
    now = 1000.0
    for window in range(5):
        for rank, rate in enumerate((20, 20, 10)):
            steps[rank] += rate * stragglers.WINDOW_SECONDS if window else 0
            _report(record, rank, {"train": [steps[rank], 400, now]})
        record._check_stragglers(now)
        now += stragglers.WINDOW_SECONDS
    return record


@pytest.mark.unit
def test_the_record_flags_the_slow_rank_and_leaves_out_ranks_that_finished():
    record = _straggling_record()
    [flag] = record.stragglers
    assert (flag.rank, round(flag.slower, 2)) == (2, 0.5)
    assert record.ranks[2].straggler is flag and record.ranks[0].straggler is None
    assert record.ranks[0].step_rate == pytest.approx(20.0) and record.ranks[2].step_rate == pytest.approx(10.0)
    # Ranks 0 and 1 finish their bar; rank 2 goes on alone: no median, so no change and no new flag.
    now = 1000.0 + 6 * stragglers.WINDOW_SECONDS
    for rank in (0, 1):
        _report(record, rank, {"train": [400, 400, now]})
    _report(record, 2, {"train": [200, 400, now]})
    record._check_stragglers(now)
    record._check_stragglers(now + stragglers.WINDOW_SECONDS)
    assert len(record.stragglers) == 1 and record.ranks[2].straggler is flag


@pytest.mark.unit
def test_the_supervisors_samples_reach_the_rank_record():
    record = _record(2)
    gpu = {"index": "0", "util": 87.0, "used": 9_000_000_000, "total": 16_000_000_000, "rank_used": 3_100_000_000}
    record.apply(protocol.resources(1, 98.4, 312_000_000, [gpu]))
    record.apply(protocol.resources(1, 50.0, 200_000_000, [gpu]))
    rank = record.ranks[1]
    assert (rank.cpu, rank.rss, rank.peak_rss) == (50.0, 200_000_000, 312_000_000)
    assert progress_text.usage_text(rank) == "CPU 50 % · 200 MB · GPU 0 87 % 3.1/16 GB"
    assert progress_text.usage_text(record.ranks[0]) == ""  # not sampled yet: nothing shown
    record.apply({"type": "exit", "rank": 1, "code": -9})
    assert progress_text.usage_text(rank) == ""  # ended: its last sample would read as now


# -- the views ---------------------------------------------------------------------------------
@pytest.mark.unit
def test_the_text_summary_marks_the_straggler_deterministically():
    record = _straggling_record()
    for rank in range(3):
        _report(record, rank, {"train": [400, 400, 2000.0]})
        record.apply(protocol.exit_(rank, 0, aborted=False))
    record.finish([None] * 3)
    assert Snapshot(record).text() == (
        "%%horovod np=3 (local): finished\n"
        "⚠ straggler: rank 2 (a step rate 20 % or more below the median; hvdmagic.last_run().stragglers has "
        "the figures)\n"
        "rank 0: train 400/400 [finished]\n"
        "rank 1: train 400/400 [finished]\n"
        "rank 2: train 400/400 [finished] [⚠ straggler]\n")
    html = Snapshot(record)._repr_html_()
    assert "rank 2 was 50 % slower than the median: host 10.0.0.3" in html


@pytest.mark.unit
def test_a_balanced_record_has_no_marker_anywhere():
    record = _record(3)
    for window in range(5):
        for rank in range(3):
            _report(record, rank, {"train": [20 * window * stragglers.WINDOW_SECONDS, 400,
                                              1000.0 + window * stragglers.WINDOW_SECONDS]})
        record._check_stragglers(1000.0 + window * stragglers.WINDOW_SECONDS)
    assert record.stragglers == [] and record.ranks[0].step_rate == pytest.approx(20.0)
    assert progress_text.STRAGGLER_SIGN not in summary(record)
    assert progress_text.stragglers_line(record) == ""


@pytest.mark.unit
def test_the_dashboard_marks_the_row_and_says_it_in_the_header():
    from hvdmagic.kernel.ui.dashboard import Dashboard

    record = _straggling_record()
    record.apply(protocol.resources(2, 99.0, 250_000_000, []))
    for rank in (0, 2):
        record.apply(protocol.output(rank, "stdout", ["epoch 3: loss 2.2154"]))
    board = Dashboard(record)
    board._draw()
    assert board.draw_error is None
    assert "rank 2 is 50 % slower than the median: host 10.0.0.3" in board.header.value
    assert 'class="hvdmagic-straggler"' in board.rows[2].usage.value and "50 % slower" in board.rows[2].usage.value
    assert "CPU 99 % · 250 MB" in board.rows[2].usage.value
    assert "hvdmagic-straggler" not in board.rows[0].usage.value
    text = board.fallback_text().splitlines()
    assert text[1] == "⚠ rank 2 is 50 % slower than the median: host 10.0.0.3"
    assert "⚠ 50 % slower CPU 99 % · 250 MB" in text[4] and "⚠" not in text[2]
    # Issue 37: the figures and the last line are told apart, by a rule ("│" in the text), not run together.
    assert text[4].endswith("250 MB │ epoch 3: loss 2.2154") and text[2].endswith("running   epoch 3: loss 2.2154")
    assert "border-left" in board.rows[2].line.value and "border-left" not in board.rows[0].line.value
    board.discard()


# -- sampling a rank's processes ---------------------------------------------------------------
_BUSY_TREE = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
ballast = bytearray(80 * 1024 * 1024)  # 80 MiB, touched
print(child.pid, flush=True)
while True:
    pass
"""


@pytest.fixture
def busy_tree():
    """A process that keeps a core busy and holds 80 MiB, with a child of its own."""
    proc = subprocess.Popen([sys.executable, "-c", _BUSY_TREE], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    child = int(proc.stdout.readline())
    yield proc, child
    with contextlib.suppress(ProcessLookupError):  # a test may have killed it
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.unit
def test_the_process_tree_gives_cpu_and_rss_of_the_rank_and_its_children(busy_tree):
    proc, child = busy_tree
    tree = resources.ProcessTree(proc.pid)
    assert tree.sample(prime=True) is not None and tree.pids == {proc.pid}  # priming reads no tree
    # On a loaded machine a busy loop gets a fraction of a core: 5 % tells it from a sleeping process.
    cpu, rss = wait_until(lambda: (sample := tree.sample()) and sample[0] > 5 and sample, 10,
                          "the busy process never showed more than 5 % of a core")
    assert rss > 80 * 1024 * 1024 and tree.pids == {proc.pid, child}
    sleeper = resources.ProcessTree(child)
    sleeper.sample(prime=True)
    primed = time.monotonic()
    cpu, rss = wait_until(lambda: time.monotonic() > primed + 0.5 and sleeper.sample(), 10,
                          "the sleeping child's process vanished")
    assert cpu < 5 and rss < 80 * 1024 * 1024


@pytest.mark.unit
def test_the_sampler_sends_while_busy_and_stops_when_idle_or_gone(busy_tree):
    proc, _ = busy_tree
    sent: list[dict] = []
    sampler = resources.Sampler(proc.pid, 3, sent.append, {}, interval=0.1)
    time.sleep(0.3)  # not a synchronisation: a stretch in which an idle sampler must send nothing
    assert sent == []
    sampler.busy()
    wait_until(lambda: len(sent) >= 2, 10, "a busy rank was not sampled")
    event = sent[-1]
    assert event["type"] == "resources" and event["rank"] == 3 and event["rss"] > 80 * 1024 * 1024
    assert event["gpus"] == []  # no NVML on this machine
    sampler.idle()  # a session's cell ended: at most the sample under way still comes
    seen = len(sent)
    time.sleep(0.5)  # as above: a stretch in which five samples would have come
    assert len(sent) <= seen + 1
    sampler.busy()
    wait_until(lambda: len(sent) >= seen + 3, 10, "the next cell was not sampled")
    os.killpg(proc.pid, signal.SIGKILL)  # the rank dies: the sampler ends by itself
    proc.wait()
    wait_until(lambda: not sampler._thread.is_alive(), 10, "the sampler outlived its rank")


# -- GPUs, through a stand-in for NVML (no GPU on this machine) --------------------------------
class FakeNvml:
    """The part of pynvml's API that task.resources calls, for two GPUs; rank 7's pid runs on GPU 1."""

    class NVMLError(Exception):
        pass

    def __init__(self, pid: int):
        self.pid = pid
        self.initialised = 0

    def nvmlInit(self):
        self.initialised += 1

    def nvmlShutdown(self):
        self.initialised -= 1

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, index):
        if index >= 2:
            raise self.NVMLError("Invalid Argument")
        return f"gpu{index}"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return {"GPU-aaaa": "gpu0", "GPU-bbbb": "gpu1"}[uuid]

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=self.pid, usedGpuMemory=3_000_000_000)] if handle == "gpu1" else []

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=5_000_000_000 if handle == "gpu1" else 1_000_000_000, total=16_000_000_000)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=90 if handle == "gpu1" else 0, memory=10)


@pytest.mark.unit
def test_a_rank_given_a_gpu_reports_that_gpu_and_its_own_memory_on_it():
    assert resources.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1", "HVDMAGIC_CUDA_DEVICE": "1"}) == ["1"]
    assert resources.visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}) == ["GPU-aaaa", "GPU-bbbb"]
    assert resources.visible_gpus({}) is None and resources.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    nvml = FakeNvml(pid=7)
    gpus = resources.Gpus(nvml, ["1"])
    assert gpus.sample({7, 8}) == [{"index": "1", "util": 90.0, "used": 5_000_000_000, "total": 16_000_000_000,
                                    "rank_used": 3_000_000_000}]
    # Given GPU 0, where it runs nothing yet: still shown, with the device's memory and no own figure.
    assert resources.Gpus(nvml, ["GPU-aaaa"]).sample({7}) == [
        {"index": "GPU-aaaa", "util": 0.0, "used": 1_000_000_000, "total": 16_000_000_000, "rank_used": None}]
    gpus.close()
    assert nvml.initialised == 1
    with pytest.raises(FakeNvml.NVMLError):
        resources.Gpus(nvml, ["5"])  # a device NVML does not have: its init is undone
    assert nvml.initialised == 1


@pytest.mark.unit
def test_a_rank_that_was_given_no_gpu_shows_the_gpus_its_processes_use_and_none_without_nvml():
    nvml = FakeNvml(pid=7)
    assert [gpu["index"] for gpu in resources.Gpus(nvml, None).sample({7})] == ["1"]
    assert resources.Gpus(nvml, None).sample({99}) == []
    assert resources.Gpus.open([]) is None  # CUDA_VISIBLE_DEVICES="": no GPU, NVML not even imported
    assert resources.Gpus.open(None) is None  # this machine: no pynvml (or no driver)


# -- real runs ---------------------------------------------------------------------------------
# Rank 2 sleeps 0.1 s a step, the others 0.04 s: 60 % slower, for about 12 s (some six windows).
_LOOP = """%%horovod --np -3
import os, time, hvdmagic
slow = os.environ['HOROVOD_RANK'] == '2' and {straggle}
pause, steps = (0.1, 120) if slow else (0.04, 300)
for step in hvdmagic.track(range(steps), desc="train"):
    time.sleep(pause)
"""


def test_a_rank_that_sleeps_longer_each_step_is_flagged_and_only_it(ip, capfd):
    _, error = run(ip, _LOOP.format(straggle=True))
    assert error is None
    record = hvdmagic.last_run()
    assert [flag.rank for flag in record.stragglers] == [2], record.stragglers
    flag = record.stragglers[0]
    assert 0.4 < flag.slower < 0.75 and flag.host == socket.gethostname()  # a local task's host: this machine
    assert record.ranks[2].step_rate < record.ranks[0].step_rate
    out = capfd.readouterr().out
    assert ("hvdmagic: ⚠ rank 2 is a straggler: its step rate is 20 % or more below the median\n") in out
    summary_lines = [line for line in out.splitlines() if line.startswith(("rank ", "⚠ straggler"))]
    assert summary_lines[-3:] == ["rank 0: train 300/300 [finished]", "rank 1: train 300/300 [finished]",
                                  "rank 2: train 120/120 [finished] [⚠ straggler]"]
    # The supervisors sampled every rank, once a second, while it ran.
    for rank in record.ranks:
        assert rank.cpu is not None and 10 * 1024 * 1024 < rank.rss <= rank.peak_rss < 2 * 1024 ** 3, rank
        assert rank.gpus == []


# Ranks in step, as in data-parallel training: an allreduce every step. Rank 2 does 0.1 s of work a
# step and the others 0.02 s, so they wait for it in the allreduce and all make the same steps a second.
# Balanced, 250 steps of 0.02 s: over two of the detector's windows (WINDOW_SECONDS), so that it
# compares the ranks even when they start a second apart on a loaded machine (100 steps, one window,
# once left it nothing to compare).
_IN_STEP = """%%horovod --np -3
import os, time, torch, hvdmagic
import horovod.torch as hvd
hvd.init()
work = 0.1 if hvd.rank() == 2 and {straggle} else 0.02
for step in hvdmagic.track(range(100 if {straggle} else 250), desc="train"):
    time.sleep(work)
    hvd.allreduce(torch.ones(4), name="grad")
"""


@pytest.mark.parametrize("straggle", [True, False], ids=["one-slow-rank", "balanced"])
def test_ranks_in_step_flag_the_one_the_others_wait_for_and_none_when_balanced(ip, straggle):
    _, error = run(ip, _IN_STEP.format(straggle=straggle))
    assert error is None
    record = hvdmagic.last_run()
    assert all(rank.steps_waited > 0 for rank in record.ranks), "horovod.torch's waits were not timed"
    assert all(rank.step_rate is not None for rank in record.ranks), "the detector never compared the ranks"
    assert [flag.rank for flag in record.stragglers] == ([2] if straggle else []), record.stragglers


def test_a_balanced_run_flags_no_rank(ip, capfd):
    _, error = run(ip, _LOOP.format(straggle=False))
    assert error is None
    record = hvdmagic.last_run()
    assert record.stragglers == []
    assert all(rank.step_rate is not None for rank in record.ranks), "the detector never compared the ranks"
    assert "straggler" not in capfd.readouterr().out


@pytest.mark.unit
def test_a_rank_that_exited_but_is_not_reaped_gives_no_sample():
    """A zombie reads as 0 bytes of memory: sampled, it would end a finished rank's row at "0 MB"."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    tree = resources.ProcessTree(child.pid)
    wait_until(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, 30, "the child never exited")
    try:
        assert tree.sample() is None
    finally:
        child.wait()
