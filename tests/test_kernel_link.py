"""The resumable channel between a task and the kernel (task.kernel_link, channel.Peer): real TCP resets
on loopback, made with SO_LINGER 0 (the kernel sends RST, as a NAT gateway that forgot the connection
does). The faults of whole runs, in network namespaces with ss -K and iptables, are in test_network_faults.py."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time

import pytest
from helpers import wait_until

from hvdmagic import channel, metric_rows, protocol
from hvdmagic.protocol import Event
from hvdmagic.task import kernel_link
from hvdmagic.task.kernel_link import KernelLink

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(os.geteuid() != 0, reason="ss -K, which resets a connection, needs root")]


def _reset(link: channel.Link) -> None:
    """Reset ``link``'s connection with ``ss -K``, as the network would: this end's socket is destroyed
    (its reads fail with ECONNABORTED) and the other end gets a TCP RST."""
    (src, sport), (dst, dport) = link.sock.getsockname()[:2], link.sock.getpeername()[:2]
    killed = subprocess.run(["ss", "-K", "src", src, "sport", "=", f":{sport}", "dst", dst, "dport", "=",
                             f":{dport}"], capture_output=True, text=True, check=True)
    assert f":{sport}" in killed.stdout, f"ss -K found no such connection: {killed.stdout}"


def _events(server: channel.ChannelServer, count: int, deadline: float = 20.0, skip=(Event.CONTACT,)) -> list:
    got, seen = [], []
    end = time.monotonic() + deadline
    while len(got) < count:
        left = end - time.monotonic()
        assert left > 0, f"only {len(got)} of {count} events within {deadline:g} s; also saw {seen}"
        try:
            _, event = server.events.get(timeout=left)
        except Exception:
            continue
        (seen if event.get("type") in skip else got).append(event)
    return got


def _peer(server: channel.ChannelServer) -> channel.Peer:
    end = time.monotonic() + 5
    while not server._peers or next(iter(server._peers.values())).link is None:
        assert time.monotonic() < end, "the task never attached"
        time.sleep(0.01)
    return next(iter(server._peers.values()))


@pytest.fixture
def pair():
    secret = channel.new_secret()
    server = channel.ChannelServer("127.0.0.1", secret, grace=30)
    link = KernelLink(*server.address, secret, grace=30)
    link.open()
    yield server, link, secret
    link.close()
    server.close()


def test_a_reset_mid_stream_loses_nothing_and_repeats_nothing_in_either_direction(pair):
    server, link, _ = pair
    peer = _peer(server)
    sent = 3000
    for i in range(sent // 2):
        link.send({"type": Event.REPORT, "i": i})
    _reset(peer.link)  # the kernel's end of the connection: the task sees a reset
    peer.send({"type": Event.CELL, "id": 1})  # said while the task is away: waits in the kernel's log
    for i in range(sent // 2, sent):
        link.send({"type": Event.REPORT, "i": i})
    events = _events(server, sent)
    assert [e["i"] for e in events] == list(range(sent)), "every event once, in order"
    assert link.recv() == {"type": Event.CELL, "id": 1}
    assert link.outages == 1
    assert link.finish(timeout=10), "the kernel acknowledged everything"


def _connected_pair() -> tuple[socket.socket, socket.socket]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        near = socket.create_connection(listener.getsockname())
        far, _ = listener.accept()
    return near, far


def test_a_reset_that_the_writer_met_first_is_still_a_reset_to_the_reader():
    """A reset's error goes to whichever call meets it first; when the link's writer thread does, its reader
    then reads an empty stream, as after a FIN. It must still reconnect, not end the task (under load, the
    reset above once ended a task with "the kernel closed the connection")."""
    near, far = _connected_pair()
    with near:
        far.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")  # on, 0 s: close sends RST
        far.close()
        end = time.monotonic() + 5
        with pytest.raises(ConnectionResetError):  # the writer meets the reset
            while time.monotonic() < end:
                near.send(b"x")
        with pytest.raises(OSError) as read:
            channel._recv_exact(near, 4)
        assert not isinstance(read.value, channel.PeerClosed), read.value
    near, far = _connected_pair()
    with near:
        far.close()  # a FIN: final
        with pytest.raises(channel.PeerClosed):
            channel._recv_exact(near, 4)


def test_the_kernel_sees_the_outage_and_the_return(pair):
    server, _, _ = pair
    peer = _peer(server)
    _reset(peer.link)
    _, lost = server.events.get(timeout=10)
    assert lost["type"] == Event.CONTACT and lost["lost"] is True and abs(lost["since"] - time.time()) < 10
    _, back = server.events.get(timeout=10)
    assert back == protocol.contact(lost=False)


def test_a_task_back_before_the_kernel_found_its_connection_broken_is_an_outage_and_a_return_all_the_same(pair):
    """The task may meet a reset, reconnect and attach before the kernel's reader has run (with a core kept
    busy, the test above once got no event in 10 s): the kernel tells the same outage and return. Here a
    second connection attaches as the task, as its reconnection does, while the first still looks whole."""
    server, _, secret = pair
    peer = _peer(server)
    first = peer.link
    again = channel.connect(*server.address, secret)
    try:
        again.send(protocol.link_frame(attach=peer.name, received=0))
        assert again.recv()["type"] == Event.LINK
        lost, back = _events(server, 2, skip=())[:2]
        assert lost["type"] == Event.CONTACT and lost["lost"] is True and abs(lost["since"] - time.time()) < 10
        assert back == protocol.contact(lost=False)
        assert first.dropped and peer.link not in (None, first), "the connection it replaced is cut"
    finally:
        again.close()


def test_the_task_ends_at_once_when_the_kernel_closes():
    secret = channel.new_secret()
    server = channel.ChannelServer("127.0.0.1", secret)
    link = KernelLink(*server.address, secret, grace=60)
    link.open()
    started = time.monotonic()
    server.close()  # the job's end, or the kernel's process dying: a FIN, not the network
    with pytest.raises(channel.ChannelError, match="closed the connection"):
        link.recv()
    assert time.monotonic() - started < 5
    with pytest.raises(channel.ChannelError):
        link.send({"type": Event.OUTPUT})


def test_a_task_that_does_not_come_back_is_gone_after_the_grace():
    secret = channel.new_secret()
    server = channel.ChannelServer("127.0.0.1", secret, grace=1.0)
    try:
        link = KernelLink(*server.address, secret, grace=1.0)
        link.open()
        peer = _peer(server)
        link._closing.set()  # the task will not reconnect (its host is cut off)
        _reset(peer.link)
        started = time.monotonic()
        kinds = [event for _, event in (server.events.get(timeout=10) for _ in range(2))]
        assert [k["type"] for k in kinds] == [Event.CONTACT, Event.GONE]
        assert kinds[1]["why"] == "grace" and kinds[1]["grace"] == 1.0
        assert time.monotonic() - started < 1.0 + 3 * channel.ACK_EVERY
        with pytest.raises(channel.ChannelError):
            peer.send({"type": Event.ABORT})
    finally:
        server.close()


def test_a_task_past_its_grace_is_refused_and_ends(monkeypatch):
    secret = channel.new_secret()
    server = channel.ChannelServer("127.0.0.1", secret, grace=0.5)
    try:
        link = KernelLink(*server.address, secret, grace=30)
        link.open()
        peer = _peer(server)
        # The task's reconnection comes after the kernel gave its place up.
        real_attach = link._attach

        def late_attach(timeout, new=False):
            deadline = time.monotonic() + 10
            while server._peers:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            return real_attach(timeout, new)

        monkeypatch.setattr(link, "_attach", late_attach)
        _reset(peer.link)
        with pytest.raises(channel.ChannelError, match="refused"):
            link.recv()
    finally:
        server.close()


def test_nothing_listening_ends_the_task_within_seconds_not_the_grace():
    secret = channel.new_secret()
    server = channel.ChannelServer("127.0.0.1", secret)
    link = KernelLink(*server.address, secret, grace=120)
    link.open()
    peer = _peer(server)
    server._sock.shutdown(socket.SHUT_RDWR)  # the port closes (a dead kernel's would), then the connection resets
    server._sock.close()
    _reset(peer.link)
    started = time.monotonic()
    with pytest.raises(channel.ChannelError, match="nothing listens"):
        link.recv()
    assert time.monotonic() - started < kernel_link.REFUSED_FINAL + 5
    server.close()


def test_a_stranger_cannot_take_a_tasks_place(pair):
    server, link, secret = pair
    peer = _peer(server)
    # Without the secret: its attach fails authentication and is counted.
    stranger = channel.connect(*server.address, channel.new_secret())
    stranger.send(protocol.link_frame(attach=peer.name, received=0))
    with pytest.raises(channel.ChannelError):
        stranger.recv()
    assert server.rejected == 1
    # With the job's secret but a name the kernel does not know, and not new: refused.
    insider = channel.connect(*server.address, secret)
    insider.send(protocol.link_frame(attach="0" * 32, received=5))
    assert "refused" in insider.recv()
    link.send({"type": Event.OUTPUT, "n": 1})
    assert _events(server, 1) == [{"type": Event.OUTPUT, "n": 1}]
    assert peer.link is not None and link.outages == 0, "the task kept its connection"


def test_silence_is_a_broken_connection(monkeypatch):
    """A connection that carries nothing (a blackhole) is dropped after SILENT, and the task comes back."""
    monkeypatch.setattr(channel, "SILENT", 1.0)
    monkeypatch.setattr(channel, "BEAT", 0.3)
    secret = channel.new_secret()
    server = channel.ChannelServer("127.0.0.1", secret, grace=30)
    link = KernelLink(*server.address, secret, grace=30)
    try:
        link.open()
        peer = _peer(server)
        quiet = peer.link
        frozen = threading.Event()
        real = quiet.send_raw

        def swallow(payload):  # the kernel's frames to the task vanish, as in a one-way blackhole
            if not frozen.is_set():
                real(payload)

        monkeypatch.setattr(quiet, "send_raw", swallow)
        frozen.set()
        end = time.monotonic() + 10
        while link.outages == 0:
            assert time.monotonic() < end, "the silent connection was never dropped"
            time.sleep(0.05)
        link.send({"type": Event.OUTPUT, "n": 2})
        assert _events(server, 1) == [{"type": Event.OUTPUT, "n": 2}]
        assert peer.link is not quiet
    finally:
        link.close()
        server.close()


def test_a_full_buffer_drops_progress_first_and_never_a_metric_or_the_result(monkeypatch):
    monkeypatch.setattr(kernel_link, "BUFFER_LIMIT", 40_000)
    link = KernelLink("127.0.0.1", 9, b"x" * 32)  # never opened: everything stays in its buffer
    filler = "p" * 200
    for i in range(400):
        link.send({"type": Event.HEARTBEAT, "rank": 0})
        link.send({"type": Event.REPORT, "progress": {"bar": i, "x": filler}, "rank": 0})
        link.send({"type": Event.REPORT, "progress": {}, "metrics": {"step": i}, "rank": 0})
    link.send({"type": Event.RESULT, "data": "r" * 30_000, "rank": 0})
    kept = [json.loads(p) for p in link._pending]
    metrics = [e["metrics"]["step"] for e in kept if "metrics" in e]
    assert metrics == list(range(400)), "every metric, in order"
    assert kept[-1]["type"] == Event.RESULT
    assert not any(e["type"] == Event.HEARTBEAT for e in kept), "heartbeats go first"
    assert link._dropped["heartbeats"] == 400 and link._dropped["progress updates"] > 0
    link._note_dropped()
    note = json.loads(link._pending[-1])
    assert note["type"] == Event.NOTE and "400 heartbeats" in note["text"] and "no metric" in note["text"]
    assert protocol.note(note["text"]) == note


# A rank as far as its events go: it reports through rank.telemetry as a rank does, and says what
# each deliver() returned in a file; it waits for a control line on its stdin between the two.
def test_a_kernel_that_acknowledges_late_is_waited_for_while_the_connection_is_up():
    """An elastic commit's rows (``RankProcess`` answers a rank's sync with ``delivered(count, SYNC_WAIT)``)
    must reach a kernel on a loaded machine, whose acknowledgement comes late but comes: here its job
    loop reads nothing for 6 s (past the 5 s that the commit used to wait; a load average of 16 took
    longer), and the wait, with the connection up all along, ends True once it has them."""
    secret = channel.new_secret()
    server = channel.ChannelServer("127.0.0.1", secret, grace=30, maxsize=1)  # one event, then it reads no more
    link = KernelLink(*server.address, secret, grace=30)
    try:
        link.open()
        link.send(protocol.note("the one event the kernel's queue takes"))
        wait_until(server.events.full, 10, "the kernel's queue did not fill")
        link.send({"type": Event.OUTPUT, "n": 1})
        count = link.count()
        answer: list[bool] = []
        waiter = threading.Thread(target=lambda: answer.append(link.delivered(count, protocol.SYNC_WAIT)))
        started = time.monotonic()
        waiter.start()
        waiter.join(timeout=6)  # the kernel's 6 s behind: the scenario, not synchronisation
        assert not answer, f"delivered() answered {answer} before the kernel had the event"
        while waiter.is_alive() and time.monotonic() - started < 30:  # the kernel catches up
            with contextlib.suppress(queue.Empty):
                server.events.get(timeout=0.1)
        waiter.join(timeout=1)
        assert answer == [True], f"delivered() said {answer} after {time.monotonic() - started:.1f} s"
        assert link.outages == 0, "the connection broke: the test's premise is a slow kernel, not a lost one"
    finally:
        link.close()
        server.close()


def test_a_commit_does_not_wait_out_an_outage_for_the_kernels_acknowledgement(pair):
    """While the connection is down, ``delivered`` says False at once rather than after its wait (an
    elastic commit in every rank would otherwise stall for it); the events stay in the buffer."""
    server, link, _ = pair
    link._closing.set()  # the task will not reconnect (its host is cut off)
    _reset(_peer(server).link)
    wait_until(lambda: link.outages == 1, 10, "the task never saw its connection reset")
    link.send({"type": Event.OUTPUT, "n": 1})
    started = time.monotonic()
    assert link.delivered(link.count(), protocol.SYNC_WAIT) is False
    assert time.monotonic() - started < 2, f"delivered() waited {time.monotonic() - started:.1f} s of an outage"


_DELIVERING_RANK = """
import json, os, sys, time
from pathlib import Path
from hvdmagic import protocol
from hvdmagic.rank import telemetry

