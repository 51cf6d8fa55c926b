"""A large value on many hosts: the kernel sends it about once, the hosts pass it on.

The relay order and the checks run on loopback (unit tier); a host that dies or freezes
mid-transfer, and the byte count of a real cell on four hosts, run on simulated hosts
(network namespaces with capped links, tests/netns.py). The times at 2 to 16 hosts are
benchmarks/bench_fanout.py's.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import netns
import numpy as np
import pytest
from conftest import run
from helpers import spark_cluster, wait_until

from hvdmagic import blob_transfer, channel
from hvdmagic.launch import shipment
from hvdmagic.protocol import Blob
from hvdmagic.task.blob_cache import BlobCache
from hvdmagic.task.blob_relay import BlobRelay

MiB = 1 << 20
HOST_SCRIPT = Path(__file__).with_name("fanout_host.py")


def _blob(size: int, seed: int = 1) -> tuple[bytes, Blob]:
    data = np.random.default_rng(seed).bytes(size)
    return data, Blob(shipment.digest(memoryview(data)), len(data), "X (bytes)")


@contextlib.contextmanager
def _kernel(host: str, data: bytes, blob: Blob, secret: bytes):
    server = blob_transfer.BlobServer(host, secret, relays=True)
    server.publish({blob.digest: memoryview(data)})
    try:
        yield server
    finally:
        server.close()


# -- the relay order -------------------------------------------------------------------------------
@pytest.mark.unit
def test_each_host_reads_from_the_one_that_asked_before_it():
    order = blob_transfer.RelayOrder()
    a, b, c, d = ("10.0.0.2", 1), ("10.0.0.3", 1), ("10.0.0.4", 1), ("10.0.0.5", 1)
    assert order.source("x", a, []) is None  # the first host reads from the kernel
    assert order.source("x", b, []) == a
    assert order.source("x", c, []) == b
    assert order.source("y", c, []) is None, "another blob has an order of its own"
    # c's source b broke: c reads from the host before b; a later host skips b too.
    assert order.source("x", c, [b]) == a
    assert order.source("x", d, []) == c
    # b asks again (it is alive): it keeps its place, and is a source again for later hosts.
    assert order.source("x", b, []) == a
    assert order.source("x", d, [c]) == b
    # Never a host that asked after: a's only source is the kernel, whoever fails.
    assert order.source("x", a, [b, c, d]) is None


def _run_at(order: blob_transfer.RelayOrder, rates: dict, since: float, until: float, size: int,
            got: dict) -> list:
    """Each host in ``rates`` receiving at its rate (bytes a second) from ``since`` to ``until``, on
    from the bytes in ``got``, noted ten times a second; the moves the order asked for on the way."""
    moves = []
    for tick in range(1, round((until - since) * 10) + 1):
        now = since + tick / 10
        for host, rate in rates.items():
            got[host] = min(size, got.get(host, 0) + int(rate / 10))
            order.note("x", host, got[host], now)
        moves += order.moves("x", size, now)
    return moves


@pytest.mark.unit
def test_a_slow_host_moves_to_the_end_of_a_large_blob_s_chain_and_the_one_behind_it_takes_its_source():
    order = blob_transfer.RelayOrder()
    size, window = blob_transfer.PACE_MIN, blob_transfer.PACE_WINDOW
    a, b, c, d = ("10.0.0.2", 1), ("10.0.0.3", 1), ("10.0.0.4", 1), ("10.0.0.5", 1)
    assert order.source("x", a, [], size) is None
    assert order.source("x", b, [], size) is None, "the second host's first window is from the kernel"
    assert order.source("x", c, [], size) == b and order.source("x", d, [], size) == c
    # Even links: the kernel's uplink was the limit, so the second host reads from the first again.
    fast, got = 25e6, {}
    assert _run_at(order, {a: fast, b: fast, c: fast, d: fast}, 0, window + 1, size, got) == [b]
    assert order.source("x", b, [], size) == a and order.slow("x") == []
    # Then c's link slows to a quarter: the hosts behind it would wait on it.
    assert _run_at(order, {a: fast, b: fast, c: fast / 4, d: fast / 4}, 10, 11 + window, size, got) == [c, d]
    assert order.source("x", d, [], size) == b, "the host behind the slow one reads from the slow one's source"
    assert order.source("x", c, [], size) == d, "the slow host reads from the last host, whose uplink is idle"
    assert order.slow("x") == [c]
    # It stays there: a host moves once per blob, so the chain settles.
    assert _run_at(order, {a: fast, b: fast, d: fast, c: fast / 4}, 20, 20 + 2 * window, size, got) == []


@pytest.mark.unit
def test_a_slow_first_host_is_found_by_the_second_host_s_window_from_the_kernel():
    order = blob_transfer.RelayOrder()
    size, window = blob_transfer.PACE_MIN, blob_transfer.PACE_WINDOW
    a, b, c = ("10.0.0.2", 1), ("10.0.0.3", 1), ("10.0.0.4", 1)
    for host in (a, b, c):
        order.source("x", host, [], size)
    # The first host receives from the kernel at a quarter of what the second does: it moves to the
    # end; the second, already on the kernel's stream, is not asked to move.
    assert _run_at(order, {a: 5e6, b: 20e6, c: 20e6}, 0, window + 1, size, {}) == [a]
    assert order.source("x", b, [], size) is None, "the second host now leads the chain"
    assert order.source("x", a, [], size, offset=1) == c and order.slow("x") == [a]
    # Moved, it may be ahead of the host now before it (it led for a window): it reads from the nearest
    # host that has its offset, not from one it would wait on past PEER_STALL.
    order.note("x", b, 80 * MiB, window + 2)
    order.note("x", c, 1 * MiB, window + 2)  # c, now before a, has less than a's 5 MiB
    assert order.source("x", a, [], size, offset=5 * MiB) == b
    # Not slow, but overtaken by the second host in its window: the second would wait on it, so it leads.
    overtaken = blob_transfer.RelayOrder()
    for host in (a, b):
        overtaken.source("x", host, [], size)
    assert _run_at(overtaken, {a: 12e6, b: 20e6}, 0, window + 1, size, {a: 10 * MiB, b: 10 * MiB}) == [a]
    # A blob under PACE_MIN keeps the order the hosts asked in: it is through before a pace is known.
    small = blob_transfer.RelayOrder()
    assert small.source("y", a, [], 1 << 20) is None and small.source("y", b, [], 1 << 20) == a
    assert small.moves("y", 1 << 20, 100.0) == []


# -- on loopback: every host a thread with its own cache and relay ---------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("chunk", [blob_transfer.CHUNK, 4096], ids=["4-MiB-chunks", "6144-chunks"])
def test_four_hosts_get_the_blob_while_the_kernel_sends_one_copy(tmp_path, monkeypatch, chunk):
    """Also with a blob of thousands of chunks (a 24 GiB one has 6144): their digests are a large frame."""
    monkeypatch.setattr(blob_transfer, "CHUNK", chunk)
    data, blob = _blob(24 * MiB)
    secret = channel.new_secret()
    with _kernel("127.0.0.1", data, blob, secret) as server:
        caches = [_private(tmp_path / f"h{i}") for i in range(4)]
        relays = [BlobRelay("127.0.0.1", secret, cache) for cache in caches]
        try:
            hosts = [threading.Thread(target=BlobCache(cache).ensure, args=([blob], server.address, secret),
                                      kwargs={"relay": relay}) for cache, relay in zip(caches, relays)]
            for host in hosts:
                host.start()
            for host in hosts:
                host.join(timeout=60)
        finally:
            for relay in relays:
                relay.close()
        progress = server.progress()
    for i in range(4):
        assert (tmp_path / f"h{i}" / blob.digest).read_bytes() == data, f"host {i} holds other bytes"
    assert progress.from_kernel == len(data), f"the kernel sent {progress.from_kernel / len(data):.2f} copies"


@pytest.mark.unit
def test_a_host_that_passes_on_altered_bytes_is_dropped_for_the_kernel(tmp_path):
    """The second host's source serves other bytes under the blob's name: the first chunk does not
    match the kernel's chunk digest, so the host reads the blob from the kernel instead."""
    data, blob = _blob(9 * MiB)
    secret = channel.new_secret()
    forger, honest = _private(tmp_path / "forger"), _private(tmp_path / "honest")
    (forger / blob.digest).write_bytes(b"\0" * len(data))
    with _kernel("127.0.0.1", data, blob, secret) as server:
        forging = BlobRelay("127.0.0.1", secret, forger)
        try:
            # The forger asks first, so that it is the next host's source.
            blob_transfer.fetch(server.address, secret, blob, memoryview(bytearray(len(data))),
                                relay=blob_transfer.Relay(forging.address, lambda n: None))
            BlobCache(honest).ensure([blob], server.address, secret, relay=BlobRelay("127.0.0.1", secret, honest))
        finally:
            forging.close()
        assert server.progress().from_kernel == 2 * len(data), "the honest host did not fall back to the kernel"
    assert (honest / blob.digest).read_bytes() == data


