"""A real S3-protocol endpoint on loopback for the tests: moto's server (``python -m moto.server``), in a
process of its own on a free port of 127.0.0.1, and a bucket of each test's own in it.

s3fs and boto3 in this process find it through ``AWS_ENDPOINT_URL`` and the ``AWS_*`` credentials that
``s3_bucket`` sets (what a user's host or an instance role gives them on a real cluster); the ranks get it
through a Store's ``storage_options``, as horovod.spark's FilesystemStore takes them.
"""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
from helpers import wait_until
from ports import listening, reserve_port

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "hvdmagic-test", "AWS_SECRET_ACCESS_KEY": "hvdmagic-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """moto's S3 server for the module's tests: its URL."""
    port = reserve_port()
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: listening(port) or server.poll() is not None, 60,
                   lambda: f"moto's server did not listen on 127.0.0.1:{port} in 60 s: {log.read_text()[-2000:]}")
        assert server.poll() is None, f"moto's server ended: {log.read_text()[-2000:]}"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch):
    """A new bucket on moto's server, with this process's AWS_* variables pointing at it: ``s3://NAME``.
    The storage options that give the ranks the same are ``storage_options(endpoint)``."""
    for name, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(name, value)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # an instance made before these variables would not read them
    bucket = f"hvdmagic-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    return f"s3://{bucket}"


def storage_options(endpoint: str) -> dict:
    """s3fs's options for moto's server, for a Store whose ranks do not share this process's environment."""
    return {"endpoint_url": endpoint, "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}