protocol.read_boot(sys.stdin.buffer)
telemetry.open_events()
said = Path(os.environ["DELIVER_TEST_SAID"])
for step in range(3):
    telemetry.log_metrics(step=step, loss=1.0 / (step + 1))
started = time.monotonic()
first = telemetry.deliver(wait=1.0)
said.write_text(json.dumps({"first": first, "waited": time.monotonic() - started}))
protocol.read_request(sys.stdin.buffer)  # the test's go
telemetry.log_metrics(step=3, loss=0.25)
said.write_text(json.dumps({"first": first, "second": telemetry.deliver(wait=30.0)}))
"""


def test_a_ranks_deliver_returns_once_the_kernel_has_its_rows_and_says_when_it_has_not(tmp_path):
    """``telemetry.deliver``, which an elastic commit calls before it commits: the supervisor answers the
    rank's sync only once the kernel's end of the channel has acknowledged every event the rank sent
    before it. A kernel whose job loop has fallen behind (its event queue full, so its channel reads
    no further) has not: deliver says so within its wait, and the rank goes on; once the kernel takes
    its events, the next deliver is True (the first's late answer told apart), and the rows are there."""
    from hvdmagic.protocol import Boot
    from hvdmagic.task.rank_process import RankProcess

    secret = channel.new_secret()
    server = channel.ChannelServer("127.0.0.1", secret, grace=30, maxsize=1)  # one event, then it reads no more
    link = KernelLink(*server.address, secret, grace=30)
    link.open()
    said = tmp_path / "said.json"
    rank = RankProcess(0, link.send, link.send_raw, link)

    def start(env, events_w):
        return subprocess.Popen([sys.executable, "-c", _DELIVERING_RANK], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(events_w,),
                                env={**env, "DELIVER_TEST_SAID": str(said)}, start_new_session=True)

    taken: list[dict] = []

    def take() -> None:  # the kernel's job loop, caught up
        while rank.proc.poll() is None or not server.events.empty():
            with contextlib.suppress(queue.Empty):
                taken.append(server.events.get(timeout=0.1)[1])

    try:
        link.send(protocol.note("the one event the kernel's queue takes"))
        wait_until(server.events.full, 10, "the kernel's queue did not fill")
        assert rank.start(dict(os.environ), Boot(0), start)
        first = wait_until(lambda: said.exists() and json.loads(said.read_text() or "{}"), 30,
                           "the rank's first deliver() did not return within 30 s")
        assert first["first"] is False, "deliver() said the kernel had rows its full queue never took"
        assert 1.0 <= first["waited"] < 5, f"deliver() waited {first['waited']:.1f} s, not its 1 s"
        taker = threading.Thread(target=take, daemon=True)
        taker.start()
        rank.control({"go": True})
        assert rank.wait() == 0, said.read_text()
        taker.join(timeout=30)
        assert json.loads(said.read_text())["second"] is True, said.read_text()
        steps = [step for event in taken if event.get("type") == Event.REPORT and "metrics" in event
                 for step in metric_rows.decode(event["metrics"])[0]]
        assert steps == [0, 1, 2, 3], steps
    finally:
        if rank.proc is not None and rank.proc.poll() is None:
            rank.kill()
        link.close()
        server.close()
