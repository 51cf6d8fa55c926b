"""Warm ranks: %horovod start / %%horovod without --np / %horovod stop, and hvdmagic.session."""

from __future__ import annotations

import os
import re
import signal
import socket
import time

import pytest
from conftest import run
from helpers import record_slot_waits, wait_until
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


@pytest.mark.profile
@pytest.mark.parametrize("np, spark_kind", [(-2, "classic"), (2, "classic"), (2, "connect")],
                         ids=["local", "spark", "spark-connect"], indirect=["spark_kind"])
def test_state_carries_over_cells_and_the_step_count_continues(ip, np, spark_kind, capfd):
    ip.run_line_magic("horovod", f"start --np {np}")
    try:
        assert f"ranks ready ({'local' if np < 0 else spark_kind.mode});" in capfd.readouterr().out
        result, error = run(ip, SETUP)
        assert error is None and result == 0, error
        pids = {p.pid for p in spark_kind.ranks()}
        assert len(pids) == 2, f"the session's rank processes: {pids}"
        for expected in ((3, 3 * 2.0), (6, 6 * 2.0)):
            result, error = run(ip, TRAIN)
            assert error is None, error
            assert result == expected and ip.user_ns["total"] == expected
        steps = hvdmagic.last_run().metrics.query("rank == 0")["step"].tolist()
        assert steps == [3, 4, 5], f"the metric step restarted: {steps}"
        assert {p.pid for p in spark_kind.ranks()} == pids, "the ranks were replaced between cells"
        # A notebook global wins over a rank variable of the same name.
        ip.user_ns["steps"] = 100
        result, error = run(ip, "%%horovod\nsteps + 1")
        assert error is None and result == 101
    finally:
        ip.run_line_magic("horovod", "stop")
    wait_until_gone(list(pids), within=10)


def test_the_start_says_its_ranks_are_ready_not_finished(ip, capfd):
    capfd.readouterr()
    ip.run_line_magic("horovod", "start --np -2")
    pids = [p.pid for p in rank_processes()]
    try:
        out = capfd.readouterr().out
        assert "%horovod start np=2 (local): ready\n" in out, out
        assert "finished" not in out, out
        assert len(pids) == 2, "the ranks are up"
    finally:
        ip.run_line_magic("horovod", "stop")
    wait_until_gone(pids, within=10)


def test_a_trivial_cell_on_warm_ranks_starts_no_process_and_no_stage(session):
    """Why a cell on warm ranks takes milliseconds (the figure is in benchmarks/): it runs in the
    session's rank processes, starts no process, and goes through none of a launch's stages."""
    from hvdmagic.protocol import Stage

    run(session, SETUP)
    ranks = rank_processes()

    def processes():  # the rank processes and theirs; a process is its pid and start time
        return {p for rank in rank_processes() for p in (rank, *rank.children(recursive=True))}

    before = processes()
    result, error = run(session, "%%horovod\n(hvd.allreduce(torch.ones(1)).item(), hvd.allgather_object(os.getpid()))")
    assert error is None and result[0] == 1.0, error
    assert sorted(result[1]) == sorted(p.pid for p in ranks) and len(ranks) == 2, "the cell ran in other processes"
    assert processes() == before, "a rank process started, or one ended"
    launch_stages = {Stage.SPARK_STARTING, Stage.WAITING_FOR_SLOTS, Stage.SUBMITTED, Stage.RANKS_STARTING,
                     Stage.IMPORTING}
    reached = set(hvdmagic.last_run().stage_reached)
    assert not reached & launch_stages, f"the cell went through {sorted(reached & launch_stages)}"
    _, error = run(session, "%%horovod --np -2\n1")  # fresh ranks beside the session: their record has them
    assert error is None and {Stage.RANKS_STARTING, Stage.IMPORTING} <= set(hvdmagic.last_run().stage_reached)


def test_each_cell_keeps_its_own_last_lines_even_those_printed_just_before_it_ends(session):
    """A rank's output and its events travel on different pipes: the cell's end waits for its output."""
    for cell in range(25):
        _, error = run(session, f"%%horovod\nimport sys, time\nprint('early {cell}')\ntime.sleep(0.02)\n"
                                f"print('late {cell}')\nprint('err {cell}', file=sys.stderr, end='')")
        assert error is None, error
        for rank in hvdmagic.last_run().ranks:  # (stdout and stderr are two pipes: no order between them)
            streams = {name: [line for stream, line in rank.logs if stream == name] for name in ("stdout", "stderr")}
            assert streams == {"stdout": [f"early {cell}", f"late {cell}"], "stderr": [f"err {cell}"]}, (
                cell, rank.rank, rank.logs)


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
    stuck = "\n".join(error._render_traceback_()).split("where the ranks were (most recent call first):\n")[1]
    assert stuck.startswith("rank 0:\n") and "in synchronize" in stuck, stuck  # inside the allreduce
    # The cell's line, the outermost Python frame (py-spy's native frames may follow).
    assert re.search(r"Cell In\[\d+\], line 5 in <module>\n.*allreduce.*\n*(  native frames|$)", stuck), stuck
    # The message says where, in a sentence, before the stacks (issue 46).
    assert re.search(r"\. Rank 0 waits in `allreduce` \(Cell In\[\d+\], line 5\)\.$", str(error)), error
    assert list(error.stacks) == [0] and hvdmagic.last_run().stacks == error.stacks
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
    wait_until(lambda: rank_processes() == [], 30, "the idle session's ranks still run")
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
    after = wait_until(lambda: (now := kernel_resources())["threads"] <= before["threads"] and now, 10,
                       lambda: f"threads: {before['threads']} before, {kernel_resources()['threads']} after")
    assert rank_processes() == []
    for what in ("threads", "sockets", "fds", "children"):
        assert after[what] <= before[what], f"{what}: {before[what]} before, {after[what]} after three sessions"


