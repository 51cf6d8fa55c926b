"""Warm ranks: %horovod start / %%horovod without --np / %horovod stop, and hvdmagic.session."""

from __future__ import annotations

import os
import re
import signal
import socket
import time

import pytest
from conftest import run
from IPython.core.error import UsageError
from procs import kernel_resources, rank_processes, wait_until_gone

import hvdmagic
from hvdmagic import channel
from hvdmagic.errors import JobFailed, JobInterrupted

SETUP = """%%horovod
import os, torch, horovod.torch as hvd, hvdmagic
hvd.init()
steps = 0
weights = torch.zeros(1)
hvd.rank()
"""
TRAIN = """%%horovod --out total
for _ in range(3):
    steps += 1
    weights += hvd.allreduce(torch.ones(1), op=hvd.Sum)
    hvdmagic.log_metrics(loss=1.0 / steps)
(steps, weights.item())
"""


@pytest.fixture
def session(ip):
    """A %horovod session of 2 local ranks, stopped (and checked for leftovers) after the test."""
    ip.run_line_magic("horovod", "start --np -2")
    yield ip
    pids = [p.pid for p in rank_processes()]
    ip.run_line_magic("horovod", "stop")
    wait_until_gone(pids, within=10)


def _line(ip, line: str):
    """Run a line magic as a cell does; return (result, error)."""
    outcome = ip.run_cell(f"%{line}")
    return outcome.result, outcome.error_in_exec


@pytest.mark.parametrize("np", [-2, 2], ids=["local", "spark"])
def test_state_carries_over_cells_and_the_step_count_continues(ip, np):
    ip.run_line_magic("horovod", f"start --np {np}")
    try:
        result, error = run(ip, SETUP)
        assert error is None and result == 0, error
        pids = {p.pid for p in rank_processes()}
        for expected in ((3, 3 * 2.0), (6, 6 * 2.0)):
            result, error = run(ip, TRAIN)
            assert error is None, error
            assert result == expected and ip.user_ns["total"] == expected
        steps = hvdmagic.last_run().metrics.query("rank == 0")["step"].tolist()
        assert steps == [3, 4, 5], f"the metric step restarted: {steps}"
        assert {p.pid for p in rank_processes()} == pids, "the ranks were replaced between cells"
        # A notebook global wins over a rank variable of the same name.
        ip.user_ns["steps"] = 100
        result, error = run(ip, "%%horovod\nsteps + 1")
        assert error is None and result == 101
    finally:
        ip.run_line_magic("horovod", "stop")
    wait_until_gone(list(pids), within=10)


def test_a_trivial_cell_on_warm_ranks_takes_milliseconds(session):
    run(session, SETUP)
    started = time.perf_counter()
    result, error = run(session, "%%horovod\nhvd.allreduce(torch.ones(1)).item()")
    assert error is None and result == 1.0
    # Generous: the figure (a few ms) is in benchmarks/; this only proves no process or stage starts.
    assert time.perf_counter() - started < 1.0


def test_a_keyboard_interrupt_in_the_cell_keeps_the_session(session):
    run(session, SETUP)
    session.user_ns["signal"] = signal
    # Each rank interrupts itself: SIGINT reaches its cell as Stop's does (the supervisor sends SIGINT).
    _, error = run(session, "%%horovod\nimport time\ncounter = 7\nos.kill(os.getpid(), signal.SIGINT)\n"
                            "time.sleep(30)")
    assert isinstance(error, JobFailed) and "KeyboardInterrupt" in str(error), error
    assert "the session keeps its ranks and their state" in str(error)
    result, error = run(session, "%%horovod\ncounter")
    assert error is None and result == 7


def test_interrupt_from_the_kernel_stops_the_cell_on_every_rank_within_5_s(session):
    import threading

    run(session, SETUP)
    timer = threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGINT))  # Stop, pressed 2 s in
    timer.start()
    started = time.monotonic()
    _, error = run(session, "%%horovod\nimport time\nmarker = 'set'\nwhile True:\n    time.sleep(0.05)")
    stopped = time.monotonic() - started
    assert isinstance(error, JobInterrupted), error
    assert "session keeps its ranks" in str(error) and stopped < 2 + 5
    result, error = run(session, "%%horovod\nmarker")
    assert error is None and result == "set"


