"""Pure pieces: rank layout, channel authentication, line splitting, error rendering."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
from pathlib import Path

import pytest

from hvdmagic import channel, protocol
from hvdmagic.errors import JobFailed, RankFailure
from hvdmagic.launch.layout import compute_layout
from hvdmagic.launch.placement import Placement
from hvdmagic.task.lines import LineSplitter, split_at_marks

pytestmark = pytest.mark.unit


def test_layout_single_host():
    slots = compute_layout(["a", "a"])
    assert [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] == [
        (0, 0, 2, 0, 1), (1, 1, 2, 0, 1)]


def test_layout_mixed_placement_three_plus_one():
    # Tasks land interleaved across hosts; ranks still group host by host.
    slots = compute_layout(["h1", "h2", "h1", "h1"])
    by_task = [(s.rank, s.host, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots]
    assert by_task == [
        (0, "h1", 0, 3, 0, 2),
        (3, "h2", 0, 1, 1, 2),
        (1, "h1", 1, 3, 0, 1),
        (2, "h1", 2, 3, 0, 1),
    ]
    assert sorted(s.rank for s in slots) == [0, 1, 2, 3]


def test_layout_matches_horovods_own_assignment():
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments

    slots = sorted(compute_layout(["x", "y", "x", "y", "x"]), key=lambda s: s.rank)
    theirs = get_host_assignments([HostInfo("x", 3), HostInfo("y", 2)], 5)
    assert [(s.rank, s.host, s.local_rank, s.cross_rank, s.local_size, s.cross_size) for s in slots] == [
        (t.rank, t.hostname, t.local_rank, t.cross_rank, t.local_size, t.cross_size) for t in theirs]


def _pair(secret_server: bytes, secret_client: bytes):
    server = channel.ChannelServer("127.0.0.1", secret_server)
    client = channel.connect(*server.address, secret_client)
    return server, client


def test_channel_delivers_authenticated_events_in_both_directions():
    secret = channel.new_secret()
    server, client = _pair(secret, secret)
    try:
        client.send({"type": "hello", "n": 1})
        _link, event = server.events.get(timeout=5)
        assert event == {"type": "hello", "n": 1}
        server.broadcast({"type": "go"})
        assert client.recv() == {"type": "go"}
    finally:
        client.close()
        server.close()


def test_channel_drops_a_peer_with_the_wrong_secret():
    server, client = _pair(channel.new_secret(), channel.new_secret())
    try:
        client.send({"type": "result", "data": "x"})
        with pytest.raises(channel.ChannelError):
            client.recv()  # the server hung up on us
        assert server.events.empty()
        assert server.rejected == 1
    finally:
        client.close()
        server.close()


def test_channel_rejects_a_replayed_frame():
    secret = channel.new_secret()
    server = channel.ChannelServer("127.0.0.1", secret)
    try:
        raw = socket.create_connection(server.address)
        nonce = channel._recv_exact(raw, channel.NONCE_SIZE)
        # Sign one genuine frame (through a socketpair, to keep its bytes), then send it twice.
        mine, theirs = socket.socketpair()
        channel.Link(mine, secret, nonce, is_server=False).send({"type": "hello"})
        theirs.settimeout(5)
        frame = theirs.recv(65536)
        raw.sendall(frame)
        raw.sendall(frame)  # replayed: its sequence number no longer matches
        _, first = server.events.get(timeout=5)
        assert first == {"type": "hello"}
        raw.settimeout(5)
        assert raw.recv(1) == b""  # dropped
        _, gone = server.events.get(timeout=5)  # an authenticated peer's end is news for the driver
        assert gone == {"type": "gone"}
        assert server.events.empty() and server.rejected == 1
    finally:
        server.close()


def test_line_splitter_keeps_lines_and_throttles_carriage_returns():
    splitter = LineSplitter(interval=1.0)
    lines, transient = splitter.feed("a\nb\r\n10%\r20%\r", now=0.0)
    assert lines == ["a", "b"] and transient == "20%"
    lines, transient = splitter.feed("30%\r40%\r", now=0.5)
    assert lines == [] and transient is None  # too soon: held back, superseded later
    lines, transient = splitter.feed("50%\r", now=1.6)
    assert transient == "50%"
    lines, transient = splitter.feed("done\npartial", now=1.7)
    assert lines == ["done"] and transient is None
    assert splitter.finish() == ["partial"]


def test_line_splitter_turns_a_keras_progress_bar_into_one_updating_line():
    """fit(verbose=1) rewrites its bar with backspaces then \\r; the chunks split anywhere."""
    bars = [f"{i}/50 [{'=' * (i // 5)}>{'.' * (10 - i // 5)}] - ETA: 1s - loss: {1 / i:.4f}" for i in range(1, 51)]
    stream = "Epoch 1/1\n"
    previous = 0
    for bar in bars[:-1]:
        stream += "\b" * previous + "\r" + bar if previous else bar
        previous = len(bar)
    stream += "\b" * previous + "\r" + bars[-1] + "\n"
    splitter = LineSplitter(interval=1.0)
    lines, transients = [], []
    for i in range(0, len(stream), 7):  # 7-character chunks: backspace runs split across reads
        got, transient = splitter.feed(stream[i:i + 7], now=i / 1000)  # one character a millisecond
        lines += got
        transients += [transient] if transient else []
    lines += splitter.finish()
    assert lines == ["Epoch 1/1", bars[-1]], lines  # one final line, not fifty
    assert transients and all(t in bars for t in transients), transients  # no backspace left in an update
    assert len(transients) <= len(stream) / 1000 + 1  # rate-limited: one a second


def test_job_failed_groups_identical_tracebacks_and_limits_them():
    same = "Traceback...\nValueError: x\n"
    failures = [RankFailure(0, "ValueError: x", same), RankFailure(1, "ValueError: x", same)]
    failures += [RankFailure(r, f"E{r}", f"E{r}\n") for r in range(2, 7)]
    rendered = JobFailed(failures, stopped=[7])._render_traceback_()
    assert rendered[0].startswith("JobFailed: rank 0 failed: ValueError: x")
    assert "rank(s) 7 were stopped" in rendered[0]
    assert "--- rank 0, 1 ---" in rendered
    assert rendered[-1] == "... and 3 more distinct failure(s)"


def test_visible_devices_follow_local_rank_on_each_host():
    from hvdmagic.launch.layout import visible_devices

    hosts = ["a", "b", "a", "a"]
    gpus = [["3"], ["0"], ["1"], ["2"]]
    slots = compute_layout(hosts)
    for task, slot in enumerate(slots):
        devices, first = visible_devices(slots, gpus, task)
        listed = devices.split(",")
        assert listed[slot.local_rank] == gpus[task][0] and first == slot.local_rank
        assert sorted(listed) == sorted(g[0] for t, g in enumerate(gpus) if hosts[t] == slot.host)
    assert visible_devices(slots, [[], [], [], []], 0) is None


def test_visible_devices_with_two_gpus_per_task():
    from hvdmagic.launch.layout import visible_devices

    slots = compute_layout(["h", "h"])
    assert visible_devices(slots, [["2", "3"], ["0", "1"]], 1) == ("2,3,0,1", 2)


def test_spark_errors_are_reduced_to_the_python_exception_line():
    from hvdmagic.launch.spark import first_line

    text = ("An error occurred while calling o1.collect.\n: org.apache.spark.SparkException: Job aborted\n"
            "Traceback (most recent call last):\n  File \"worker.py\", line 1, in main\n"
            "ModuleNotFoundError: No module named 'hvdmagic'\n SQLSTATE: 38000\n\tat org.apache.Foo(Foo.scala:1)")
    line = first_line(RuntimeError(text))
    assert line.startswith("ModuleNotFoundError: No module named 'hvdmagic' on the executors")
    assert "docs/clusters.md" in line
    pyarrow = first_line(RuntimeError(text.replace("'hvdmagic'", "'pyarrow'")))
    assert "on the executors" in pyarrow and "PYSPARK_PYTHON" in pyarrow


def test_job_failed_puts_the_root_cause_before_its_fallout():
    fallout = RankFailure(0, "HorovodInternalError: Horovod has been shut down", time=1.0)
    cause = RankFailure(1, "ValueError: bad batch", time=2.0)
    later = RankFailure(2, "KeyError: x", time=3.0)
    error = JobFailed([later, fallout, cause], stopped=[])
    assert [f.rank for f in error.failures] == [1, 2, 0]
    assert str(error).startswith("rank 1 failed: ValueError: bad batch")


def test_timeline_summary_from_a_truncated_trace(tmp_path):
    from hvdmagic.kernel.timeline import describe, summarize

    trace = tmp_path / "t.json"
    trace.write_text(
        '[\n{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allreduce.grad"}},\n'
        '{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 0, "pid": 1},{"ph": "E", "ts": 1000, "pid": 1},'
        '{"ph": "B", "name": "ALLREDUCE", "ts": 1000, "pid": 1},'
        '{"ph": "B", "name": "GLOO_ALLREDUCE", "ts": 1100, "pid": 1},'
        '{"ph": "E", "ts": 2900, "pid": 1},{"ph": "E", "ts": 3000, "pid": 1},')  # no closing bracket
    (tensor,) = summarize(trace)
    assert (tensor.name, tensor.count, tensor.collective_ms, tensor.negotiate_ms) == ("allreduce.grad", 1, 2.0, 1.0)
    assert "chrome://tracing" in describe(trace) and "allreduce.grad" in describe(trace)


def test_supervisor_marks_only_its_own_kills_as_aborted():
    """A rank that dies of its own SIGKILL during an abort is a failure, not "stopped"."""
    import signal
    import subprocess

    from hvdmagic.task.rank_process import RankProcess

    ours = RankProcess(0, print, print)
    ours.proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    ours.kill()
    assert ours.proc.returncode == -signal.SIGTERM and -ours.proc.returncode in ours._sent

    oom = RankProcess(0, print, print)
    oom.proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    oom.proc.send_signal(signal.SIGKILL)  # the OOM killer got there first
    oom.proc.wait()
    oom.kill()
    assert oom._sent == set()  # so its exit is reported as a failure, not as aborted


def test_unauthenticated_peer_cannot_announce_a_large_frame():
    import struct

    secret = channel.new_secret()
    server = channel.ChannelServer("127.0.0.1", secret)
    try:
        raw = socket.create_connection(server.address)
        raw.recv(channel.NONCE_SIZE)
        raw.sendall(struct.pack(">I", channel.FIRST_FRAME_MAX + 1) + b"\0" * 32 + b"x" * 100)
        raw.settimeout(5)
        assert raw.recv(1) == b""  # dropped at the header, before buffering anything
        assert server.rejected == 1
    finally:
        server.close()


def test_rank_environment_drops_only_sparks_own_pythonpath_entries():
    from hvdmagic.task.environment import rank_base_environment

    spark_path = ":".join([
        "/opt/spark/python/lib/pyspark.zip", "/opt/spark/python/lib/py4j-0.10.9.9-src.zip",
        "/opt/spark/jars/spark-core_2.13-4.0.0.jar", "/work/userfiles/deps.zip", "/work/src",
    ])
    env = rank_base_environment({"PYTHONPATH": spark_path, "HOME": "/root"})
    assert env["PYTHONPATH"] == "/work/userfiles/deps.zip:/work/src"
    assert env["HOME"] == "/root"
    assert "PYTHONPATH" not in rank_base_environment({"PYTHONPATH": "/x/pyspark.zip:/x/spark-core.jar"})


def test_errors_subclass_the_standard_exception_they_mean():
    from hvdmagic.errors import CaptureError, JobTimeout, LaunchError

    assert issubclass(LaunchError, RuntimeError) and issubclass(JobFailed, RuntimeError)
    assert issubclass(JobTimeout, TimeoutError) and issubclass(JobTimeout, JobFailed)
    assert issubclass(CaptureError, ValueError)
    with pytest.raises(TimeoutError):
        raise JobTimeout([RankFailure(0, "stalled")], [])


def test_tensorflow_start_up_chatter_is_kept_out_of_the_views_and_shown_when_the_rank_fails():
    from hvdmagic.kernel.noise import is_startup_noise
    from hvdmagic.kernel.record import RunRecord

    chatter = [
        "2026-11-23 17:00:00.123456: I tensorflow/core/util/port.cc:153] oneDNN custom operations are on. You may "
        "see slightly different numerical results due to floating-point round-off errors.",
        "E0000 00:00:1763917200.123456   4242 cuda_dnn.cc:8310] Unable to register cuDNN factory: Attempting to "
        "register factory for plugin cuDNN when one has already been registered",
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
        "To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow with the "
        "appropriate compiler flags.",
        "[W1127 13:24:24.664448635 Utils.hpp:137] Warning: Environment variable TORCH_NCCL_TRACE_BUFFER_SIZE is "
        "deprecated; use TORCH_FR_BUFFER_SIZE instead (function operator())",  # torch 2.11 (Colab)
    ]
    mine = ["Epoch 1/2", "loss: 0.5 - error: the data is bad", "E: my own message"]
    assert all(is_startup_noise(line) for line in chatter)
    assert not any(is_startup_noise(line) for line in mine)
    record = RunRecord(Placement.of(1))
    record.apply({"type": "output", "rank": 0, "stream": "stderr", "lines": chatter + mine, "transient": None})
    assert [line for _, _, line in record.all_logs] == mine  # what the views show
    assert record.logs[0].count("\n") == len(chatter) + len(mine)  # the full log keeps everything
    failure = JobFailed([RankFailure(0, "ImportError: x", "Traceback...\nImportError: x\n")], [])
    failure.quiet_output = {0: record.ranks[0].quiet}
    rendered = "\n".join(failure._render_traceback_())
    assert "rank 0's start-up messages, hidden while it ran" in rendered and chatter[1] in rendered


@pytest.mark.unit
def test_a_cell_end_mark_is_found_even_cut_between_two_reads():
    mark = protocol.CELL_END_MARK
    pieces, held = split_at_marks(b"last line\n" + mark[:5], mark)
    assert (pieces, held) == ([b"last line\n"], mark[:5])  # maybe a mark: held back, not printed
    pieces, held = split_at_marks(held + mark[5:] + b"next cell\n" + mark + b"\x1e", mark)
    assert (pieces, held) == ([b"", b"next cell\n", b""], b"\x1e")
    assert split_at_marks(b"plain \x1e text", mark) == ([b"plain \x1e text"], b"")


@pytest.mark.unit
def test_a_peers_closed_connection_is_fallout_and_the_dead_rank_is_the_root_cause():
    """Rank 1 died of SIGKILL (its exit carries no rank-side time); rank 0's Gloo error about the
    closed connection came with one. The death is the news."""
    gloo = RankFailure(0, "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                          "[127.0.0.1]:36052. This is typically caused by a remote worker crashing.", time=1.0)
    killed = RankFailure(1, "killed by SIGKILL")
    assert gloo.is_fallout and not killed.is_fallout
    assert [f.rank for f in JobFailed([gloo, killed], []).failures] == [1, 0]
    # A rank's own error that merely mentions a connection is not fallout.
    own = RankFailure(0, "ValueError: bad shard", time=1.0)
    assert [f.rank for f in JobFailed([own, killed], []).failures] == [0, 1]


@pytest.mark.unit
def test_a_hang_among_128_ranks_names_the_quiet_rank_and_its_host_in_one_clause_per_kind():
    """127 ranks wait in a collective on rank 84, which sleeps on host 11 of 16: the watchdog's
    message names rank 84 and its host, and the 127 in one clause, not 127."""
    import types

    from hvdmagic.launch.job import Job, JobState
    from hvdmagic.launch.stall_clock import StallClock

    state = JobState(np=128, go_at=0.0, clock=StallClock(0.0))
    state.hosts = {rank: f"host{rank // 8 + 1}" for rank in range(128)}
    state.last_heard = {rank: 99.0 for rank in range(128)}
    for rank in range(128):
        state.clock.saw({"type": "output", "rank": rank}, 60.0 if rank == 84 else 70.0)
    state.last_heard[84] = 60.0  # its heartbeats stopped too: the process does not answer
    job = types.SimpleNamespace(np=128, timeout=None, stall_timeout=30.0, _stuck=lambda s, now: Job._stuck(job, s, now))
    message = Job._watchdog(job, state, 100.0, None)
    assert message.startswith("rank(s) 84 made no progress for 30 s (--stall-timeout); "), message
    assert "rank 84 stopped progressing 40 s ago, on host11 (no heartbeat for 40 s)" in message, message
    assert "ranks 0–83, 85–127 stopped progressing 30 s ago, on 16 hosts (alive" in message, message
    assert message.count("stopped progressing") == 2, message


@pytest.mark.unit
def test_a_task_the_kernel_sends_away_before_the_ranks_started_is_not_a_lost_task():
    """--timeout ran out while the tasks were still saying hello (beside a second make test, the
    [connect] timeout test at 840b9a8): the abort closes a task's connection before its rank has a
    slot, and the cell's error must be the timeout, not "lost its connection before its rank
    started". With no abort under way, that loss is still the launch's error."""
    import types

    from hvdmagic.errors import LaunchError
    from hvdmagic.launch.job import Job, JobState
    from hvdmagic.protocol import Event

    link = object()
    gone = {"type": Event.GONE, "why": "closed"}
    job = types.SimpleNamespace(on_event=lambda event: None)
    state = JobState(np=2, hellos={0: (link, {"task": 0})}, aborted_at=0.0)
    Job._contact(job, link, gone, state)
    assert state.failures == [] and state.exits == {}, "a task sent away by the kernel is not a failed rank"
    state.aborted_at = None
    with pytest.raises(LaunchError, match="Spark task 0 lost its connection to the kernel before its rank started"):
        Job._contact(job, link, gone, state)


