"""One simulated host's side of a blob fan-out, without Spark: tests/test_fanout.py runs it
in a network namespace (``ip netns exec``), as a task would run on its host.

It fetches one blob into its own cache directory through the kernel's blob server, passing
it on through its own relay, writes the bytes it has so far to "<cache>.received" a few times
a second, prints "fetched <seconds>", and keeps the relay serving until its stdin closes.
Its arguments come as one JSON object in HVDMAGIC_FANOUT (the secret in hex).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from hvdmagic.protocol import Blob
from hvdmagic.task.blob_cache import BlobCache
from hvdmagic.task.blob_relay import BlobRelay


def main() -> None:
    args = json.loads(os.environ["HVDMAGIC_FANOUT"])
    secret = bytes.fromhex(args["secret"])
    directory = Path(args["cache"])
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    relay = BlobRelay(args["host"], secret, directory)
    started = time.monotonic()
    progress = directory.with_name(f"{directory.name}.received")

    def received(blob: Blob, count: int) -> None:
        progress.with_suffix(".tmp").write_text(str(count))
        progress.with_suffix(".tmp").rename(progress)

    BlobCache(directory).ensure([Blob(args["digest"], args["size"])], tuple(args["kernel"]), secret, received,
                                relay=relay)
    print(f"fetched {time.monotonic() - started:.3f}", flush=True)
    sys.stdin.read()  # the test closes it once every host is done
    relay.close()


if __name__ == "__main__":
    main()