def test_a_rank_stuck_in_a_collective_makes_the_session_restart_its_ranks(session):
    import threading

    run(session, SETUP)
    old = {p.pid for p in rank_processes()}
    timer = threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    _, error = run(session, "%%horovod\nimport time\nlost = 1\nif hvd.rank() == 0:\n"
                            "    hvd.allreduce(torch.ones(1), name='never_joined')\nelse:\n    time.sleep(600)")
    assert isinstance(error, JobInterrupted), error
    assert re.search(r"rank\(s\) 0 did not stop within 5 s", str(error)) and "is lost" in str(error), error
    wait_until_gone(list(old), within=10)
    _, error = run(session, "%%horovod\nlost")
    assert isinstance(error, JobFailed) and "NameError" in str(error), "the restarted ranks kept state?"
    result, error = run(session, SETUP)
    assert error is None and result == 0, "the restarted session does not work"


def test_an_error_outside_a_collective_keeps_the_session(session):
    run(session, SETUP)
    _, error = run(session, "%%horovod\nkept = 42\nif hvd.rank() == 1:\n    raise ValueError('bad input')")
    assert isinstance(error, JobFailed) and error.failures[0].rank == 1
    assert "ValueError: bad input" in str(error) and "keeps its ranks" in str(error)
    result, error = run(session, "%%horovod\nkept")
    assert error is None and result == 42


def test_a_killed_rank_is_named_and_the_session_comes_back_without_its_state(session):
    run(session, SETUP)
    _, error = run(session, "%%horovod\nimport signal\ngone = 1\nif hvd.rank() == 1:\n"
                            "    os.kill(os.getpid(), signal.SIGKILL)\nhvd.allreduce(torch.ones(1))")
    assert isinstance(error, JobFailed), error
    assert error.failures[0].rank == 1 and "killed by SIGKILL" in error.failures[0].summary
    assert "is lost" in str(error)
    _, error = run(session, "%%horovod\ngone")
    assert isinstance(error, JobFailed) and "NameError" in str(error)
    result, error = run(session, SETUP)
    assert error is None and result == 0


def test_the_session_stops_itself_when_idle_and_says_so(ip):
    ip.run_line_magic("horovod", "start --np -2 --idle-timeout 2")
    pids = [p.pid for p in rank_processes()]
    deadline = time.monotonic() + 30
    while rank_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rank_processes() == [], "the idle session's ranks still run"
    _, error = run(ip, "%%horovod\n1")
    assert isinstance(error, UsageError) and "--idle-timeout" in str(error), error
    wait_until_gone(pids, within=1)
    ip.run_line_magic("horovod", "stop")


def test_start_twice_is_an_error_unless_restart_and_usage_errors_are_clear(session):
    _, error = _line(session, "horovod start --np -2")
    assert isinstance(error, UsageError) and "--restart" in str(error)
    _, error = _line(session, "horovod start --np -2 --restart")
    assert error is None
    _, error = _line(session, "horovod launch")
    assert isinstance(error, UsageError) and "start --np N" in str(error)
    _, error = run(session, "%%horovod --data df\n1")
    assert isinstance(error, UsageError) and "--data needs ranks of its own" in str(error)


def test_a_one_shot_cell_keeps_fresh_processes_while_a_session_runs(session):
    run(session, SETUP)
    session_pids = {p.pid for p in rank_processes()}
    result, error = run(session, "%%horovod --np -2\nimport os\n'steps' in globals()")
    assert error is None and result is False
    assert {p.pid for p in rank_processes()} == session_pids


