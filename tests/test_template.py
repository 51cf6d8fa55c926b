"""Issue 38: ranks forked from a host's template that has imported their frameworks, and every
case where a fork would not give what a spawn gives falls back to the spawn, with a note."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from procs import rank_processes

import hvdmagic
from hvdmagic import rank_ranges
from hvdmagic.protocol import Boot, Stage
from hvdmagic.rank.template import TEMPLATE_NAME
from hvdmagic.task import rank_template
from hvdmagic.task.rank_process import RankProcess

DEADLINE = 30.0


@pytest.fixture(autouse=True)
def templates_on(monkeypatch):
    """These tests are about templates: on whatever the run's HVDMAGIC_TEMPLATE says."""
    monkeypatch.setenv(rank_template.TEMPLATE_ENV, "1")


def where_am_i():
    """What a rank sees of its own start: run first thing, before the cell imports anything."""
    import sys as rank_sys

    preloaded = "torch" in rank_sys.modules
    import horovod.torch as hvd
    import numpy
    import torch

    hvd.init()
    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    return {"preloaded": preloaded, "pid": os.getpid(), "parent": os.getppid(),
            "template": b"--template" in parent, "cwd": os.getcwd(), "rank": hvd.rank(),
            "sum": hvd.allreduce(torch.ones(1), op=hvd.Sum).item(), "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS"), "draw": float(numpy.random.random()),
            "tag": os.environ.get("TEMPLATE_TEST_TAG"), "path": rank_sys.path,
            "stdio": [(type(stream.buffer).__name__, stream.line_buffering, stream.write_through, stream.encoding)
                      for stream in (rank_sys.stdin, rank_sys.stdout, rank_sys.stderr)],
            "signals": [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)]}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] if Path(f"/proc/{pid}").exists() else "X"
    return state not in ("Z", "X")


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # another process's end: nothing here to wait on
    return True


def test_ranks_fork_from_a_template_that_imported_their_frameworks():
    first = hvdmagic.run(where_am_i, np=-2)
    record = hvdmagic.last_run()
    second = hvdmagic.run(where_am_i, np=-2)
    again = hvdmagic.last_run()
    for results in (first, second):
        assert [r["rank"] for r in results] == [0, 1] and all(r["sum"] == 2.0 for r in results)
        # Forked: the framework was there before the cell imported it, and the rank's parent is the template.
        assert all(r["preloaded"] and r["template"] for r in results), results
        assert all(r["cwd"] == os.getcwd() for r in results)
        # The rank's own OMP_NUM_THREADS reached torch as a spawned rank's does (the template imported with it).
        assert all(r["threads"] == int(r["omp"]) for r in results)
    # One template serves both runs; each rank is a new process with its own random stream.
    assert len({r["parent"] for r in first + second}) == 1
    assert len({r["pid"] for r in first + second}) == 4
    assert len({r["draw"] for r in first + second}) == 4
    stages = list(record.timings["stages"])
    assert str(Stage.TEMPLATE) in stages and str(Stage.FORKING) in stages, stages
    assert str(Stage.TEMPLATE) not in again.timings["stages"] and str(Stage.FORKING) in again.timings["stages"]
    assert not [n for n in record.notes + again.notes if "spawned" in n], record.notes + again.notes


def test_template_off_spawns_every_rank_and_a_fork_starts_as_a_spawn_does(monkeypatch):
    forked = hvdmagic.run(where_am_i, np=-2)
    monkeypatch.setenv(rank_template.TEMPLATE_ENV, "0")
    spawned = hvdmagic.run(where_am_i, np=-2)
    assert not any(r["preloaded"] or r["template"] for r in spawned), spawned
    assert all(r["parent"] == os.getpid() for r in spawned)  # local mode: the supervisors are our threads
    assert str(Stage.FORKING) not in hvdmagic.last_run().timings["stages"]
    # What the interpreter sets at start, the fork sets alike: unbuffered output (the ranks' lines reach
    # the notebook as they are printed), sys.path with the working directory first, default signals.
    assert all(r["template"] for r in forked)
    for key in ("stdio", "path", "signals", "cwd", "omp", "threads"):
        assert [r[key] for r in forked] == [r[key] for r in spawned], key


