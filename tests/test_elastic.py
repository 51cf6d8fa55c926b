"""Elastic training (--min-np/--max-np): real Horovod elastic ranks, real faults.

A rank SIGKILLs itself at a set step (a real SIGKILL, on cue), or the test kills a
whole worker of a standalone cluster; training must go on from the last commit,
with nothing trained twice past it, and the record must tell the story.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import socket
import sys
import threading
import traceback
import urllib.error
import urllib.request

import pytest
from conftest import run
from elastic_training import train
from helpers import WaitTimeout, spark_cluster, wait_until
from procs import rank_processes, registered_rank, wait_until_gone

import hvdmagic
from hvdmagic.errors import JobFailed, LaunchError

COMMIT_EVERY = 5


def _check_training(results: list[dict], size: int) -> list[tuple[int, int]]:
    """Every rank ended on the same model and trace; every step was trained exactly once."""
    assert len(results) == size, results
    trace = results[0]["trace"]
    assert [step for step, _ in trace] == list(range(1, len(trace) + 1)), "a step trained twice, or skipped"
    assert results[0]["samples"] == sum(8 * world for _, world in trace), "rolled-back steps still counted"
    for result in results:
        assert result["trace"] == trace and result["weights"] == results[0]["weights"], "the ranks diverged"
        assert result["size"] == size
    assert sorted(r["rank"] for r in results) == list(range(size))
    return trace


def _check_metrics(run_record, last_step: int) -> None:
    """Rank 0's metrics cover every step: whoever was rank 0 logged them, across the resets."""
    metrics = run_record.metrics
    steps = set(metrics[metrics["rank"] == 0]["step"].astype(int))
    assert steps == set(range(1, last_step + 1)), sorted(set(range(1, last_step + 1)) - steps)


def test_sigkilled_rank_resumes_from_the_commit_and_its_slot_comes_back(tmp_path):
    """Local Spark, 3 tasks: task 1's rank is SIGKILLed at step 12; the other two restore
    the commit at step 10 and go on; ~10-15 s later (Horovod's cooldown) the task gets a
    rank again, which joins at the next commit."""
    marker = str(tmp_path / "killed")
    results = hvdmagic.run(train, 3, 20, kill=(1, 12), marker=marker, until_size=3, commit_every=COMMIT_EVERY,
                           min_np=2, max_np=3)
    assert os.path.exists(marker)
    trace = _check_training(results, 3)
    assert trace[9] == (10, 3) and trace[10] == (11, 2), trace[:12]  # steps 11 and 12 were trained again, on 2
    run_record = hvdmagic.last_run()
    first, last = run_record.resets[0], run_record.resets[-1]
    assert "task 1" in first.reason and "SIGKILL" in first.reason, first
    assert (first.size_before, first.size_after, first.commit["step"]) == (3, 2, 10), first
    assert (last.reason, last.size_before, last.size_after) == ("slots added", 2, 3), run_record.resets
    assert last.commit["step"] % COMMIT_EVERY == 0
    assert run_record.world_size == 3 and run_record.state == "finished"
    assert [rank.state for rank in run_record.ranks] == ["finished"] * 3
    assert any(note.startswith("resumed on 2 ranks (from 3) from the commit at step 10") for note in run_record.notes)
    _check_metrics(run_record, len(trace))
    wait_until_gone([p.pid for p in rank_processes()], within=10)


def test_magic_goes_on_with_fewer_ranks_and_says_so(ip, tmp_path, capfd):
    """Local Spark: the cell finishes on one rank after the other's SIGKILL; the text view
    says which rank was lost and where training resumed; --out gets the new rank 0's value."""
    ip.user_ns.update(train=train, marker=str(tmp_path / "killed"))
    result, error = run(ip, """%%horovod --np 2 --min-np 1 --max-np 2 --out outcome
train(15, kill=(1, 7), marker=marker)
""")
    assert error is None, error
    assert ip.user_ns["outcome"] is result and result["size"] == 1 and result["rank"] == 0
    assert result["trace"][:6] == [(step, 2) for step in range(1, 6)] + [(6, 1)], result["trace"]
    out = capfd.readouterr().out
    assert "hvdmagic: task 1's rank was lost (killed by SIGKILL); the others go on" in out, out
    assert ("hvdmagic: resumed on 1 rank (from 2) from the commit at step 5, samples 80: task 1's rank lost "
            "(killed by SIGKILL)\n") in out, out
    run_record = hvdmagic.last_run()
    assert run_record.ranks[1].state == "lost" and run_record.ranks[1].lost == "killed by SIGKILL"
    assert "task 1: [lost: killed by SIGKILL]" in out
    assert repr(run_record).startswith("<RunRecord finished elastic 1 of 2 tasks (spark)")


