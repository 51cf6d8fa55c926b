"""Large notebook values on their way to the ranks: out of band, once per host, not again when unchanged.

The two-host count of bytes per host is in test_multihost.py; the timings in
benchmarks/bench_payload.py.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading

import numpy as np
import pytest
from conftest import run
from procs import rank_processes

import hvdmagic
from hvdmagic import blob_transfer, channel, pickling
from hvdmagic.errors import JobFailed
from hvdmagic.launch import shipment
from hvdmagic.protocol import Blob
from hvdmagic.task import blob_cache

MiB = 1 << 20


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    """A blob cache of the test's own: one a run before left would make every blob a cache hit."""
    monkeypatch.setenv(blob_cache.DIR_ENV, str(tmp_path / "blobs"))


@pytest.fixture
def session(ip):
    ip.run_line_magic("horovod", "start --np -2")
    try:
        yield ip
    finally:
        ip.run_line_magic("horovod", "stop")
        assert rank_processes() == []


# -- unit: the pieces ------------------------------------------------------------------------------
@pytest.mark.unit
def test_large_buffers_leave_the_pickle_uncopied_and_come_back_whole():
    import torch

    array = np.arange(2 * MiB // 8, dtype=np.float64)
    tensor = torch.arange(MiB // 4, dtype=torch.float32)
    weight = torch.nn.Parameter(torch.ones(512, 1024))
    small = np.ones(10)
    head, views = pickling.dumps_out_of_band({"a": array, "t": tensor, "w": weight, "s": small})
    assert len(head) < 4096, "a large buffer went into the pickle stream"
    assert sorted(view.nbytes for view in views) == sorted([array.nbytes, tensor.numpy().nbytes, 2 * MiB])
    # The views are the objects' own memory: nothing was copied.
    assert any(np.shares_memory(np.asarray(view), array) for view in views)
    import pickle

    back = pickle.loads(head, buffers=[bytearray(view) for view in views])
    assert np.array_equal(back["a"], array) and back["a"].flags.writeable
    assert torch.equal(back["t"], tensor) and type(back["t"]) is torch.Tensor
    assert type(back["w"]) is torch.nn.Parameter and back["w"].requires_grad
    assert np.array_equal(back["s"], small)


@pytest.mark.unit
def test_a_digest_is_kept_for_the_same_content_and_changes_with_it():
    array = np.zeros(MiB, dtype=np.uint8)
    first = shipment.digest(memoryview(array))
    assert shipment.digest(memoryview(array.copy())) == first
    array[MiB // 2] = 1  # changed in place: same object, same address
    assert shipment.digest(memoryview(array)) != first


@pytest.mark.unit
def test_a_head_too_large_for_a_frame_travels_as_a_blob():
    many = list(range(2_000_000))  # no buffer to take out of band: a large pickle stream
    packed = shipment.pack((len, (many,), {}))
    assert packed.payload.head == b"" and packed.payload.head_blob in packed.buffers
    assert packed.payload.head_blob in {blob.digest for blob in packed.payload.blobs}


@contextlib.contextmanager
def _served(buffers: dict[str, memoryview], secret: bytes):
    server = blob_transfer.BlobServer("127.0.0.1", secret)
    server.publish(buffers)
    try:
        yield server
    finally:
        server.close()


@pytest.mark.unit
def test_a_host_fetches_each_blob_once_and_its_other_tasks_wait_for_it(tmp_path):
    data = np.random.default_rng(1).bytes(3 * MiB)
    digest = shipment.digest(memoryview(data))
    blob = Blob(digest, len(data), "X (bytes)")
    secret = channel.new_secret()
    with _served({digest: memoryview(data)}, secret) as server:
        cache = blob_cache.BlobCache(tmp_path)
        tasks = [threading.Thread(target=cache.ensure, args=([blob], server.address, secret)) for _ in range(3)]
        for task in tasks:
            task.start()
        for task in tasks:
            task.join(timeout=60)
        assert (tmp_path / digest).read_bytes() == data
        assert server.progress().sent == len(data), "three tasks of one host fetched the blob more than once"
        assert not list(tmp_path.glob("*.part-*"))


@pytest.mark.unit
def test_the_blob_server_serves_only_the_jobs_own_tasks(tmp_path):
    data = b"x" * MiB
    digest = shipment.digest(memoryview(data))
    with _served({digest: memoryview(data)}, channel.new_secret()) as server:
        with pytest.raises(blob_transfer.BlobError, match="blob server"):
            blob_transfer.fetch(server.address, channel.new_secret(), Blob(digest, len(data)),
                                memoryview(bytearray(len(data))), timeout=5)
        assert server.progress().sent == 0


@pytest.mark.unit
def test_altered_bytes_are_dropped_unread(tmp_path):
    """A server (or anything in between) that sends other bytes than the digest names is caught."""
    secret = channel.new_secret()
    real = b"a" * MiB
    forged = b"b" * MiB
    digest = shipment.digest(memoryview(real))
    with _served({digest: memoryview(forged)}, secret) as server:
        cache = blob_cache.BlobCache(tmp_path)
        with pytest.raises(blob_transfer.BlobError, match="arrived altered"):
            cache.ensure([Blob(digest, len(real), "X (bytes)")], server.address, secret)
    assert list(tmp_path.iterdir()) == [tmp_path / f"{digest}.lock"], "a forged blob was kept"


@pytest.mark.unit
def test_the_cache_evicts_the_least_recently_used_beyond_its_budget(tmp_path, monkeypatch):
    secret = channel.new_secret()
    blobs, buffers = [], {}
    for i in range(3):
        data = bytes([i]) * MiB
        digest = shipment.digest(memoryview(data))
        blobs.append(Blob(digest, len(data)))
        buffers[digest] = memoryview(data)
    monkeypatch.setenv(blob_cache.BUDGET_ENV, str(2 * MiB))
    with _served(buffers, secret) as server:
        cache = blob_cache.BlobCache(tmp_path)
        cache.ensure(blobs[:2], server.address, secret)
        cache.ensure(blobs[:1], server.address, secret)  # used again: the other one is now the oldest
        cache.ensure(blobs[2:], server.address, secret)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".lock") == sorted(
        [blobs[0].digest, blobs[2].digest])


# -- through the magic -----------------------------------------------------------------------------
SUM_CELL = ("%%horovod\nimport horovod.torch as hvd\nhvd.init()\n"
            "hvd.allgather_object((float(X[:1000].sum()), X.nbytes, X.flags.writeable))")


def test_a_600_mb_global_reaches_a_session_and_is_not_sent_again_until_it_changes(session):
    x = np.random.default_rng(3).random(600 * MiB // 8)
    session.user_ns["X"] = x
    result, error = run(session, SUM_CELL)
    assert error is None, error
    assert result == [(float(x[:1000].sum()), x.nbytes, True)] * 2
    first = hvdmagic.last_run().shipping
    assert first is not None and first["done"] and first["sent"] == x.nbytes, first  # one host: once
    assert "X (numpy.ndarray)" in first["text"]

    result, error = run(session, SUM_CELL)
    assert error is None, error
    assert hvdmagic.last_run().shipping is None, "an unchanged 600 MB global was sent again"

    x[10] = 1e6  # in place: the kernel must notice the content, not the object
    result, error = run(session, SUM_CELL)
    assert error is None, error
    assert result[0][0] == float(x[:1000].sum()), "the ranks read the stale X"
    assert hvdmagic.last_run().shipping["sent"] == x.nbytes


def test_a_rank_that_writes_to_a_global_changes_its_own_copy_only(ip):
    ip.user_ns["X"] = np.zeros(MiB // 8)
    result, error = run(ip, "%%horovod --np -2\nimport horovod.torch as hvd\nhvd.init()\n"
                            "X[0] = hvd.rank() + 1\nhvd.allgather_object(float(X[0]))")
    assert error is None, error
    assert result == [1.0, 2.0]  # each rank its own copy-on-write map of one shared file
    assert ip.user_ns["X"][0] == 0.0


@pytest.fixture
def small_cache(tmp_path, monkeypatch):
    """The host's blob cache on an 8 MiB tmpfs: a host short of memory."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount = tmp_path / "shm"
    mount.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mount)], check=True)
    monkeypatch.setenv(blob_cache.DIR_ENV, str(mount))
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_value_the_host_cannot_hold_fails_in_one_paragraph_naming_it(ip, small_cache):
    ip.user_ns["big"] = np.ones(16 * MiB // 8)
    ip.user_ns["kept"] = "as it was"
    _, error = run(ip, "%%horovod --np -2\nkept = 'clobbered'\nfloat(big.sum())")
    assert isinstance(error, JobFailed), error
    message = str(error)
    assert "big (numpy.ndarray) (16.0 MiB) does not fit on this host" in message, message
    assert "--data" in message and socket.gethostname() in message
    assert "Traceback" not in message and "blob_cache.py" not in message, message
    assert ip.user_ns["kept"] == "as it was"
    assert rank_processes() == []