# -- build_horovod's GPU flags (the GPU machine's build: tests/test_gpu.py, scripts/gpu_check.sh) ---------
def _nvidia_smi_answering(lines: list[str], tmp_path, monkeypatch):
    """An nvidia-smi first on PATH that prints ``lines`` whatever it is asked, and no caller's CC list."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo {shlex.quote(line)}\n" for line in lines))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.delenv("HOROVOD_BUILD_CUDA_CC_LIST", raising=False)
    return smi


def test_the_gpu_discovery_script_gives_spark_the_gpus_nvidia_smi_lists(tmp_path, monkeypatch):
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_discovery.sh"
    _nvidia_smi_answering(["0", "1"], tmp_path, monkeypatch)
    said = subprocess.run(["sh", str(script)], capture_output=True, text=True, check=True).stdout
    assert json.loads(said) == {"name": "gpu", "addresses": ["0", "1"]}, said
    # nvidia-smi without its driver: no JSON, and an exit status that stops the worker (it was told it has GPUs).
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the driver' >&2\n"
                   "exit 9\n")
    failed = subprocess.run(["sh", str(script)], capture_output=True, text=True)
    assert failed.returncode == 9 and "NVIDIA-SMI has failed" in failed.stderr and failed.stdout == "", failed


def test_a_gpu_build_compiles_for_the_gpus_nvidia_smi_lists(tmp_path, monkeypatch):
    from hvdmagic import build_horovod

    _nvidia_smi_answering(["9.0", "9.0", "8.6"], tmp_path, monkeypatch)
    assert build_horovod.cuda_architectures() == {"HOROVOD_BUILD_CUDA_CC_LIST": "86,90"}
    monkeypatch.setenv("HOROVOD_BUILD_CUDA_CC_LIST", "80")
    assert build_horovod.cuda_architectures() == {}, "the caller's list wins (it passes through)"


def test_a_gpu_build_finds_nccl_in_the_nvidia_wheel_through_a_link_named_as_cmake_expects(tmp_path, monkeypatch):
    from hvdmagic import build_horovod

    site = tmp_path / "site-packages"
    (site / "nvidia" / "nccl" / "include").mkdir(parents=True)
    (site / "nvidia" / "nccl" / "include" / "nccl.h").write_text("")
    (site / "nvidia" / "nccl" / "lib").mkdir()
    (site / "nvidia" / "nccl" / "lib" / "libnccl.so.2").write_text("")
    monkeypatch.setattr("sys.path", [str(site)])
    monkeypatch.setenv("HVDMAGIC_CACHE", str(tmp_path / "cache"))
    for name in ("HOROVOD_NCCL_HOME", "HOROVOD_NCCL_INCLUDE", "HOROVOD_NCCL_LIB"):
        monkeypatch.delenv(name, raising=False)
    flags = build_horovod.nccl_from_wheel()
    assert flags["HOROVOD_NCCL_INCLUDE"] == str(site / "nvidia" / "nccl" / "include")
    assert flags["HOROVOD_NCCL_LINK"] == "SHARED"
    link = tmp_path / "cache" / "hvdmagic" / "nccl-link"
    assert (link / flags["HOROVOD_NCCL_LIB"].rsplit("/", 1)[1] / "libnccl.so").resolve() == \
        (site / "nvidia" / "nccl" / "lib" / "libnccl.so.2").resolve()
    assert build_horovod.nccl_from_wheel() == flags, "a second build reuses the link"
    monkeypatch.setenv("HOROVOD_NCCL_HOME", "/opt/nccl")
    assert build_horovod.nccl_from_wheel() == {}, "the caller's NCCL wins"


def test_a_gpu_build_ignores_what_nvidia_smi_says_that_is_no_compute_capability(tmp_path, monkeypatch):
    from hvdmagic import build_horovod

    _nvidia_smi_answering(['Field "compute_cap" is not a valid field to query.', "[N/A]"], tmp_path, monkeypatch)
    monkeypatch.setattr(build_horovod, "torch_cuda", lambda: ("12.8", "sm_80 sm_90"))
    assert build_horovod.cuda_architectures() == {"HOROVOD_BUILD_CUDA_CC_LIST": "80,90"}, "torch's list instead"


def test_a_build_imports_torch_once_to_ask_what_it_was_built_for(tmp_path, monkeypatch):
    """Whether torch is a CUDA build, for which CUDA release, for which architectures: one import (seconds)."""
    from hvdmagic import build_horovod

    build_horovod.torch_cuda.cache_clear()
    build_horovod.cuda_build.cache_clear()
    toolkit = tmp_path / "cuda"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    (toolkit / "lib64").mkdir()
    (toolkit / "lib64" / "libcudart.so.12").write_text("")
    (toolkit / "bin").mkdir()
    nvcc = toolkit / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n")
    nvcc.chmod(0o755)
    _nvidia_smi_answering(["[N/A]"], tmp_path, monkeypatch)
    real_run, torch_imports = subprocess.run, []

    def counting(cmd, *args, **kwargs):
        if cmd[1:2] == ["-c"] and re.search(r"\bimport\b.*\btorch\b", cmd[2]):
            torch_imports.append(cmd)
        return real_run(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", counting)
    try:
        build_horovod.cuda_build("pytorch")
        build_horovod.usable_toolkit(str(nvcc))
        build_horovod.cuda_architectures()
    finally:
        build_horovod.torch_cuda.cache_clear()
        build_horovod.cuda_build.cache_clear()
    assert len(torch_imports) == 1, torch_imports


@pytest.mark.parametrize("visible, devices", [("0,1", ["0", "1"]), ("-1", []), ("", []), ("1,-1,0", ["1"])])
def test_the_drivers_gpus_follow_cuda_visible_devices_as_cuda_reads_it(monkeypatch, visible, devices):
    from hvdmagic.launch.local import driver_devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert driver_devices() == devices


@pytest.mark.unit
def test_the_stall_clock_runs_from_the_go_for_a_rank_that_never_reported():
    from hvdmagic.launch.stall_clock import StallClock

    clock = StallClock(100.0)
    clock.saw({"type": "output", "rank": 0}, 103.0)
    assert clock.stalled([0, 1], 105.0, 4) == [1]  # rank 1 said nothing since its go at 100
    assert clock.stalled([0, 1], 108.0, 4) == [0, 1]
    clock.saw({"type": "heartbeat", "rank": 1}, 108.0)  # alive is not progress
    clock.saw({"type": "stage", "rank": 1, "stage": "first step"}, 108.0)  # a stage reached is
    assert clock.stalled([0, 1], 110.0, 4) == [0]


@pytest.mark.unit
def test_the_stall_clock_holds_while_any_rank_imports_a_framework():
    from hvdmagic.launch.stall_clock import StallClock

    clock = StallClock(0.0)
    clock.saw({"type": "stage", "rank": 1, "stage": "importing", "importing": "tensorflow"}, 1.0)
    assert clock.stalled([0, 1], 30.0, 4) == []  # rank 0 waits for rank 1 in hvd.init meanwhile
    clock.saw({"type": "stage", "rank": 1, "stage": "importing", "importing": ""}, 31.0)
    assert clock.stalled([0, 1], 33.0, 4) == []  # every clock restarted when the import held them
    assert clock.stalled([0, 1], 36.0, 4) == [0, 1]
    clock.saw({"type": "stage", "rank": 0, "stage": "importing into the template"}, 36.0)
    assert clock.stalled([0, 1], 50.0, 4) == []  # a template's imports hold them too


@pytest.mark.unit
def test_the_benchmarks_start_their_kernels_in_one_place():
    """benchmarks/_common.Kernel starts a Jupyter kernel for every benchmark that times one (issue 46)."""
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    starting = sorted(path.name for path in benchmarks.glob("*.py") if "start_new_kernel" in path.read_text())
    assert starting == ["_common.py"], starting


def test_the_executors_python_is_this_one_where_nothing_else_is_said(monkeypatch, tmp_path):
    """launch.spark_session.prefer_this_python: what %load_ext and import hvdmagic.spark do before the
    user's own SparkSession, for its local-mode executors."""
    import sys

    from hvdmagic.launch import spark_session

    for name in ("PYSPARK_PYTHON", "SPARK_REMOTE", "MASTER", "PYSPARK_SUBMIT_ARGS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))
    context = getattr(sys.modules.get("pyspark"), "SparkContext", None)
    if context is not None:  # a test before this one may have left a context: none runs in this one
        monkeypatch.setattr(context, "_active_spark_context", None)
    assert spark_session.prefer_this_python() and os.environ["PYSPARK_PYTHON"] == sys.executable
    monkeypatch.setenv("PYSPARK_PYTHON", "/opt/their/python")  # the user's, or the runtime's, is theirs
    assert not spark_session.prefer_this_python() and os.environ["PYSPARK_PYTHON"] == "/opt/their/python"
    for name, value in (("MASTER", "yarn"), ("PYSPARK_SUBMIT_ARGS", "--master spark://head:7077 pyspark-shell")):
        monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
        monkeypatch.setenv(name, value)
        assert not spark_session.prefer_this_python() and "PYSPARK_PYTHON" not in os.environ, name
        monkeypatch.delenv(name)
    (tmp_path / "spark-defaults.conf").write_text("spark.executor.memory 4g\nspark.master   k8s://https://api:6443\n")
    assert not spark_session.prefer_this_python() and "PYSPARK_PYTHON" not in os.environ
    (tmp_path / "spark-defaults.conf").write_text("spark.master local[4]\n")
    assert spark_session.prefer_this_python()
    monkeypatch.delenv("PYSPARK_PYTHON")
    if context is not None:
        monkeypatch.setattr(context, "_active_spark_context", object())  # a session runs: too late to change
        assert not spark_session.prefer_this_python() and "PYSPARK_PYTHON" not in os.environ