def test_a_cell_from_outside_the_kernel_is_refused(session, tmp_path):
    """Only the kernel holds the session's secret: a frame from anyone else never reaches a rank."""
    from hvdmagic.kernel import warm_sessions

    run(session, SETUP)
    marker = tmp_path / "ran"
    warm = warm_sessions._sessions[warm_sessions.Framework.HOROVOD]
    server = warm._job.server
    rejected = server.rejected
    with socket.create_connection(server.address, timeout=5) as sock:
        nonce = sock.recv(channel.NONCE_SIZE)
        forged = channel.Link(sock, channel.new_secret(), nonce, is_server=False)  # another kernel's secret
        forged.send({"type": "cell", "id": 99, "payload": ""})
        forged.send({"type": "output", "rank": 0, "lines": [f"open({str(marker)!r}, 'w')"]})
    wait_until(lambda: server.rejected != rejected, 10, "the forged connection was not turned away")
    assert server.rejected == rejected + 1, "the forged connection was not turned away"
    result, error = run(session, "%%horovod\nhvd.size()")
    assert error is None and result == 2 and not marker.exists()


@pytest.mark.profile
@pytest.mark.parametrize("np", [-2, 2], ids=["local", "spark"])
def test_torchrun_sessions_keep_the_process_group(ip, np):
    ip.run_line_magic("torchrun", f"start --np {np}")
    try:
        result, error = run(ip, "%%torchrun\nimport torch, torch.distributed as dist\n"
                                "dist.init_process_group('gloo')\nseen = []\ndist.get_rank()")
        assert error is None and result == 0, error
        for expected in (1, 2):
            result, error = run(ip, "%%torchrun\nseen.append(1)\nt = torch.tensor([float(len(seen))])\n"
                                    "dist.all_reduce(t)\nt.item()")
            assert error is None and result == 2.0 * expected, error
        # A cell on one rank (issue 61): rank 1 alone appends; a collective of the default group there is refused
        # before it starts, and so is DDP, while one on a group of that rank alone runs.
        result, error = run(ip, "%%torchrun\nalone = dist.new_group([0])\ndist.get_rank()")
        assert error is None and result == 0, error
        result, error = run(ip, "%%torchrun --ranks 1\nseen.append(2)\n(dist.get_rank(), len(seen))")
        assert error is None and result == (1, 3), error
        _, error = run(ip, "%%torchrun --ranks 0\ndist.all_reduce(torch.ones(1))")
        assert isinstance(error, JobFailed) and "`torch.distributed.all_reduce` is a collective" in str(error), error
        _, error = run(ip, "%%torchrun --ranks 0\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
                           "DDP(torch.nn.Linear(1, 1))")
        assert isinstance(error, JobFailed) and "DistributedDataParallel (its construction" in str(error), error
        result, error = run(ip, "%%torchrun --ranks 0\nt = torch.ones(1)\ndist.all_reduce(t, group=alone)\nt.item()")
        assert error is None and result == 1.0, error
        result, error = run(ip, "%%torchrun\nt = torch.tensor([float(len(seen))])\ndist.all_reduce(t)\nt.item()")
        assert error is None and result == 2.0 + 3.0, "the session's process group broke, or its ranks lost their state"
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


def test_a_one_shot_spark_cell_beside_a_spark_session_fails_at_once_instead_of_waiting(ip, monkeypatch):
    from hvdmagic.errors import LaunchError

    ip.run_line_magic("horovod", "start --np 2")
    try:
        waits = record_slot_waits(monkeypatch)
        _, error = run(ip, "%%horovod --np 2\n1")
        assert isinstance(error, LaunchError), error
        assert "the warm ranks of a session hold 2" in str(error), error
        # At once: the slot check saw nothing on its way, and neither waited for slots nor ran out its bound.
        assert [(w.coming, w.waited_for, w.ran_out) for w in waits] == [(None, None, False)], waits
        result, error = run(ip, "%%horovod\nimport horovod.torch as hvd\nhvd.init()\nhvd.size()")
        assert error is None and result == 2, "the session was disturbed"
    finally:
        ip.run_line_magic("horovod", "stop")
