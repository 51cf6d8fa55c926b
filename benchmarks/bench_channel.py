"""The channel's cost per event: a task's events to the kernel over loopback TCP, the plain link against
the resumable one, side by side in one run (docs/performance.md, "The channel per event").

    .venv/bin/python benchmarks/bench_channel.py [--events 200000] [--rounds 7]

Each round sends ``--events`` frames of a rank's typical report (progress and a metric row, 102 bytes)
through each path in turn, in a rotating order, until the kernel's queue has them all:

- ``plain``: ``channel.connect`` and ``Link.send_raw`` on the sending thread, into a ``ChannelServer``
  (what every task used before the channel became resumable; the rsh agent and transform reports still do);
- ``resumable``: ``task.kernel_link.KernelLink.send_raw`` (a buffer, a writer thread, acknowledgements and
  the log of what is unacknowledged) into the same server's ``Peer``.

It reports each path's wall time and the process's CPU per event (both ends are in this process, as a
local-mode task and the kernel are), their medians, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hvdmagic import channel
from hvdmagic.task.kernel_link import KernelLink

FRAME = (b'{"type":"report","progress":{"train":[17,100,"train"]},"metrics":{"step":[17],"loss":[0.25]},'
         b'"rank":0}')


def _time(open_link, events: int) -> tuple[float, float]:
    """Wall and CPU seconds for ``events`` frames from a link ``open_link(address, secret)`` opens
    until the kernel's queue holds them all."""
    secret = channel.new_secret()
    server = channel.ChannelServer("127.0.0.1", secret, maxsize=events + 10)
    link = open_link(server.address, secret)
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(events):
            link.send_raw(FRAME)
        for _ in range(events):
            server.events.get(timeout=60)
        return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        link.close()
        server.close()


def _plain(address, secret) -> channel.Link:
    return channel.connect(*address, secret)


def _resumable(address, secret) -> KernelLink:
    link = KernelLink(*address, secret)
    link.open()
    return link


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    paths = {"plain": _plain, "resumable": _resumable}
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
    names = list(paths)
    for round_ in range(args.rounds):
        for name in names[round_ % 2:] + names[:round_ % 2]:
            figures[name].append(_time(paths[name], args.events))
    print(f"{args.events} events of {len(FRAME)} bytes a round, {args.rounds} rounds, medians:")
    medians = {}
    for name, runs in figures.items():
        wall = statistics.median(w for w, _ in runs) / args.events * 1e6
        cpu = statistics.median(c for _, c in runs) / args.events * 1e6
        medians[name] = (wall, cpu)
        spread = [round(w / args.events * 1e6, 2) for w, _ in runs]
        print(f"  {name:<10} wall {wall:5.2f} µs/event (rounds {min(spread)}-{max(spread)}), CPU {cpu:5.2f} µs/event")
    print(f"  resumable/plain: wall {medians['resumable'][0] / medians['plain'][0]:.2f}x, "
          f"CPU {medians['resumable'][1] / medians['plain'][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