def test_another_environment_gets_its_own_template(monkeypatch):
    monkeypatch.setenv("TEMPLATE_TEST_TAG", "a")
    a = hvdmagic.run(where_am_i, np=-2)
    monkeypatch.setenv("TEMPLATE_TEST_TAG", "b")
    b = hvdmagic.run(where_am_i, np=-2)
    assert {r["tag"] for r in a} == {"a"} and {r["tag"] for r in b} == {"b"}
    assert all(r["template"] for r in a + b)
    assert {r["parent"] for r in a}.isdisjoint({r["parent"] for r in b})


def test_a_rank_stopped_as_it_is_forked_ends(monkeypatch):
    """A supervisor stops its rank by signalling the process group the rank's pid names (an abort,
    a Stop: ``RankProcess.kill``). A pid the template told before the child's setsid named no group
    yet: the kill found none, took the rank for gone, and a rank forked as its run failed ran on past
    the cell (issue 58: the crash-frame tests on a loaded machine; here about one fork in two was told
    that early). So each of 20 ranks, killed the moment its pid is here, has ended when kill returns."""
    monkeypatch.setenv(rank_template.IDLE_ENV, "1")  # its template, no module imported, ends after the test
    env = dict(os.environ, TEMPLATE_TEST_TAG="stopped-as-forked")
    template = rank_template.HostTemplate(os.urandom(16), (), env)
    for fork in range(20):
        rank = RankProcess(0, lambda event: None, lambda frame: None)
        assert rank.start(env, Boot(0), lambda env, events_w: template.fork(env, events_w, lambda stage: None))
        rank.kill()  # as an abort that reached the supervisor while its rank was being forked
        code = rank.proc.poll()
        if code is None:  # missed: the process must not outlive the test
            os.kill(rank.proc.pid, signal.SIGKILL)
        rank.wait()
        assert code == -signal.SIGTERM, f"fork {fork}: rank {rank.proc.pid} still ran after kill() ({code})"