def _new_threads_in_horovod(before: set[threading.Thread]) -> list[str]:
    """Threads not in ``before`` whose stacks run Horovod's code now, each as its name and innermost
    Horovod frame. Counting every thread would count the embedded Spark's, which a first cell starts."""
    stacks = sys._current_frames()
    found = []
    for thread in threading.enumerate():
        if thread in before or thread.ident not in stacks:
            continue
        frames = [frame for frame in traceback.extract_stack(stacks[thread.ident]) if "/horovod/" in frame.filename]
        if frames:
            found.append(f"{thread.name} at {frames[-1].filename}:{frames[-1].lineno}")
    return found


def test_reset_limit_fails_the_cell_naming_the_loss(ip, tmp_path):
    ip.user_ns.update(train=train, marker=str(tmp_path / "killed"), outcome="untouched")
    before = set(threading.enumerate())
    _, error = run(ip, """%%horovod --np 2 --min-np 1 --reset-limit 0 --out outcome
train(40, kill=(1, 3), marker=marker)
""")
    # Horovod's driver stops the run from inside its registry's barrier, where a rank's
    # rendezvous request may wait: nothing may stay blocked there (it once deadlocked).
    wait_until(lambda: not _new_threads_in_horovod(before), 10, lambda: str(_new_threads_in_horovod(before)))
    assert isinstance(error, JobFailed), error
    text = str(error)
    assert "number of resets during elastic job exceeded limit: 0" in text and "--reset-limit 0" in text, text
    assert "task 1's rank" in text and "killed by SIGKILL" in text, text
    assert ip.user_ns["outcome"] == "untouched"
    assert hvdmagic.last_run().resets == [], "the limit must fail the cell at the first reset, before any resumes"
    wait_until_gone([p.pid for p in rank_processes()], within=10)


def test_below_min_np_fails_after_the_elastic_timeout(ip, tmp_path):
    """Two ranks, --min-np 2: after the loss Horovod waits --elastic-timeout for a second slot
    (the lost task's comes back only after its 10-15 s cooldown), then the cell fails."""
    ip.user_ns.update(train=train, marker=str(tmp_path / "killed"))
    _, error = run(ip, """%%horovod --np 2 --min-np 2 --elastic-timeout 3
train(40, kill=(1, 3), marker=marker)
""")
    assert isinstance(error, JobFailed), error
    text = str(error)
    assert "fewer than --min-np 2 ranks were left, and no slot came back within --elastic-timeout 3 s" in text, text
    assert "task 1's rank" in text and "killed by SIGKILL" in text, text
    assert hvdmagic.last_run().resets == [], "the run resumed instead of failing after the elastic timeout"
    wait_until_gone([p.pid for p in rank_processes()], within=10)


def test_the_first_tasks_take_as_long_as_they_take_whatever_the_elastic_timeout(ip):
    """--elastic-timeout is how long to wait for slots after a loss. The run's first tasks are being
    started when Horovod's driver begins to wait, and take the time they take (a new process each
    here, longer than 0.1 s): the run starts on both, as a fixed-size run would."""
    result, error = run(ip, """%%horovod --np -2 --elastic-timeout 0.1
import horovod.torch as hvd
hvd.init()
state = hvd.elastic.TorchState(step=0)

@hvd.elastic.run
def loop(state):
    return hvd.size()

loop(state)
""")
    assert error is None, error
    assert result == 2, result
    assert hvdmagic.last_run().resets == []


def test_an_exception_in_the_cell_fails_an_elastic_run_with_its_traceback(ip):
    _, error = run(ip, """%%horovod --np -2 --min-np 1
import horovod.torch as hvd
hvd.init()
state = hvd.elastic.TorchState(step=0)

@hvd.elastic.run
def loop(state):
    if hvd.rank() == 1:
        raise ValueError("bad shard on rank 1")
    return 1

loop(state)
""")
    assert isinstance(error, JobFailed), error
    assert "ValueError: bad shard on rank 1" in str(error)
    assert "only lost processes and executors are trained around" in str(error)
    assert any("bad shard" in f.traceback for f in error.failures)
    wait_until_gone([p.pid for p in rank_processes()], within=10)


