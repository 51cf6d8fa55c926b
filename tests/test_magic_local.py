"""Local mode (np < 0), capture errors and argument handling: a real shell, mostly without Spark
(a capture error is also checked on both Spark session kinds, through conftest's spark_kind)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import run
from helpers import execute
from IPython.core.error import UsageError

import hvdmagic
from hvdmagic import blob_transfer
from hvdmagic.errors import CaptureError, CellSyntaxError, JobFailed, JobInterrupted, LaunchError


@pytest.mark.profile
def test_local_mode_runs_ranks_on_the_driver(ip, capfd):
    result, error = run(ip, """%%horovod --np -2 --out sizes
import os, torch, horovod.torch as hvd
hvd.init()
print("pid", os.getpid())
(hvd.size(), hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item())
""")
    assert error is None
    assert result == (2, 2.0)
    assert ip.user_ns["sizes"] == (2, 2.0)
    out = capfd.readouterr().out
    pids = {line.split()[-1] for line in out.splitlines() if line.startswith("[rank") and " pid " in line}
    assert len(pids) == 2, out  # two separate processes


@pytest.mark.profile
@pytest.mark.parametrize("np, spark_kind", [(-2, "classic"), (2, "classic"), (2, "connect")],
                         ids=["local", "spark", "spark-connect"], indirect=["spark_kind"])
def test_unpicklable_global_fails_before_launch_naming_it(np, spark_kind, ip, tmp_path):
    """In local mode and on either Spark session kind, the capture fails in the kernel before a run
    begins: no run record, so nothing was submitted to Spark and no rank ran the cell."""
    ip.run_cell("import threading\nlock = threading.Lock()\nbefore = 1")
    namespace = dict(ip.user_ns)
    ran = tmp_path / "a_rank_ran_the_cell"
    runs_before = len(spark_kind.runs)
    _, error = run(ip, f"%%horovod --np {np} --out before\nopen({str(ran)!r}, 'w').close()\nwith lock:\n    pass")
    assert isinstance(error, CaptureError)
    assert "'lock'" in str(error) and "lock" in str(error).split("'lock'")[1][:30]
    assert ip.user_ns["before"] == 1
    assert ip.user_ns.keys() == namespace.keys()
    assert len(spark_kind.runs) == runs_before, "a run began: the failing cell reached the launcher"
    assert not ran.exists() and spark_kind.ranks() == [], "a rank ran the failing cell"
    del ip.user_ns["lock"]  # the next cell would capture it too
    result, error = run(ip, f"%%horovod --np {np}\nimport os\nint(os.environ['HOROVOD_SIZE'])")
    assert error is None and result == 2, error
    assert spark_kind.runs[-1].mode == (spark_kind.mode if np > 0 else "local"), spark_kind.runs[-1].mode


@pytest.mark.unit
def test_open_file_global_names_its_type(ip, tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("x")
    ip.user_ns["handle"] = open(path)
    try:
        _, error = run(ip, "%%horovod --np -2\nhandle.read()")
    finally:
        ip.user_ns["handle"].close()
    assert isinstance(error, CaptureError)
    assert "'handle' (_io.TextIOWrapper)" in str(error)


@pytest.mark.unit
def test_stop_while_the_capture_pickles_a_value_ends_the_cell_in_one_line_and_starts_no_run(ip):
    """Stop can land before anything is launched: while the capture pickles a notebook value (seconds
    for a large one) or its summary waits for the kernel's output thread. The cell ends as a Stop
    during a run ends, in one line, and no run began. The value raises KeyboardInterrupt as SIGINT
    would raise it there."""
    ip.run_cell("class StopLandsHere:\n"
                "    def __reduce__(self):\n"
                "        raise KeyboardInterrupt\n"
                "value = StopLandsHere()")
    before = hvdmagic.last_run()
    _, error = run(ip, "%%horovod --np -2\nvalue")
    assert isinstance(error, JobInterrupted), error
    assert error._render_traceback_() == ["JobInterrupted: interrupted before anything was started."]
    assert hvdmagic.last_run() is before, "a run began"
    del ip.user_ns["value"]
    result, error = run(ip, "%%horovod --np -2\n2")
    assert error is None and result == 2, error


def test_stop_while_the_job_opens_its_servers_closes_them_and_ends_the_cell_in_one_line(ip, monkeypatch):
    """A Stop that lands while the job opens the channel, the blob server and the rendezvous, before any
    task is asked for, ends the cell in one line and leaves no port listening in the kernel."""
    import psutil

    def listening() -> set:
        return {c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}

    ports_before = listening()

    def stop_lands_here(self, *args, **kwargs):
        raise KeyboardInterrupt  # as SIGINT would, once the channel and the blob server listen

    monkeypatch.setattr(blob_transfer.BlobServer, "publish", stop_lands_here)
    _, error = run(ip, "%%horovod --np -2\n1")
    assert isinstance(error, JobInterrupted), error
    assert error._render_traceback_() == ["JobInterrupted: interrupted before anything was started."]
    assert hvdmagic.last_run().state == "cancelled", hvdmagic.last_run().state
    assert listening() == ports_before, f"left listening: {listening() - ports_before}"
    monkeypatch.undo()
    result, error = run(ip, "%%horovod --np -2\n2")
    assert error is None and result == 2, error


@pytest.mark.unit
def test_stop_while_an_estimator_prepares_its_data_says_how_far_the_launch_got():
    """An estimator prepares its DataFrame with the dashboard up (``runner.execute``'s ``prepare``, Spark
    jobs of seconds): a Stop then is the one line that names the stage it reached, as a Stop while Spark
    starts or slots are awaited names theirs (``interrupts.before_launch``), and nothing was launched."""
    from hvdmagic.kernel.runner import execute
    from hvdmagic.launch import shipment
    from hvdmagic.launch.placement import Placement
    from hvdmagic.protocol import Stage

    def prepare(on_stage):
        on_stage(Stage.PREPARING_DATA)
        raise KeyboardInterrupt  # as SIGINT would, in the middle of the DataFrame's Spark job

    with pytest.raises(JobInterrupted) as caught:
        execute(shipment.pack((abs, (-1,), {})), Placement.of(-2), prepare=prepare)
    assert caught.value._render_traceback_() == [
        "JobInterrupted: interrupted while the DataFrame was being prepared; no rank was started."]
    assert hvdmagic.last_run().state == "cancelled" and hvdmagic.last_run().ended_before_launch


@pytest.mark.unit
def test_syntax_error_points_at_the_cell_line(ip):
    _, error = run(ip, "%%horovod --np -2\nx = 1\ny = (2 +\nprint(x)\n")
    assert isinstance(error, CellSyntaxError)
    rendered = "\n".join(error._render_traceback_())
    assert '"<horovod-cell>", line 3' in rendered  # line 1 is the %%horovod line, as in the notebook


@pytest.mark.unit
@pytest.mark.parametrize("line, message", [
    ("--np 0", "--np must be"),
    ("--np abc", "invalid int value"),
    ("--np 2 --bogus", "unrecognized arguments"),
    ("", "needs --np N, or a session"),
    ("--np 2 --out 3x", "valid Python variable name"),
    ("--np 2 --timeout -1", "--timeout must be"),
    # elastic runs
    ("--np 2 --min-np 3", "1 <= --min-np <= --np <= --max-np"),
    ("--np 2 --max-np 1", "1 <= --min-np <= --np <= --max-np"),
    ("--min-np 1", "give the cell --np N"),
    ("--np 2 --min-np 1 --controller mpi", "over Gloo"),
    ("--np 2 --min-np 1 --reset-limit -1", "--reset-limit must be 0 or more"),
    ("--np 2 --min-np 1 --elastic-timeout 0", "--elastic-timeout must be a positive"),
    ("--np 2 --min-np 1 --stall-timeout 5", "--stall-timeout is not applied to elastic runs"),
])
def test_bad_arguments_are_usage_errors(ip, line, message):
    _, error = run(ip, f"%%horovod {line}\nx = 1")
    assert isinstance(error, UsageError), error
    assert message in str(error), error


@pytest.mark.unit
def test_missing_body_is_a_usage_error(ip):
    _, error = run(ip, "%%horovod --np 2\n   \n")
    assert isinstance(error, UsageError)
    assert "needs a cell body" in str(error)


@pytest.mark.unit
def test_help_describes_the_arguments(ip, capsys):
    ip.run_cell("%%horovod?")
    out = capsys.readouterr().out
    for expected in ("--np N", "--out NAME", "--timeout SECONDS", "local mode"):
        assert expected in out


def test_a_rank_failing_in_its_first_line_keeps_its_own_exit_code_and_failed_in_the_cell(ip, capfd):
    """Rank 1 raises before any framework import; rank 0 is stopped. Rank 1 is left to end on its own
    (here its exit takes half a second, as a framework's shutdown may), so its exit code is its own 1,
    not the -15 of the SIGTERM that stops the others; and it failed in the cell, not "at importing"
    (its first stage)."""
    import hvdmagic

    _, error = run(ip, "%%horovod --np -2\nimport atexit, os, time\nif os.environ['HOROVOD_RANK'] == '1':\n"
                       "    atexit.register(time.sleep, 0.5)\n    raise ValueError('first line')\ntime.sleep(120)")
    assert isinstance(error, JobFailed) and "ValueError: first line" in str(error), error
    ranks = hvdmagic.last_run().ranks
    assert (ranks[1].state, ranks[1].exit_code) == ("failed", 1), ranks[1]
    assert ranks[0].state == "stopped" and ranks[0].exit_code == -15, ranks[0]
    out = capfd.readouterr().out
    assert re.search(r"rank 1: \[failed in the cell \(Cell In\[\d+\], line 5\)\]", out), out
    assert "at importing" not in out, out


# Rank 1 says why before it fails; its start-up printed a line of chatter; after its KeyError, its exit
# prints what the stop of a Horovod job prints (Horovod's own line, and one that looks like Gloo's). That
# line is one write: a rank's stderr is unbuffered, so print() would write it and its newline apart, and
# Horovod's thread, whose C++ stream writes each piece of its own line apart too, could write between them.
ERROR_AMID_NOISE = """%%horovod --np -2
import atexit, os, sys
import horovod.torch as hvd, torch
hvd.init()
print("oneDNN custom operations are on (start-up chatter)", file=sys.stderr)
hvd.allreduce(torch.ones(1))  # both ranks past hvd.init before rank 1 fails: a slow rank 0 is still in it otherwise
if hvd.rank() == 1:
    print("the data is bad")
    atexit.register(os.write, 2, b"Read error [127.0.0.1]:4242: Connection reset by peer\\n")
    {}["missing"]
while True:
    hvd.allreduce(torch.ones(1))
"""


def test_an_error_leads_with_the_failed_rank_s_traceback_and_folds_what_the_stop_printed(ip, capfd):
    """The traceback comes first, then the chatter its start-up printed; what the rank printed once it had
    failed, as the ranks were stopped, is one line under it, here and in the live lines. The rows say the
    true place: the failed rank's cell line, the stopped rank's collective in the cell (issue 48, 2 and 3)."""
    _, error = run(ip, ERROR_AMID_NOISE)
    assert isinstance(error, JobFailed) and "KeyError: 'missing'" in str(error), error
    rendered = error._render_traceback_()
    body = rendered[rendered.index("--- rank 1 ---") + 1:]
    assert body[0] == "Traceback (most recent call last):", rendered
    assert re.fullmatch(r"  Cell In\[\d+\], line 10, in <module>", body[1]), rendered
    chatter = body.index("(rank 1's start-up messages, hidden while it ran:)")
    assert body[chatter + 1] == "oneDNN custom operations are on (start-up chatter)", rendered
    assert body[chatter - 1] == "KeyError: 'missing'", rendered
    fold = body[chatter + 2]
    assert fold.startswith("(then, as the ranks were stopped, rank 1 printed \""), rendered
    # It quotes the first of them: ours, or Gloo's own ("Connection reset by peer", or "Connection closed
    # by peer" when the other rank's end came first, as it does under load), shortened at its front.
    quoted = re.search(r'printed "\.*(.+?)"( and \d+ more)?: in hvdmagic\.last_run\(\)\.logs\[1\]\)$', fold)
    assert quoted and "by peer" in quoted[1], fold
    import hvdmagic

    assert any(line.endswith(quoted[1]) for _, line in hvdmagic.last_run().ranks[1].logs), fold
    assert sum("by peer" in line for line in rendered) == 1, rendered  # the fallout is folded, not repeated

    out = capfd.readouterr().out
    assert "[rank 1] the data is bad" in out, out  # printed before the error: shown, not folded
    live = out[:out.index("%%horovod np=2")]  # what printed as it ran, before the summary and the error
    assert "Connection reset" not in live, out
    assert re.search(r"hvdmagic: \d+ more line\(s\) from ranks? [0-9, –]*1, printed once the run had "
                     r"failed, as the ranks were stopped: in hvdmagic.last_run\(\).logs", out), out
    assert re.search(r"rank 1: \[failed in the cell \(Cell In\[\d+\], line 10\)\]", out), out
    # Rank 0 is stopped in its allreduce, or fails there first (Horovod shut down with rank 1's exit).
    assert re.search(r"rank 0: \[(stopped (in `allreduce` \(Cell In\[\d+\], line 12\)|while training)"
                     r"|failed in the cell \(Cell In\[\d+\], line 12\))\]", out), out
    assert any("Connection reset by peer" in line for _, line in hvdmagic.last_run().ranks[1].logs)


@pytest.mark.profile
def test_failed_rank_in_local_mode_reports_the_cell_line(ip):
    _, error = run(ip, "%%horovod --np -2\n\nimport horovod.torch as hvd\nhvd.init()\n1 / (hvd.rank() - hvd.rank())")
    rendered = "\n".join(error._render_traceback_())
    assert "ZeroDivisionError" in rendered
    assert re.search(r"Cell In\[\d+\], line 5\b", rendered), rendered  # the leading blank line still counts


def test_a_rank_killed_by_a_signal_says_where_it_died(ip):
    """A crash in C code raises nothing: the rank's fault handler's stack names the cell's line."""
    ip.run_cell("def crash_on(rank):\n    import os, signal\n    if os.environ['HOROVOD_RANK'] == str(rank):\n"
                "        os.kill(os.getpid(), signal.SIGABRT)\n")
    _, error = run(ip, "%%horovod --np -2\nimport time\ncrash_on(1)\ntime.sleep(60)")
    assert isinstance(error, JobFailed) and str(error).startswith("rank 1 on "), error
    assert "failed: killed by SIGABRT" in str(error), error
    rendered = "\n".join(error._render_traceback_())
    died = rendered.split("--- rank 1 ---\n", 1)[1].splitlines()
    assert died[:3] == ["Fatal Python error: Aborted", "", "Current thread:"], died
    frames = died[3:]
    # Named as IPython names the cells, each with its source line: the frame that sent it, then the cell's own.
    assert re.fullmatch(r"  Cell In\[\d+\], line 4 in crash_on", frames[0]), frames
    assert frames[1] == "    os.kill(os.getpid(), signal.SIGABRT)", frames
    assert frames[2:4] == [f"  Cell In[{ip.execution_count}], line 3 in <module>", "    crash_on(1)"], frames
    assert not any("/hvdmagic/" in frame or "threading.py" in frame for frame in frames), frames


def test_timeline_is_recorded_and_summarised(ip, tmp_path, capfd):
    path = tmp_path / "trace" / "timeline.json"
    _, error = run(ip, f"""%%horovod --np -2 --timeline {path}
import torch, horovod.torch as hvd
hvd.init()
for _ in range(3):
    hvd.allreduce(torch.ones(64), name="weights")
""")
    assert error is None
    from hvdmagic.kernel.timeline import load_events, summarize

    events = load_events(path)
    assert any(e.get("name") == "ALLREDUCE" for e in events)
    weights = next(t for t in summarize(path) if t.name == "allreduce.weights")
    assert weights.count == 3 and weights.collective_ms > 0
    out = capfd.readouterr().out
    assert f"Horovod Timeline: {path}" in out and "chrome://tracing" in out and "allreduce.weights" in out


def test_unpicklable_rank0_result_is_a_warning_with_its_repr_not_a_failed_cell(ip, capfd):
    """Training finished: a value only the notebook would have shown must not fail the cell."""
    ip.user_ns["value"] = "untouched"
    result, error = run(ip, "%%horovod --np -2 --out value\nimport threading\nthreading.Lock()")
    assert error is None, error
    assert result is None and ip.user_ns["value"] is None
    warning = [line for line in capfd.readouterr().out.splitlines() if "cannot be sent back" in line]
    assert len(warning) == 1, "one line, once"
    assert "rank 0's result (_thread.lock)" in warning[0] and "<unlocked _thread.lock object" in warning[0]


def test_an_unpicklable_value_on_another_rank_is_kept_as_its_repr(ip, capfd):
    import hvdmagic
    from hvdmagic.launch import UnsentResult

    result, error = run(ip, "%%horovod --np -2\nimport os, threading\n"
                            "7 if os.environ['HOROVOD_RANK'] == '0' else threading.Lock()")
    assert error is None and result == 7
    other = hvdmagic.last_run().results[1]
    assert isinstance(other, UnsentResult) and other.type_name == "_thread.lock"
    assert "cannot be sent back" not in capfd.readouterr().out, "only rank 0's value is the cell's result"


def test_run_fails_naming_the_rank_and_type_of_an_unpicklable_value():
    import hvdmagic
    from hvdmagic.errors import JobFailed

    def lock_on_rank_one():
        import os
        import threading

        return threading.Lock() if os.environ["HOROVOD_RANK"] == "1" else 0

    with pytest.raises(JobFailed) as caught:
        hvdmagic.run(lock_on_rank_one, -2)
    assert caught.value.failures[0].rank == 1
    assert "the result (_thread.lock) cannot be pickled" in str(caught.value)


def test_without_horovod_load_ext_works_and_a_cell_says_how_to_install_it(kernel_factory):
    """horovod is imported lazily: the friendly error is reachable in a kernel whose import fails."""
    _, client = kernel_factory(without_horovod=True)
    reply, texts = execute(client, "%load_ext hvdmagic", timeout=60)
    assert reply["status"] == "ok", texts
    reply, texts = execute(client, "%%horovod --np -2\n1", timeout=60)
    assert reply["status"] == "error" and reply["ename"] == "LaunchError", (reply, texts)
    message = texts[-1]
    assert "horovod is not importable" in message and "make demo" in message
    assert len(message.strip().splitlines()) == 1, f"not one paragraph:\n{message}"


@pytest.mark.profile
@pytest.mark.unit
@pytest.mark.parametrize("name", ["horovod", "torchrun"])
def test_help_is_short_plain_and_names_the_session_commands(ip, capsys, name):
    cell = ip.find_cell_magic(name)
    doc = cell.__doc__
    lines = doc.splitlines()
    # 30, then --ranks, debug and --hold-on-error (issue 61)
    assert len(lines) <= 33, f"%%{name}? is {len(lines)} lines:\n{doc}"
    assert lines[0].startswith(f"%%{name} --np N [options]: run the cell"), lines[0]
    assert "::" not in doc and "``" not in doc, f"reST markup shows through in %%{name}?"
    assert f"%%{name} --np 2 --out accuracy" in doc and f"%%{name} --np -4" in doc, "two examples"
    prose = " ".join(doc.split())  # the help's prose is wrapped
    assert f"%{name} start --np N" in prose and f"%{name} status | stop | env | where" in prose, doc
    assert "subshell console" in prose, "a notebook cell that asks where waits behind the running one"
    # The table is the parser's: every option the magic parses, with its metavar.
    for action in cell.parser._actions:
        assert f"  {action.option_strings[0]} " in doc, action.option_strings
    assert "--mlflow [EXPERIMENT]" in doc and ("--controller {gloo,mpi}" in doc) == (name == "horovod")

    # %horovod? is the line magic's own help: the session's commands.
    line = ip.find_line_magic(name).__doc__
    heading = f"%{name} start|stop|status|env"
    assert line != doc and line.startswith(heading), line[:80]
    assert len(line.splitlines()) <= 30 and "::" not in line
    for command in ("start --np N", "status", "stop", "env", "where"):
        assert f"%{name} {command}" in line, command
    capsys.readouterr()
    ip.run_line_magic("pinfo", f"%{name}")
    shown_line = capsys.readouterr().out
    ip.run_line_magic("pinfo", f"%%{name}")
    shown_cell = capsys.readouterr().out
    assert heading in shown_line and "--out NAME" not in shown_line
    assert "--out NAME" in shown_cell and heading not in shown_cell


@pytest.mark.unit
def test_the_line_magic_still_runs_the_session_commands_and_the_cell_magic_its_arguments(ip, capsys):
    ip.run_line_magic("horovod", "status")
    assert capsys.readouterr().out.startswith("no %horovod session")
    _, error = run(ip, "%horovod --np 2")  # the line magic knows only the session's commands
    assert isinstance(error, UsageError) and "Usage: %horovod start --np N" in str(error), error
    _, error = run(ip, "%%horovod --np two\nx = 1")
    assert isinstance(error, UsageError) and "argument --np: invalid int value: 'two'" in str(error), error


@pytest.fixture
def fake_horovod(tmp_path, monkeypatch):
    """A horovod package whose metadata.json says what it was built for (the file horovod itself writes)."""
    import importlib
    import json
    import sys

    def built_for(**frameworks):
        package = tmp_path / "horovod"
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text("")
        (package / "metadata.json").write_text(json.dumps({**frameworks, "dummy": "none"}))
        monkeypatch.syspath_prepend(str(tmp_path))
        for name in [m for m in sys.modules if m == "horovod" or m.startswith("horovod.")]:
            monkeypatch.delitem(sys.modules, name)
        importlib.invalidate_caches()

    return built_for


@pytest.mark.unit
def test_a_cell_that_needs_tensorflow_from_a_horovod_built_without_it_names_the_rebuild(ip, fake_horovod):
    fake_horovod(pytorch="2.13.0+cpu")
    ip.user_ns["before"] = 1
    _, error = run(ip, "%%horovod --np -2 --out before\nimport horovod.tensorflow.keras as hvd\nhvd.init()")
    assert isinstance(error, LaunchError), error
    assert "built without TensorFlow" in str(error) and "python -m hvdmagic.build_horovod" in str(error)
    assert "\n" not in str(error) and ip.user_ns["before"] == 1


@pytest.mark.unit
def test_a_framework_version_that_differs_from_the_build_names_the_rebuild(ip, fake_horovod):
    fake_horovod(pytorch="2.1.0")
    _, error = run(ip, "%%horovod --np -2\nimport horovod.torch as hvd")
    assert isinstance(error, LaunchError), error
    assert "built against PyTorch 2.1.0, and PyTorch 2.13.0" in str(error)


@pytest.mark.unit
def test_mxnet_says_it_was_retired(ip):
    _, error = run(ip, "%%horovod --np -2\nimport mxnet as mx\nimport horovod.mxnet as hvd")
    assert isinstance(error, LaunchError) and "Apache retired MXNet in 2023" in str(error), error


@pytest.mark.profile
@pytest.mark.parametrize("magic, body", [
    ("horovod", "import torch, horovod.torch as hvd\nhvd.init()\nhvd.allreduce(torch.ones(1)).item()"),
    ("torchrun", "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                 "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"),
])
def test_a_trivial_cell_prints_no_warning_the_user_did_not_cause(ip, capfd, magic, body):
    """What hvdmagic sets for the ranks (the flight recorder's variables, the threads, the frameworks' own
    settings) must not make the frameworks of this runtime warn: a warning in every cell teaches users
    to ignore warnings."""
    capfd.readouterr()
    _, error = run(ip, f"%%{magic} --np -2\n{body}")
    assert error is None, error
    out = capfd.readouterr()
    # The ranks' whole logs too: the dashboard hides known start-up chatter, which users still see in
    # the logs, and on front ends that show a rank's raw output.
    logs = "\n".join(hvdmagic.last_run().logs.values())
    warned = [line for line in (out.out + out.err + logs).splitlines()
              if "warn" in line.lower() or "deprecat" in line.lower()]
    assert not warned, warned


# -- GPUs in local mode, on a fake nvidia-smi (tests/test_gpu.py runs the same on a real GPU) ----------
@pytest.fixture
def driver_with_gpus(tmp_path, monkeypatch):
    """Give the driver ``count`` fake GPUs: an nvidia-smi on PATH that lists them, as the real one does."""

    def give(count: int) -> None:
        bin_dir = tmp_path / "fake-nvidia"
        bin_dir.mkdir(exist_ok=True)
        listing = "\n".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-00000000000{i})"
                            for i in range(count))
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\ncat <<'LISTING'\n{listing}\nLISTING\n")
        smi.chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    return give


