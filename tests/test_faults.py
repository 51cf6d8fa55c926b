"""The failure scenarios users hit with the anchors, on real Spark and real Horovod.

Each one checks that no rank process is left behind and that the next cell works.
Latency bounds here are the requirement itself (fail fast, never hang), checked
with generous margins; the measured figures live in docs/reliability.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hvdmagic
from conftest import run
from hvdmagic.errors import JobFailed, JobTimeout, LaunchError
from procs import kernel_resources, rank_processes, wait_until_gone

HERE = Path(__file__).parent
NEXT_CELL = "%%horovod --np 2\nimport horovod.torch as hvd\nhvd.init()\nhvd.size()"


def assert_clean_and_usable(ip):
    assert rank_processes() == [], "rank processes outlived the cell"
    result, error = run(ip, NEXT_CELL)
    assert error is None and result == 2, error


def test_raise_during_allreduce_fails_fast(ip, tmp_path):
    stamp = tmp_path / "raised_at"
    _, error = run(ip, f"""%%horovod --np 2
import time, torch, horovod.torch as hvd
hvd.init()
if hvd.rank() == 1:
    time.sleep(1)
    open({str(stamp)!r}, "w").write(repr(time.time()))
    raise KeyError("missing feature")
hvd.allreduce(torch.ones(1))
""")
    latency = time.time() - float(stamp.read_text())
    assert isinstance(error, JobFailed) and error.failures[0].rank == 1
    assert "KeyError: 'missing feature'" in "\n".join(error._render_traceback_())
    assert latency < 5, f"the cell failed {latency:.1f} s after the raise"
    assert_clean_and_usable(ip)


def test_sigkill_names_rank_and_signal(ip, tmp_path):
    stamp = tmp_path / "killed_at"
    _, error = run(ip, f"""%%horovod --np 2
import os, signal, time, torch, horovod.torch as hvd
hvd.init()
if hvd.rank() == 0:
    open({str(stamp)!r}, "w").write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
hvd.allreduce(torch.ones(1))
time.sleep(600)
""")
    latency = time.time() - float(stamp.read_text())
    assert isinstance(error, JobFailed)
    assert error.failures[0].rank == 0 and "killed by SIGKILL" in str(error)
    assert latency < 10, f"the cell failed {latency:.1f} s after the kill"
    assert_clean_and_usable(ip)


def test_timeout_names_the_rank_that_stopped_progressing(ip):
    run(ip, NEXT_CELL)  # --timeout counts Spark's start-up too; start it first
    _, error = run(ip, """%%horovod --np 2 --timeout 20
import time, os
rank = int(os.environ["HOROVOD_RANK"])
print("started", flush=True)
while True:
    if rank == 0:
        print("tick", flush=True)
    time.sleep(0.5 if rank == 0 else 60)
""")
    assert isinstance(error, JobTimeout)
    message = str(error)
    assert "--timeout 20" in message
    assert "rank 1 stopped progressing" in message and "alive" in message
    assert "rank 0 stopped progressing" not in message
    assert_clean_and_usable(ip)


def test_stall_timeout_catches_a_deadlocked_collective(ip):
    # Rank 0 waits in an allreduce that rank 1 never joins: a classic deadlock.
    _, error = run(ip, """%%horovod --np 2 --stall-timeout 8
import os, threading, time

def busy():
    while True:
        print("rank 1 busy", flush=True)
        time.sleep(0.5)

if os.environ["HOROVOD_RANK"] == "1":
    threading.Thread(target=busy, daemon=True).start()  # busy from the start, however slow imports are
import torch, horovod.torch as hvd
hvd.init()
if hvd.rank() == 0:
    print("entering the collective", flush=True)
    hvd.allreduce(torch.ones(1), name="never_matched")
else:
    time.sleep(600)