def _driver_probing_task_1(monkeypatch, before_probe) -> list[str]:
    """Make the job's elastic driver call ``before_probe(addresses)`` before it registers (and so
    probes) task 1's notification service, at the addresses it returns; return the probes' outcomes."""
    from horovod.runner.common.util.network import NoValidAddressesFound

    from hvdmagic.launch import elastic

    outcomes: list[str] = []
    make_driver_class = elastic._driver_class

    def driver_class():
        class Driver(make_driver_class()):
            def register_worker_server(self, host, slot, addresses, secret_key):
                if not host.startswith("t1."):
                    return super().register_worker_server(host, slot, addresses, secret_key)
                try:
                    super().register_worker_server(host, slot, before_probe(addresses), secret_key)
                except NoValidAddressesFound:
                    outcomes.append("unreachable")
                    raise
                outcomes.append("reached")

        return Driver

    monkeypatch.setattr(elastic, "_driver_class", driver_class)
    return outcomes


def _nothing_listens(addresses: dict) -> bool:
    for listed in addresses.values():
        for address in listed:
            try:
                socket.create_connection(tuple(address), timeout=1).close()
            except OSError:
                continue
            return False
    return True


def test_a_rank_gone_before_the_driver_probed_it_fails_the_run_with_its_own_error(ip, monkeypatch):
    """The race seen once in a loaded CI run: task 1's cell raises at once, and its process is gone
    before the driver reads its registration and probes its notification service, so Horovod
    raises NoValidAddressesFound. That is fallout: the cell fails with task 1's exception. Here the
    driver reads the registration only once nothing listens at its addresses."""
    probes = _driver_probing_task_1(monkeypatch, lambda addresses: wait_until(
        lambda: _nothing_listens(addresses) and addresses, 60, "task 1's notification service outlived its cell"))
    _, error = run(ip, """%%horovod --np -2 --min-np 1
import os
import horovod.torch as hvd
hvd.init()
state = hvd.elastic.TorchState(step=0)

@hvd.elastic.run
def loop(state):
    if os.environ["HOROVOD_HOSTNAME"].startswith("t1."):
        raise ValueError("bad shard on task 1")
    return 1

loop(state)
""")
    wait_until(lambda: probes, 60, "the driver never probed task 1")  # on a thread of its own
    assert probes == ["unreachable"], probes
    assert isinstance(error, JobFailed), error
    assert "ValueError: bad shard on task 1" in str(error) and "NoValidAddressesFound" not in str(error), error
    assert any("bad shard" in f.traceback for f in error.failures)
    wait_until_gone([p.pid for p in rank_processes()], within=10)


def test_a_running_rank_the_driver_cannot_reach_fails_the_run_naming_the_network(monkeypatch):
    """No rank raised, and task 1's rank trains on, but the driver cannot reach its notification
    service (here: it probes a port that refuses): a network problem, never hidden as a race."""
    from hvdmagic.launch import elastic

    with socket.socket() as refusing:
        refusing.bind(("127.0.0.1", 0))  # bound, never listening: a connection is refused
        port = refusing.getsockname()[1]
        probes = _driver_probing_task_1(monkeypatch, lambda _: {"lo": [("127.0.0.1", port)]})
        monkeypatch.setattr(elastic, "ENDED_RANK_NEWS_WAIT", 0.0)  # the rank trains for 20 s or more
        with pytest.raises(JobFailed) as failed:
            hvdmagic.run(train, -2, 1000, min_np=1)
    assert probes == ["unreachable"], probes
    text = str(failed.value)
    assert "cannot reach the notification service of task 1's rank, which still runs" in text, text
    assert f"unable to connect to worker notification service on any of the following addresses: " \
           f"{{'lo': [('127.0.0.1', {port})]}}" in text, text
    wait_until_gone([p.pid for p in rank_processes()], within=10)


def test_a_slow_probe_of_a_rank_holds_back_no_event(monkeypatch):
    """Registering a rank probes its notification service, which takes up to 3 × 20 s where packets
    are dropped (here: the probe is held until the run has returned). The probe runs on a thread of its
    own: the job reads every rank's output and results meanwhile, and the run ends before the probe
    (issue 46)."""
    released = threading.Event()
    probes = _driver_probing_task_1(monkeypatch, lambda addresses: (released.wait(300), addresses)[1])
    try:
        results = hvdmagic.run(train, -2, 10, min_np=1)
        assert len(results) == 2, results
        assert probes == [], "the run waited for the probe"
    finally:
        released.set()


