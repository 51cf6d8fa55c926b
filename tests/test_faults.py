"""The failure scenarios users hit with the anchors, on real Spark and real Horovod.

Each one checks that no rank process is left behind and that the next cell works.
Latency bounds here are the requirement itself (fail fast, never hang), checked
with generous margins; the measured figures live in docs/reliability.md.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

pytest.register_assert_rewrite("fault_scenarios")  # its checks' asserts explain themselves here

from conftest import run  # noqa: E402
from fault_scenarios import SCENARIOS, Outcome  # noqa: E402
from helpers import execute, iopub_messages, record_slot_waits  # noqa: E402
from procs import kernel_resources, rank_processes, wait_until_gone  # noqa: E402

import hvdmagic  # noqa: E402
from hvdmagic.errors import LaunchError  # noqa: E402

HERE = Path(__file__).parent
NEXT_CELL = "%%horovod --np 2\nimport horovod.torch as hvd\nhvd.init()\nhvd.size()"


def assert_clean_and_usable(ip, ranks=rank_processes):
    assert ranks() == [], "rank processes outlived the cell"
    result, error = run(ip, NEXT_CELL)
    assert error is None and result == 2, error


# Per scenario: np (-2 is local mode), the rank the fault is on, and the limit its option
# gets (--timeout counts Spark's start-up too, and this machine may be busy: generous).
CASES = {
    "none": (2, 0, None),
    "raise": (2, 1, None),
    "sigkill": (2, 0, None),
    "exit_code": (2, 1, None),
    "early_exit": (2, 1, 120),
    "hang_timeout": (2, 1, 20),
    "stall_timeout": (2, 0, 8),
    "log_flood": (-2, 0, None),
}


@pytest.mark.unit
def test_every_scenario_has_a_case():
    assert set(CASES) == set(SCENARIOS)


# Local-mode cases that run on Spark too, with this np: the flood's path from a rank to the notebook
# differs there (the supervisor's channel from a Spark task, not from a kernel thread).
ALSO_ON_SPARK = {"log_flood": 2}


def _kinds():
    """Each Spark case on both session kinds (conftest's spark_kind); local mode's once, and again on
    both kinds where ALSO_ON_SPARK says. The plain ids ([raise], [log_flood]) keep meaning the case
    as CASES has it, on a classic session, which docs/reliability.md cites."""
    for name, (np, _, _) in CASES.items():
        if np > 0:
            yield pytest.param(name, np, "classic", id=name)
            yield pytest.param(name, np, "connect", id=f"{name}-connect")
            continue
        yield pytest.param(name, np, "classic", id=name)
        if name in ALSO_ON_SPARK:
            yield pytest.param(name, ALSO_ON_SPARK[name], "classic", id=f"{name}-spark")
            yield pytest.param(name, ALSO_ON_SPARK[name], "connect", id=f"{name}-connect")


KINDS = list(_kinds())


@pytest.mark.parametrize("name, np, spark_kind", KINDS, indirect=["spark_kind"])
def test_fault_scenario(name, np, spark_kind, ip, tmp_path, capfd):
    """Each fault ends the cell with the outcome fault_scenarios.py describes, fast where it
    must; then no rank process is left and the next cell works."""
    scenario = SCENARIOS[name]
    _, rank, limit = CASES[name]
    if scenario.option == "--timeout":
        run(ip, NEXT_CELL)  # --timeout counts Spark's start-up too; start it first
    stamp = tmp_path / "fault_at"
    capfd.readouterr()  # only this cell's output
    result, error = run(ip, scenario.cell(np, rank, stamp, limit))
    returned = time.time()
    assert spark_kind.runs[-1].mode == (spark_kind.mode if np > 0 else "local"), spark_kind.runs[-1].mode
    scenario.check(Outcome(result, error, capfd.readouterr().out, rank, limit))
    if scenario.fail_within is not None:
        latency = returned - float(stamp.read_text())
        assert latency < scenario.fail_within, f"the cell failed {latency:.1f} s after the fault"
    assert_clean_and_usable(ip, spark_kind.ranks)


def test_not_enough_slots_fails_at_once(ip, monkeypatch):
    from hvdmagic.launch import spark_session as spark

    run(ip, NEXT_CELL)  # make sure a session exists
    monkeypatch.setattr(spark, "_embedded", None)  # now it counts as the user's session
    waits = record_slot_waits(monkeypatch)
    _, error = run(ip, "%%horovod --np 64\nx = 1")
    assert isinstance(error, LaunchError)
    assert "--np 64 needs 64 barrier task slots" in str(error) and "offers" in str(error)
    assert "and no more were on their way after" in str(error), error
    # At once: the slot check looked once, saw nothing on its way, and neither waited for slots nor ran out its bound.
    assert [(w.coming, w.waited_for, w.ran_out) for w in waits] == [(None, None, False)], waits


def test_not_enough_slots_for_a_dataframes_session_fails_at_once(ip, monkeypatch):
    """--data's session is the DataFrame's, given rather than looked up: its slots are counted all the
    same (they once were not, and the stage waited on Spark's retries), and the embedded session is
    not restarted bigger under the DataFrame."""
    run(ip, NEXT_CELL)  # make sure the embedded session exists
    run(ip, "from pyspark.sql import SparkSession\ndf = SparkSession.getActiveSession().range(64)")
    waits = record_slot_waits(monkeypatch)
    _, error = run(ip, "%%horovod --np 64 --data df\nx = 1")
    assert isinstance(error, LaunchError) and "--np 64 needs 64 barrier task slots" in str(error), error
    assert "and no more were on their way after" in str(error), error
    assert [(w.coming, w.waited_for, w.ran_out) for w in waits] == [(None, None, False)], waits
    assert run(ip, "df.count()") == (64, None)  # its session lives on


def test_rank_returning_early_without_collectives_is_fine(ip, tmp_path):
    """Rank 1's process is gone before rank 0 returns: the run still succeeds."""
    pid_file = tmp_path / "rank1.pid"
    result, error = run(ip, f"""%%horovod --np 2
import os, time, psutil
if os.environ["HOROVOD_RANK"] == "1":
    open({str(pid_file)!r}, "w").write(str(os.getpid()))
else:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.exists({str(pid_file)!r}) and not psutil.pid_exists(int(open({str(pid_file)!r}).read() or 0)):
            break
        time.sleep(0.01)
    else:
        raise TimeoutError("rank 1 did not exit within 60 s")
os.environ["HOROVOD_RANK"]
""")
    assert error is None and result == "0", error
    assert hvdmagic.last_run().results == ["0", "1"]


def test_twenty_reruns_leak_nothing(ip):
    for _ in range(3):  # warm up: the Spark session, its threads and the allocator's pools exist before we count
        run(ip, NEXT_CELL)
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
    grown = (after["rss"] - before["rss"]) / 2**20
    assert grown < 40, f"the kernel's memory grew {grown:.0f} MiB over 20 runs ({before['rss'] / 2**20:.0f} MiB before)"


@pytest.mark.parametrize("np, session", [(-2, False), (2, False), (-2, True), (2, True)],
                         ids=["local", "spark", "local-session", "spark-session"])
def test_ranks_exit_when_the_kernel_dies(np, session, kernel_factory):
    """SIGKILL a real Jupyter kernel mid-run (or with a session's ranks idle): its ranks exit within 10 s.
    (kernel_factory then SIGKILLs the kernel's process group: its Spark JVM, if it lingers.)"""
    manager, client = kernel_factory()
    reply, texts = execute(client, "%load_ext hvdmagic", timeout=60)
    assert reply["status"] == "ok", texts
    if session:
        reply, texts = execute(client, f"%horovod start --np {np}", timeout=120)
        assert reply["status"] == "ok", texts
        # The ranks print their pids and stay busy in the session's cell, away from their stdin.
        msg_id = client.execute("%%horovod\nimport os, time\nprint('training', os.getpid(), flush=True)\n"
                                "time.sleep(600)")
    else:
        msg_id = client.execute(f"%%horovod --np {np}\nimport os, time\n"
                                "print('training', os.getpid(), flush=True)\ntime.sleep(600)")
    pids: list[int] = []
    for msg in iopub_messages(client, msg_id, timeout=120):
        if msg["msg_type"] == "stream":
            pids += [int(line.split()[-1]) for line in msg["content"]["text"].splitlines() if " training " in line]
        if len(pids) >= abs(np):
            break
    assert len(pids) == abs(np), f"the ranks never started; pids so far: {pids}"
    os.kill(manager.provisioner.process.pid, signal.SIGKILL)
    wait_until_gone(pids, within=10)