def _read_slowly(address: tuple[str, int], secret: bytes, blob: Blob, got: bytearray, reading: threading.Event):
    """A host on a slow link reading ``blob`` from a relay: a small receive window, 256 KiB per 20 ms."""
    import socket

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        sock.connect(address)
        link = channel.Link(sock, secret, sock.recv(channel.NONCE_SIZE, socket.MSG_WAITALL), is_server=False)
        link.send({"digest": blob.digest, "offset": 0})
        assert link.recv()["size"] == blob.size
        while len(got) < blob.size:
            chunk = sock.recv(256 * 1024)
            if not chunk:
                return
            got += chunk
            reading.set()
            time.sleep(0.02)  # the slow link's pace, not a wait for anything


@pytest.mark.unit
@pytest.mark.parametrize("job", ["runs on", "ends"])
def test_a_relay_whose_task_ends_serves_the_host_reading_from_it_to_the_end_while_the_job_runs(tmp_path, job):
    """A task whose rank has ended closes its relay with a linger (task.supervisor): a host still reading
    from it gets every byte from it, not the rest from the kernel; once the job ends, the relay stops."""
    data, blob = _blob(24 * MiB)
    secret = channel.new_secret()
    cache = _private(tmp_path / "cache")
    (cache / blob.digest).write_bytes(data)
    relay = BlobRelay("127.0.0.1", secret, cache)
    got, reading, job_ended = bytearray(), threading.Event(), threading.Event()
    reader = threading.Thread(target=_read_slowly, args=(relay.address, secret, blob, got, reading))
    reader.start()
    assert reading.wait(30), "the reader received nothing from the relay"
    if job == "ends":
        threading.Timer(0.3, job_ended.set).start()
    started = time.monotonic()
    relay.close(linger=60, stop=job_ended)
    closed_after = time.monotonic() - started
    reader.join(timeout=60)
    if job == "runs on":
        assert bytes(got) == data, f"the reader got {len(got)} of {len(data)} bytes"
    else:
        assert closed_after < 5 and len(got) < len(data), (closed_after, len(got))