def test_status_names_ranks_hosts_state_and_memory(session, capsys):
    run(session, SETUP)
    capsys.readouterr()
    session.run_line_magic("horovod", "status")
    out = capsys.readouterr().out
    assert "2 ranks (local), idle" in out
    assert re.search(r"^\s+0\s+\S+\s+idle\s+\d+ MiB\s+\d+ s$", out, re.M), out
    assert re.search(r"^\s+1\s+\S+\s+idle\s+\d+ MiB", out, re.M), out


def test_stop_leaves_no_process_thread_or_socket_behind(ip):
    run(ip, "%%horovod --np -2\n1")  # warm the kernel's own threads first
    before = kernel_resources()
    for _ in range(3):
        ip.run_line_magic("horovod", "start --np -2")
        run(ip, SETUP)
        ip.run_line_magic("horovod", "stop")
    deadline = time.monotonic() + 10
    while (after := kernel_resources())["threads"] > before["threads"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rank_processes() == []
    for what in ("threads", "sockets", "fds", "children"):
        assert after[what] <= before[what], f"{what}: {before[what]} before, {after[what]} after three sessions"


def test_a_cell_from_outside_the_kernel_is_refused(session, tmp_path):
    """Only the kernel holds the session's secret: a frame from anyone else never reaches a rank."""
    from hvdmagic.kernel import sessions

    run(session, SETUP)
    marker = tmp_path / "ran"
    warm = sessions._sessions[sessions.Framework.HOROVOD]
    server = warm._job.server
    rejected = server.rejected
    with socket.create_connection(server.address, timeout=5) as sock:
        nonce = sock.recv(channel.NONCE_SIZE)
        forged = channel.Link(sock, channel.new_secret(), nonce, is_server=False)  # another kernel's secret
        forged.send({"type": "cell", "id": 99, "payload": ""})
        forged.send({"type": "output", "rank": 0, "lines": [f"open({str(marker)!r}, 'w')"]})
    deadline = time.monotonic() + 10
    while server.rejected == rejected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.rejected == rejected + 1, "the forged connection was not turned away"
    result, error = run(session, "%%horovod\nhvd.size()")
    assert error is None and result == 2 and not marker.exists()


def test_torchrun_sessions_keep_the_process_group(ip):
    ip.run_line_magic("torchrun", "start --np -2")
    try:
        result, error = run(ip, "%%torchrun\nimport torch, torch.distributed as dist\n"
                                "dist.init_process_group('gloo')\nseen = []\ndist.get_rank()")
        assert error is None and result == 0, error
        for expected in (1, 2):
            result, error = run(ip, "%%torchrun\nseen.append(1)\nt = torch.tensor([float(len(seen))])\n"
                                    "dist.all_reduce(t)\nt.item()")
            assert error is None and result == 2.0 * expected, error
    finally:
        ip.run_line_magic("torchrun", "stop")


def test_python_api_session_context_manager(ip):
    def setup():
        import horovod.torch as hvd

        hvd.init()
        import builtins

        builtins.hvdmagic_test_calls = 0

    def count():
        import builtins

        import horovod.torch as hvd

        builtins.hvdmagic_test_calls += 1
        return builtins.hvdmagic_test_calls, hvd.size()

    with hvdmagic.session(-2) as warm:
        hvdmagic.run(setup, session=warm)
        assert hvdmagic.run(count, session=warm) == [(1, 2), (1, 2)]
        assert hvdmagic.run(count, session=warm) == [(2, 2), (2, 2)]
    assert not warm.running
    assert rank_processes() == []


def test_a_one_shot_spark_cell_beside_a_spark_session_fails_at_once_instead_of_waiting(ip):
    from hvdmagic.errors import LaunchError

    ip.run_line_magic("horovod", "start --np 2")
    try:
        started = time.monotonic()
        _, error = run(ip, "%%horovod --np 2\n1")
        assert isinstance(error, LaunchError), error
        assert "the warm ranks of a session hold 2" in str(error), error
        assert time.monotonic() - started < 30
        result, error = run(ip, "%%horovod\nimport horovod.torch as hvd\nhvd.init()\nhvd.size()")
        assert error is None and result == 2, "the session was disturbed"
    finally:
        ip.run_line_magic("horovod", "stop")