def _module(tmp_path: Path, monkeypatch, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(rank_template.IMPORTS_ENV, name)
    return path


def test_a_thread_started_in_the_template_forces_a_spawn(tmp_path, monkeypatch):
    _module(tmp_path, monkeypatch, "starts_a_thread", """
        import threading
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    """)
    results = hvdmagic.run(where_am_i, np=-2)
    assert not any(r["template"] for r in results), results
    notes = [n for n in hvdmagic.last_run().notes if "spawned, not forked" in n]
    assert len(notes) == 1 and "the template runs 1 thread(s) besides the libraries' own pools" in notes[0], notes
    assert notes[0].startswith("hvdmagic: ranks 0, 1 on "), notes  # one note, naming both


def test_a_template_that_exits_as_it_starts_is_said_to_have_exited_and_the_ranks_spawn(tmp_path, monkeypatch):
    """Not "did not start within 300 s": it ended at once, and its last words say why."""
    _module(tmp_path, monkeypatch, "ends_the_template", """
        import os, sys
        if "--template" in sys.argv:
            print("ends_the_template: giving up", file=sys.stderr, flush=True)
            os._exit(3)
    """)
    results = hvdmagic.run(where_am_i, np=-2)
    assert not any(r["template"] for r in results), results
    notes = [n for n in hvdmagic.last_run().notes if "spawned, not forked" in n]
    assert len(notes) == 1, notes
    assert "the host's template exited with code 3 before it started: ends_the_template: giving up" in notes[0], notes


def test_an_import_that_renames_the_process_leaves_the_template_named_as_one(tmp_path, monkeypatch):
    """torch 2.3's import names the main thread, and with it the process, pt_main_thread: the template
    names itself again after its imports, so that ps, top and the leftover checks tell it from a rank."""
    _module(tmp_path, monkeypatch, "renames_the_process", """
        import ctypes
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(b"pt_main_thread"), 0, 0, 0)  # PR_SET_NAME, as torch 2.3 does
    """)
    results = hvdmagic.run(where_am_i, np=-2)
    assert all(r["template"] for r in results), results
    assert Path(f"/proc/{results[0]['parent']}/comm").read_text().strip() == TEMPLATE_NAME
    assert rank_processes() == []


def test_a_module_changed_on_disk_forces_a_spawn_and_then_a_new_template(tmp_path, monkeypatch):
    path = _module(tmp_path, monkeypatch, "changes_on_disk", "VALUE = 1\n")
    before = hvdmagic.run(where_am_i, np=-2)
    assert all(r["template"] for r in before)
    path.write_text("VALUE = 2  # edited\n")
    changed = hvdmagic.run(where_am_i, np=-2)
    # No rank forks from the stale template. The first to ask is refused and spawned; under load, one
    # that asks as the stale template ends starts a new template and forks from it. The note names the
    # ranks that were spawned, and only them.
    old_template = before[0]["parent"]
    assert not any(r["template"] and r["parent"] == old_template for r in changed), changed
    spawned = [rank for rank, r in enumerate(changed) if not r["template"]]
    notes = [n for n in hvdmagic.last_run().notes if "spawned, not forked" in n]
    assert (len(notes) == 1) == bool(spawned), (spawned, notes)
    if spawned:
        assert notes[0].startswith(f"hvdmagic: {rank_ranges.label(spawned)} on "), (spawned, notes)
        assert "changes_on_disk.py changed on disk since the template imported it" in notes[0], notes
    assert _gone_within(old_template, DEADLINE), "the stale template did not end"
    after = hvdmagic.run(where_am_i, np=-2)
    assert all(r["template"] for r in after) and after[0]["parent"] != old_template


@pytest.mark.unit
def test_the_template_refuses_a_rank_whose_environment_differs():
    orders = rank_template_orders()
    template = _Template(orders)
    env = {**template.env, "HOROVOD_RANK": "3", "CUDA_VISIBLE_DEVICES": "1"}
    assert template.environment_differs(env) == ""  # the rank's own variables are set after the fork
    assert template.environment_differs({**env, "OMP_NUM_THREADS": "7", "USER_FLAG": "1"}) == (
        "the rank's environment differs from the template's (OMP_NUM_THREADS, USER_FLAG)")


def rank_template_orders():
    from hvdmagic.rank.template import Orders

    return Orders(socket="", log="", lock="", token="", modules=[], owner=os.getpid(), idle=1.0, idle_cap=3,
                  own_keys=list(rank_template.OWN_KEYS), own_prefixes=list(rank_template.OWN_PREFIXES))


def _Template(orders):
    from hvdmagic.rank.template import Template

    template = Template(orders)
    template.env = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1"}
    return template


def test_torch_distributed_initialised_in_a_process_means_no_fork():
    code = textwrap.dedent("""
        import os, torch.distributed as dist
        from hvdmagic.rank.template import initialised
        assert initialised() == "", initialised()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
        store = dist.TCPStore("127.0.0.1", 0, 1, True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        print(initialised())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "torch.distributed was initialised in the template", done.stderr


def _template_pid() -> int:
    results = hvdmagic.run(where_am_i, np=-2)
    return results[0]["parent"]


def test_the_template_ends_with_its_kernel(tmp_path):
    """Local mode: the kernel owns the template. A kernel killed with SIGKILL leaves no template behind."""
    script = textwrap.dedent("""
        import sys
        import hvdmagic
        sys.path.insert(0, %r)
        from test_template import where_am_i
        print(hvdmagic.run(where_am_i, np=-2)[0]["parent"], flush=True)
        sys.stdin.read()
    """) % str(Path(__file__).parent)
    kernel = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"})
    try:
        lines = iter(kernel.stdout.readline, "")
        template = int(next(line for line in lines if line.strip().isdigit()))
        assert _alive(template)
    finally:
        kernel.send_signal(signal.SIGKILL)
        kernel.wait()
    assert _gone_within(template, DEADLINE), "the template outlived its kernel"


def test_an_idle_template_ends_and_leaves_no_file(monkeypatch):
    """It ends, and removes its socket, its log and the lock file its start was serialised under
    (they piled up by the hundred: issue 46)."""
    monkeypatch.setenv(rank_template.IDLE_ENV, "1")
    monkeypatch.setenv("TEMPLATE_TEST_TAG", "idle")  # its own template, with the short idle timeout
    before = set(rank_template.directory().iterdir())
    template = _template_pid()
    stem = _file_stem(template)
    assert _gone_within(template, DEADLINE), "the idle template did not end"
    # Only its own files: another test process's templates may start in the host's directory meanwhile.
    left = {p for p in set(rank_template.directory().iterdir()) - before if p.name.startswith(stem)}
    assert not left, f"the ended template left {sorted(p.name for p in left)}"


def _file_stem(template: int) -> str:
    """The name every file of template ``template`` starts with: its log's, which it holds open."""
    import psutil

    directory = rank_template.directory()
    names = [Path(f.path).name for f in psutil.Process(template).open_files() if Path(f.path).parent == directory]
    assert names, f"template {template} holds no file in {directory}"
    return names[0].split("-", 1)[0].split(".", 1)[0]


def test_idle_templates_beyond_the_cap_end_oldest_first(monkeypatch):
    """Two environments, two templates; with a cap of one idle template, the older one ends (issue 46)."""
    monkeypatch.setenv(rank_template.IDLE_CAP_ENV, "1")
    monkeypatch.setenv("TEMPLATE_TEST_TAG", "capped-older")
    older = _template_pid()
    monkeypatch.setenv("TEMPLATE_TEST_TAG", "capped-newer")
    newer = _template_pid()
    assert older != newer
    assert _gone_within(older, DEADLINE), "the older idle template outlived the cap"
    assert _alive(newer), "the newest idle template ended too"


def test_a_request_without_the_kernels_token_forks_nothing(monkeypatch):
    monkeypatch.setenv("TEMPLATE_TEST_TAG", "token")
    pid = _template_pid()
    sockets = [p for p in rank_template.directory().glob("*.sock")]
    assert sockets
    for path in sockets:
        intruder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        intruder.settimeout(DEADLINE)
        try:
            intruder.connect(str(path))
        except OSError:
            continue  # another test's template that has just ended
        read_end, write_end = os.pipe()
        socket.send_fds(intruder, [b"F"], [read_end, write_end, write_end, write_end])
        intruder.sendall(b'{"token": "guess", "env": {}, "cwd": "/"}\n')
        assert intruder.recv(1024) == b""  # closed, with no pid and no refusal
        intruder.close()
        os.close(read_end)
        os.close(write_end)
    # The template still serves this kernel.
    assert _template_pid() == pid


@pytest.mark.unit
def test_the_frameworks_a_function_or_cell_imports_are_what_its_template_imports():
    """What the template imports ahead comes from the code, nothing run: a function's IMPORT_NAME
    instructions (its nested functions' and what it wraps too), or a cell's import statements."""
    import functools

    from hvdmagic.kernel.capture import parse_cell
    from hvdmagic.kernel.framework_check import modules_imported
    from hvdmagic.launch.shipment import framework_imports, pack

    def train():
        import json  # noqa: F401  (not a framework: imported by the rank as before)

        import horovod.torch as hvd  # noqa: F401

        def inner():
            import tensorflow  # noqa: F401

        return inner

    assert framework_imports(train) == ("horovod.torch", "tensorflow")
    assert framework_imports(functools.partial(train)) == ("horovod.torch", "tensorflow")
    assert pack((train, (), {})).imports == ("horovod.torch", "tensorflow")
    tree = parse_cell("import os, torch\nfrom horovod import torch as hvd\nfrom torch.utils.data import DataLoader\n"
                      "from tensorflow.keras import layers\n")
    assert modules_imported(tree) == ["os", "torch", "horovod", "horovod.torch", "torch.utils.data",
                                      "tensorflow.keras"]
    assert pack((train, (), {}), imports=modules_imported(tree)).imports == (
        "torch", "horovod.torch", "torch.utils.data", "tensorflow.keras")


@pytest.mark.unit
def test_the_file_watch_names_what_changed_and_says_when_it_cannot_know(tmp_path):
    from hvdmagic.rank.file_watch import FileWatch

    package = tmp_path / "package"
    package.mkdir()
    files = [package / "a.py", package / "b.py"]
    for path in files:
        path.write_text("x = 1\n")
    watch = FileWatch(str(path) for path in files)
    assert watch.changed() == set()
    files[0].write_text("x = 2\n")
    os.utime(files[1])
    (package / "unrelated.txt").write_text("")  # not one of the files: no news
    assert watch.changed() == {str(files[0]), str(files[1])}
    assert watch.changed() == set(), "each event once"
    replacement = package / "a.py.new"
    replacement.write_text("x = 3\n")
    os.replace(replacement, files[0])  # pip replaces a file so
    assert watch.changed() == {str(files[0])}
    shutil.rmtree(package)
    assert watch.changed() is None, "its directory gone: any file may have changed"
    watch.close()