def _private(directory: Path) -> Path:
    directory.mkdir(mode=0o700, parents=True)
    return directory


# -- on simulated hosts ----------------------------------------------------------------------------
_why_not = netns.available()


class _Host:
    """tests/fanout_host.py in one namespace: fetches the blob into its own cache, relaying it."""

    def __init__(self, network: netns.Hosts, index: int, kernel: tuple[str, int], secret: bytes, blob: Blob,
                 workdir: Path):
        address, namespace = network.hosts[index]
        self.cache = workdir / f"host{index}"
        self.blob = blob
        args = {"secret": secret.hex(), "cache": str(self.cache), "host": address, "digest": blob.digest,
                "size": blob.size, "kernel": list(kernel)}
        self.proc = subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, str(HOST_SCRIPT)],
                                     env=dict(os.environ, HVDMAGIC_FANOUT=json.dumps(args)),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def received(self) -> int:
        """Bytes it has received so far, as it last said."""
        try:
            return int(self.cache.with_name(f"{self.cache.name}.received").read_text())
        except FileNotFoundError:
            return 0

    def fetched_in(self, timeout: float) -> float:
        """Seconds the host's fetch took, once it says (its one line), within ``timeout``."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise AssertionError(f"the host did not finish its fetch within {timeout:.0f} s: it received "
                                 f"{self.received()} of {self.blob.size} bytes")
        line = self.proc.stdout.readline()  # its one line, whole: it writes it at once
        if not line:
            raise AssertionError(f"the host ended without finishing its fetch (exit {self.proc.wait()})")
        return float(line.split()[1])

    def holds(self, data: bytes) -> bool:
        return (self.cache / self.blob.digest).read_bytes() == data

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        self.proc.send_signal(signal.SIGCONT)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.cluster
@pytest.mark.skipif(_why_not is not None, reason=f"no simulated hosts: {_why_not}")
@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_a_host_that_dies_mid_transfer_does_not_stall_the_one_reading_from_it(tmp_path, how):
    """Three hosts on 100 Mbit/s links, 24 MB: the second host reads from the first while the first
    still receives. The first then dies (SIGKILL: its connections close) or freezes (SIGSTOP: they
    stay open and silent). The second asks the kernel for another source within seconds and
    finishes with the right bytes; the third, reading from the second, never notices. Once the first
    has 2 MB, its own download slows to 1 Mbit/s: it is still receiving however long the others take
    to start (beside a second suite, longer than its 24 MB took at 100 Mbit/s), and relays as it does."""
    data, blob = _blob(24 * MiB)
    secret = channel.new_secret()
    with netns.Hosts(3, rate="100mbit") as network, _kernel(network.driver, data, blob, secret) as server:
        hosts: list[_Host] = []
        try:
            first = _Host(network, 0, server.address, secret, blob, tmp_path)
            hosts.append(first)
            wait_until(lambda: first.received() >= 2 * MiB, 30, "the first host received nothing from the kernel")
            network.slow_down(0, "1mbit")
            hosts += [_Host(network, i, server.address, secret, blob, tmp_path) for i in (1, 2)]
            second = hosts[1]
            wait_until(lambda: second.received() >= 2 * MiB, 30, "the second host received nothing from the first")
            assert first.received() < len(data), "the first host was done before it could die mid-transfer"
            first.proc.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            died = time.monotonic()
            for host in hosts[1:]:
                host.fetched_in(timeout=blob_transfer.PEER_STALL + 20)
            recovered = time.monotonic() - died
            for host in hosts[1:]:
                assert host.holds(data), "a host holds other bytes than the kernel's"
            progress = server.progress()
        finally:
            for host in hosts:
                host.close()
    # At 100 Mbit/s the 24 MB take about 2 s on a link; the stall adds PEER_STALL when frozen.
    assert recovered < blob_transfer.PEER_STALL + 10, f"the others took {recovered:.1f} s after the host died"
    assert progress.from_kernel < 3 * len(data), "every host read from the kernel: nothing was relayed"


@pytest.mark.cluster
@pytest.mark.skipif(_why_not is not None, reason=f"no simulated hosts: {_why_not}")
def test_a_host_on_a_slow_link_that_asks_first_holds_back_nobody(tmp_path, monkeypatch):
    """Four hosts on 100 Mbit/s links, the first to ask on 25 Mbit/s, 48 MB (PACE_MIN lowered to 16 MiB,
    as for a large blob; the window at its own 3 s: a 1 s one, beside a second suite, read CPU-starved
    relays as slow links and moved every host). The second host's window from the kernel shows the
    first's link slow: the first moves to the chain's end, and the three others finish in about the
    time of their own links, not the slow one's; every host holds the kernel's bytes."""
    monkeypatch.setattr(blob_transfer, "PACE_MIN", 16 * MiB)
    data, blob = _blob(48 * MiB)
    secret = channel.new_secret()
    with netns.Hosts(4, rate="100mbit", rates={0: "25mbit"}) as network, \
            _kernel(network.driver, data, blob, secret) as server:
        hosts: list[_Host] = []
        try:
            slow = _Host(network, 0, server.address, secret, blob, tmp_path)
            hosts.append(slow)
            wait_until(lambda: slow.received() >= MiB, 30, "the slow host received nothing from the kernel")
            hosts += [_Host(network, i, server.address, secret, blob, tmp_path) for i in (1, 2, 3)]
            took = [host.fetched_in(timeout=120) for host in hosts]
            for i, host in enumerate(hosts):
                assert host.holds(data), f"host {i} holds other bytes than the kernel's"
            progress = server.progress()
        finally:
            for host in hosts:
                host.close()
    assert progress.slow == [network.hosts[0][0]], f"the slow host was not moved: {progress.slow}"
    assert "received slowly, so it read last" in progress.describe(time.monotonic())
    # At 25 Mbit/s the 48 MB take the slow host about 16 s; the others' links, about 4 s. In the order
    # they asked, every host would have waited on the slow one.
    assert max(took[1:]) < 0.6 * took[0], f"the others waited on the slow host: {took}"
    assert progress.from_kernel <= 1.5 * len(data), f"the kernel sent {progress.from_kernel / len(data):.2f} copies"


# -- through a cell, on four hosts -----------------------------------------------------------------
FOUR_HOST_CELL = """%%horovod --np 4
import os, horovod.torch as hvd
hvd.init()
hvd.allgather_object((os.readlink("/proc/self/ns/net"), float(X.sum())))
"""


@pytest.mark.cluster
@pytest.mark.skipif(_why_not is not None, reason=f"no simulated hosts: {_why_not}")
def test_a_large_global_read_on_four_hosts_leaves_the_kernel_once(shell, tmp_path):
    """A cell reading a 64 MB global on four hosts (one rank each, 200 Mbit/s links): every host
    receives the 64 MB, and the kernel sends them once; the others come host to host."""
    from hvdmagic import last_run

    x = np.random.default_rng(11).random(8 * MiB)
    with netns.Hosts(4, rate="200mbit") as network, spark_cluster(tmp_path, workers=4, cores=1, gpus=0,
                                                                  host=network.driver, worker_hosts=network.hosts,
                                                                  app="hvdmagic-four-hosts"):
        shell.user_ns["X"] = x
        try:
            result, error = run(shell, FOUR_HOST_CELL)
        finally:
            del shell.user_ns["X"]
    assert error is None, error
    assert len({row[0] for row in result}) == 4, "the ranks did not run on four hosts"
    assert all(row[1] == float(x.sum()) for row in result), "a rank read other values"
    shipping = last_run().shipping
    assert shipping is not None and shipping["done"], shipping
    assert sorted(shipping["hosts"].values()) == [x.nbytes] * 4, shipping  # every host received it
    assert shipping["from_kernel"] == x.nbytes, f"the kernel sent {shipping['from_kernel'] / x.nbytes:.2f} copies"
    assert "the rest host to host" in shipping["text"], shipping["text"]