# Bad elastic arguments (--min-np, --max-np, ...): test_magic_local.py::test_bad_arguments_are_usage_errors.


@pytest.mark.unit
def test_elastic_data_is_refused(ip):
    message = ("--data deals a fixed number of shards, one per rank, so it cannot be combined with elastic "
               "training; read the data in the cell (e.g. with hvd.elastic.ElasticSampler).")
    with pytest.raises(LaunchError, match=f"^{re.escape(message)}$"):
        hvdmagic.run(print, 2, data=object(), min_np=1)


@pytest.mark.unit
def test_the_rendezvous_refuses_a_pickle_from_the_network():
    """Horovod's elastic handler unpickles a worker's PUT of its notification address;
    ours refuses that PUT (ranks send it over the HMAC channel), and serves the rest."""
    from horovod.runner.elastic.discovery import FixedHosts
    from horovod.runner.elastic.driver import ElasticDriver

    from hvdmagic.launch.elastic import _guarded_handler
    from hvdmagic.launch.rendezvous import Rendezvous

    rendezvous = Rendezvous("127.0.0.1", start=False)
    driver = ElasticDriver(rendezvous, FixedHosts({"t0.0": 1}), 1, 1, timeout=5)
    try:
        port = rendezvous.start(_guarded_handler(driver))

        class Boom:
            def __reduce__(self):
                return (os.kill, (os.getpid(), signal.SIGKILL))

        import base64

        body = base64.b64encode(pickle.dumps(((Boom(), {}), b"key")))
        request = urllib.request.Request(f"http://127.0.0.1:{port}/worker_addresses/t0.0:0", data=body,
                                         method="PUT")
        with pytest.raises(urllib.error.HTTPError, match="403"):
            urllib.request.urlopen(request, timeout=5)
        assert driver._worker_clients == {}
        plain = urllib.request.Request(f"http://127.0.0.1:{port}/scope/key", data=b"value", method="PUT")
        assert urllib.request.urlopen(plain, timeout=5).status == 200
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/scope/key", timeout=5).read() == b"value"
    finally:
        driver.stop()


# The last of three workers, started only once the world has shrunk (_kill_the_worker_of); its index
# is also how many start at first.
SPARE_WORKER = 2


@pytest.fixture
def three_workers(tmp_path_factory):
    """A standalone cluster of three one-core workers, the third not started yet (the spare:
    ``_kill_the_worker_of`` starts it), and a session with an executor on each worker."""
    with spark_cluster(tmp_path_factory.mktemp("elastic-cluster"), workers=3, start=SPARE_WORKER, cores=1,
                       app="hvdmagic-elastic-test", conf={"spark.task.maxFailures": "4"}) as (cluster, session):
        yield cluster, session


def _kill_the_worker_of(cluster, host_prefix: str, ready: str, killed: list, within: float = 180) -> None:
    """When ``ready`` exists, SIGKILL the Worker JVM (and with it its executor) that runs the
    rank whose Horovod host starts with ``host_prefix``; once the others train alone
    (``train``'s ``<ready>.shrunk``), start the cluster's spare worker, where Spark runs the
    lost task again.

    Not before: with the spare up from the start, a loaded machine once had the new attempt's
    rank registered before the survivors' reset, which then went from 2 ranks straight to 2; the
    world never shrank, and the run trained on until its step limit (issue 58). Each worker has
    one core, so until the spare starts the lost task has nowhere to run."""
    import psutil

    try:
        wait_until(lambda: os.path.exists(ready), within, "training never reached the ready step")
    except WaitTimeout as timeout:
        killed.append(str(timeout))  # this thread's failure, for the test to report
        return
    workers = {proc.pid: i for i, proc in enumerate(cluster.procs)}
    if (found := registered_rank(ready, host_prefix)) is not None:
        try:
            owner = next(workers[p.pid] for p in found[1].parents() if p.pid in workers)
        except (psutil.NoSuchProcess, StopIteration):
            owner = None
        if owner is not None:
            os.killpg(cluster.procs[owner].pid, signal.SIGKILL)
            killed.append(owner)
            try:
                wait_until(lambda: os.path.exists(f"{ready}.shrunk"), within,
                           "the others never trained alone after the worker was killed")
            except WaitTimeout as timeout:
                killed.append(str(timeout))
                return
            cluster.start_worker(SPARE_WORKER)
            return
    killed.append(f"no rank process with a Horovod host {host_prefix}*")