PINNING_CELL = """import os, horovod.torch as hvd
hvd.init()
hvd.allgather_object((hvd.local_rank(), os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("HVDMAGIC_CUDA_DEVICE")))
"""


def test_local_ranks_are_pinned_to_the_drivers_gpus_in_local_rank_order(ip, driver_with_gpus):
    """As on Spark: each rank sees its job's GPUs on its host, its own at index hvd.local_rank(), which is
    what Horovod code passes to torch.cuda.set_device."""
    driver_with_gpus(3)
    result, error = run(ip, f"%%horovod --np -2\n{PINNING_CELL}")
    assert error is None, error
    assert result == [(0, "0,1", "0"), (1, "0,1", "1")], result
    assert not hvdmagic.last_run().notes, hvdmagic.last_run().notes


def test_more_local_ranks_than_gpus_say_why_nccl_will_fail_before_launch(ip, driver_with_gpus):
    """NCCL refuses two ranks on one GPU (tests/test_gpu.py shows what it does): the run says so in one
    paragraph before its ranks start, and still runs unpinned, since Gloo with CPU tensors works."""
    driver_with_gpus(1)
    result, error = run(ip, f"%%horovod --np -2\n{PINNING_CELL}")
    assert error is None, error
    assert result == [(0, None, None), (1, None, None)], result
    (note,) = hvdmagic.last_run().notes
    assert note.startswith("2 ranks on 1 GPU: NCCL needs one GPU per rank"), note
    assert "Use --np -1, or Gloo for CPU tensors" in note, note