""")
    assert isinstance(error, JobTimeout)
    assert "rank(s) 0 made no progress for 8 s (--stall-timeout)" in str(error)
    assert_clean_and_usable(ip)


def test_not_enough_slots_fails_at_once(ip, monkeypatch):
    from hvdmagic.launcher import spark

    run(ip, NEXT_CELL)  # make sure a session exists
    monkeypatch.setattr(spark, "_embedded", None)  # now it counts as the user's session
    started = time.monotonic()
    _, error = run(ip, "%%horovod --np 64\nx = 1")
    assert isinstance(error, LaunchError)
    assert "--np 64 needs 64 barrier task slots" in str(error) and "offers" in str(error)
    assert time.monotonic() - started < 5


def test_early_exit_of_one_rank_gives_a_clear_outcome(ip):
    _, error = run(ip, """%%horovod --np 2 --timeout 120
import sys, torch, horovod.torch as hvd
hvd.init()
if hvd.rank() == 1:
    sys.exit(0)
for _ in range(3):
    hvd.allreduce(torch.ones(1))
""")
    assert isinstance(error, JobFailed) and not isinstance(error, JobTimeout)
    assert "rank(s) 1 had finished the cell" in str(error)
    assert_clean_and_usable(ip)


def test_rank_returning_early_without_collectives_is_fine(ip):
    result, error = run(ip, """%%horovod --np 2
import time, os
if os.environ["HOROVOD_RANK"] == "0":
    time.sleep(2)
os.environ["HOROVOD_RANK"]
""")
    assert error is None and result == "0"
    assert hvdmagic.last_run().results == ["0", "1"]


def test_log_flood_is_capped_in_the_cell_but_kept_whole(ip, capfd):
    _, error = run(ip, """%%horovod --np -2
import sys
for i in range(100_000):
    sys.stdout.write(f"line {i}\\n")
""")
    assert error is None
    out = capfd.readouterr().out
    assert out.count("[rank 0] line ") == 1000
    assert "output capped at 1000 lines here; the full log is in hvdmagic.last_run().logs[0]" in out
    logs = hvdmagic.last_run().logs
    assert logs[0].count("\n") == 100_000 and logs[0].endswith("line 99999\n")


def test_twenty_reruns_leak_nothing(ip):
    run(ip, NEXT_CELL)  # warm up: the Spark session and its threads exist before we count
    before = kernel_resources()
    for i in range(20):
        failing = i % 3 == 0
        _, error = run(ip, "%%horovod --np 2\nimport horovod.torch as hvd\nhvd.init()\n"
                           + ("raise RuntimeError('bad run')" if failing else "hvd.rank()"))
        assert (error is not None) == failing
    after = kernel_resources()
    assert rank_processes() == []
    for what in ("threads", "sockets", "fds", "children"):
        assert after[what] <= before[what], f"{what} grew from {before[what]} to {after[what]} over 20 runs"


@pytest.mark.parametrize("np", [-2, 2])
def test_ranks_exit_when_the_kernel_dies(np, tmp_path):
    """SIGKILL the driver process mid-run: its ranks notice and exit within 10 s."""
    script = tmp_path / "driver.py"
    script.write_text(f"""
import os, sys, cloudpickle
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
from hvdmagic.launcher import launch

def train():
    import time
    print("training", os.getpid(), flush=True)
    time.sleep(600)

def on_event(event):
    if event.get("type") == "output":
        for line in event["lines"]:
            print(line, flush=True)

launch(cloudpickle.dumps((train, (), {{}})), {np}, on_event=on_event)
""")
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        pids = []
        deadline = time.monotonic() + 120
        while len(pids) < abs(np) and time.monotonic() < deadline:
            line = driver.stdout.readline()
            if not line:
                break
            if line.startswith("training"):
                pids.append(int(line.split()[1]))
        assert len(pids) == abs(np), "the ranks never started"
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        wait_until_gone(pids, within=10)
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)  # the driver's Spark JVM, if it lingers
        except ProcessLookupError:
            pass
