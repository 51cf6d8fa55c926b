"""Hostile input at the event channel: nothing unauthenticated is accepted or unpickled."""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import struct
import tempfile
import threading
from pathlib import Path

import pytest
from helpers import WaitTimeout, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvdmagic import channel
from hvdmagic.launch import Placement, launch, shipment

SENTINEL = Path(tempfile.gettempdir()) / f"hvdmagic-fuzz-executed-{os.getpid()}"  # this worker's own


class _Bomb:
    """Unpickling this creates SENTINEL: proof that something was unpickled."""

    def __reduce__(self):
        return (Path.touch, (SENTINEL,))


def _frame(payload: bytes, mac: bytes = b"\0" * 32, length: int | None = None) -> bytes:
    return struct.pack(">I", len(payload) if length is None else length) + mac + payload


def _signed_elsewhere(secret: bytes, event: dict) -> bytes:
    """A genuine frame, signed for another connection (another nonce): a replay."""
    mine, theirs = socket.socketpair()
    with mine, theirs:
        channel.Link(mine, secret, b"x" * channel.NONCE_SIZE, is_server=False).send(event)
        theirs.settimeout(5)
        return theirs.recv(1 << 16)


hostile = st.one_of(
    st.binary(max_size=300),  # noise
    st.binary(max_size=200).map(_frame),  # well-formed, wrong MAC
    st.binary(min_size=1, max_size=200).map(lambda p: _frame(p)[: 4 + len(p) // 2]),  # truncated
    st.integers(channel.MAX_FRAME + 1, 2**32 - 1).map(lambda n: _frame(b"{}", length=n)),  # oversized
    st.just(_frame(pickle.dumps(_Bomb()))),  # a pickle, unsigned
    st.just(_frame(b'{"type":"result","rank":0,"data":"' + b"A" * 20 + b'"}')),  # plausible JSON, unsigned
)


def _attack(address, frames: list[bytes]) -> None:
    try:
        with socket.create_connection(address, timeout=5) as sock:
            sock.recv(channel.NONCE_SIZE)
            for frame in frames:
                sock.sendall(frame)
    except OSError:
        pass  # the server hung up on us, as it should


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(hostile, min_size=1, max_size=4), st.booleans())
def test_hostile_frames_never_reach_the_driver(frames, include_replay):
    SENTINEL.unlink(missing_ok=True)
    secret = channel.new_secret()
    server = channel.ChannelServer("127.0.0.1", secret)
    try:
        if include_replay:
            frames = frames + [_signed_elsewhere(secret, {"type": "exit", "rank": 0, "code": 0})]
        _attack(server.address, frames)
        genuine = channel.connect(*server.address, secret)
        genuine.send({"type": "hello", "ok": True})
        _, event = server.events.get(timeout=5)
        assert event == {"type": "hello", "ok": True}, "a hostile frame got into the event queue"
        assert server.events.empty()
        genuine.close()
    finally:
        server.close()
    assert not SENTINEL.exists(), "a hostile payload was unpickled"


def test_a_job_under_attack_still_completes_correctly(monkeypatch):
    SENTINEL.unlink(missing_ok=True)
    servers = []
    original_init = channel.ChannelServer.__init__

    def keep_server(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        servers.append(self)

    monkeypatch.setattr(channel.ChannelServer, "__init__", keep_server)
    attacked = []

    def on_event(event):
        # Once the ranks are placed, hold the job loop until the server has turned every attack away:
        # the hostile frames arrive while the job runs, not after it.
        if event.get("type") != "placed" or event.get("rank") != 0:
            return
        (server,) = servers
        address = tuple(event.get("channel") or server.address)
        replay = _signed_elsewhere(channel.new_secret(), {"type": "result", "rank": 0, "data": ""})
        bursts = [[_frame(pickle.dumps(_Bomb()))], [b"\xff" * 64], [replay],
                  [_frame(b"{}", length=2**31)], [_frame(b'{"type":"abort"}')]] * 4
        attackers = [threading.Thread(target=_attack, args=(address, frames)) for frames in bursts]
        for thread in attackers:
            thread.start()
        for thread in attackers:
            thread.join(10)
        with contextlib.suppress(WaitTimeout):  # the test's assert says how many it turned away
            wait_until(lambda: server.rejected >= len(bursts), 10, "not every attack was turned away")
        attacked.append(server.rejected)

    def allreduce():
        import horovod.torch as hvd
        import torch
        hvd.init()
        return hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()

    result = launch(shipment.pack((allreduce, (), {})), Placement.of(-2), on_event=on_event, timeout=120)
    assert attacked == [20], f"the server rejected {attacked} hostile connections during the job, not all 20"
    assert result.results == [3.0, 3.0]
    assert not SENTINEL.exists(), "a hostile payload was unpickled"


@pytest.mark.unit
def test_a_relayed_rank_event_cannot_claim_another_rank():
    """The supervisor forwards event lines as text and appends its own rank number."""
    import io

    from hvdmagic.task.rank_process import RankProcess

    secret = channel.new_secret()
    ours, theirs = socket.socketpair()
    with ours, theirs:
        nonce = b"n" * channel.NONCE_SIZE
        sender = channel.Link(ours, secret, nonce, is_server=False)
        receiver = channel.Link(theirs, secret, nonce, is_server=True)
        rank = RankProcess(1, sender.send, sender.send_raw)  # rank 1's: its events are tagged with 1
        lines = b'{"type":"report","rank":0,"progress":{}}\n' b"not json\n" b"{}\n" b'{"type":"heartbeat"}\n'
        rank._relay_events(io.BytesIO(lines))
        assert receiver.recv() == {"type": "report", "rank": 1, "progress": {}}
        assert receiver.recv() == {"type": "heartbeat", "rank": 1}


@pytest.mark.unit
def test_a_peer_that_accepts_and_never_speaks_times_out_the_connect():
    """A frozen host (SIGSTOP) still has its connections accepted by the OS, but never sends its nonce:
    a reader redirected to it must give up within the connect's timeout, not wait for ever."""
    import time

    with socket.create_server(("127.0.0.1", 0), backlog=4) as silent:  # listens, never accepts or sends
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            channel.connect(*silent.getsockname(), b"k" * 32, timeout=0.5)
        assert time.monotonic() - started < 5