@pytest.mark.cluster
@pytest.mark.timeout(600)  # a spare worker starts mid-run: beside a second make test, 264 s, and once over 300
def test_a_lost_worker_does_not_lose_the_run(three_workers, tmp_path):
    """Two ranks on two one-core workers; the worker under task 1 is killed (its Worker JVM and
    executor). The other rank resumes alone from the commit; then a third worker starts
    (``_kill_the_worker_of``), Spark runs task 1 again there, its rank joins at a commit, and the
    run ends on two ranks."""
    cluster, _ = three_workers
    ready, killed = str(tmp_path / "ready"), []
    killer = threading.Thread(target=_kill_the_worker_of, args=(cluster, "t1.", ready, killed), daemon=True)
    killer.start()
    results = hvdmagic.run(train, 2, 30, marker=ready, ready_at=15, until_size=2, step_time=0.05,
                           max_steps=4000, commit_every=COMMIT_EVERY, min_np=1, max_np=2)
    killer.join(timeout=5)
    assert len(killed) == 1 and isinstance(killed[0], int), killed
    trace = _check_training(results, 2)
    run_record = hvdmagic.last_run()
    first, last = run_record.resets[0], run_record.resets[-1]
    assert "task 1's rank lost (its Spark task or executor was lost)" in first.reason, run_record.resets
    assert (first.size_before, first.size_after) == (2, 1) and first.commit["step"] >= 15, first
    assert (last.reason, last.size_before, last.size_after) == ("slots added", 1, 2), run_record.resets
    assert 1 in {size for _, size in trace} and trace[-1][1] == 2
    assert run_record.ranks[1].state == "finished" and run_record.world_size == 2
    _check_metrics(run_record, len(trace))
    assert cluster.procs[killed[0]].wait(timeout=10) == -signal.SIGKILL
    wait_until_gone([p.pid for p in rank_processes()], within=15)


def test_a_ranks_notification_service_listens_on_its_gloo_interface_only():
    """Inside a rank, Horovod's worker notification service binds to the rank's Gloo
    interface (here loopback), not to every interface."""
    import subprocess

    probe = """
import os
from hvdmagic.rank import elastic
elastic.install()
from horovod.runner.elastic.worker import WorkerNotificationService
service = WorkerNotificationService(b"k" * 32, "lo", None)
print(service._server.socket.getsockname()[0], service.addresses())
"""
    out = subprocess.run([sys.executable, "-c", probe], env=dict(os.environ, HOROVOD_GLOO_IFACE="lo"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    bound, addresses = out.stdout.split(" ", 1)
    assert bound == "127.0.0.1" and "'lo': [('127.0.0.1'," in addresses, out.stdout


def test_stop_mid_training_stops_every_rank_and_the_next_elastic_cell_runs(ip, tmp_path):
    """Stop (SIGINT to the kernel's process) once both ranks train: one line, no rank left,
    no Spark job left; then another elastic cell runs on the same Spark."""
    from pyspark import SparkContext

    ready = tmp_path / "ready"
    ip.user_ns.update(train=train, marker=str(ready))

    def stop_when_training() -> None:
        with contextlib.suppress(WaitTimeout):  # then the test fails on "training never started"
            wait_until(ready.exists, 120, "training never started")
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=stop_when_training, daemon=True).start()
    _, error = run(ip, "%%horovod --np 2 --min-np 1\ntrain(100000, marker=marker, ready_at=3)")
    assert ready.exists(), "training never started"
    assert type(error).__name__ == "JobInterrupted" and "\n" not in str(error), error
    assert str(error).startswith("interrupted while the ranks ran: every rank was stopped"), error
    wait_until_gone([p.pid for p in rank_processes()], within=10)
    tracker = SparkContext._active_spark_context.statusTracker()
    wait_until(lambda: not tracker.getActiveJobsIds(), 15, "the elastic stage was not cancelled")
    result, error = run(ip, "%%horovod --np 2 --min-np 1\ntrain(6)")
    assert error is None and len(result["trace"]) == 6, error
