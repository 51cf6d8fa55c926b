"""mpirun's rsh agent: ``python -m hvdmagic.launch.mpi_rsh HOST COMMAND...``.

mpirun calls it as it would call ssh, to start its daemon on HOST. Instead of
logging in anywhere, it asks the driver (over the job's authenticated channel)
to run COMMAND in the barrier task that leads HOST, and stays until that
command ends, exiting with its code, as ssh would.
"""

from __future__ import annotations

import os
import sys

from hvdmagic import channel, protocol
from hvdmagic.protocol import RSH_ENV, Event


def main(argv: list[str]) -> int:
    if len(argv) < 2 or RSH_ENV not in os.environ:
        print("hvdmagic.launch.mpi_rsh is started by mpirun under `%%horovod --controller mpi`, "
              "not by hand", file=sys.stderr)
        return 2
    host, port, secret = os.environ[RSH_ENV].rsplit(":", 2)
    link = channel.connect(host, int(port), bytes.fromhex(secret))
    try:
        # ssh hands the remote shell one string: so do we.
        link.send(protocol.rsh(argv[0], " ".join(argv[1:])))
        while True:
            reply = link.recv()
            if reply.get("type") == Event.RSH_EXIT:
                return int(reply.get("code", 1))
            if reply.get("type") == Event.ABORT:
                return 1
    except (channel.ChannelError, OSError) as exc:
        print(f"hvdmagic rsh agent: lost the driver ({exc})", file=sys.stderr)
        return 255  # what ssh returns when the connection fails
    finally:
        link.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