def test_ranks_are_started_fresh_not_forked_from_the_kernel(ip):
    """Why CUDA touched in the kernel cannot break a rank (tests/test_gpu.py checks it on a GPU): every
    rank is a new interpreter (exec), sharing no memory, and so no CUDA context, with the kernel."""
    result, error = run(ip, """%%horovod --np -1
import os, sys
(os.getpid(), sys.argv[0], open(f"/proc/{os.getpid()}/cmdline", "rb").read().split(b"\\0")[:3])
""")
    assert error is None, error
    pid, _argv0, cmdline = result
    assert pid != os.getpid()
    assert cmdline[1:3] == [b"-m", b"hvdmagic.rank"], cmdline


# A Python with no pyspark, as a new virtualenv installed without the `spark` extra has it: the
# kernel and its ranks find a `pyspark` that fails to import, first on their path.
WITHOUT_PYSPARK = r"""
import json
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "hvdmagic")
said = {}
def cell(name, text):
    outcome = shell.run_cell(text)
    error = outcome.error_in_exec
    said[name] = [type(error).__name__, "".join(error._render_traceback_())] if error else outcome.result
cell("horovod", "%%horovod --np -2\nimport os, horovod.torch as hvd\nhvd.init()\nhvd.size() * 10 + hvd.rank()")
cell("torchrun", "%%torchrun --np -2\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n"
                 "dist.get_world_size()")
cell("run", "import hvdmagic, os\nhvdmagic.run(lambda: int(os.environ['HOROVOD_SIZE']), np=-2)")
cell("spark", "%%horovod --np 2\n1")
import sys
said["pyspark"] = sys.modules.get("pyspark") is not None and hasattr(sys.modules["pyspark"], "SparkContext")
print(json.dumps(said))
"""


def test_without_pyspark_local_mode_runs_and_a_spark_cell_fails_in_one_paragraph(tmp_path):
    """`%load_ext hvdmagic`, `%%horovod --np -N`, `%%torchrun --np -N` and `hvdmagic.run(np=-N)` in a
    Python without pyspark; `--np N` there says what to install, in one paragraph."""
    fake = tmp_path / "no-pyspark" / "pyspark"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("No module named \'pyspark\'")\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", WITHOUT_PYSPARK], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["pyspark"] is False, "the kernel imported a real pyspark: the test's Python was not without it"
    assert said["horovod"] == 20 and said["torchrun"] == 2 and said["run"] == [2, 2], said
    kind, text = said["spark"]
    assert kind == "LaunchError" and "\n" not in text.strip(), said["spark"]
    assert "pyspark, which --np 2 runs the ranks on, is not importable" in text, text
    assert "pip install 'hvdmagic[spark]'" in text, text
    assert "--np -2, which runs the ranks on this machine without Spark" in text, text
