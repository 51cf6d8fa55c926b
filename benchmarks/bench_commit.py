"""What an elastic commit pays to have its rows in the kernel: ``telemetry.deliver`` against the plain
``telemetry.flush`` that commits called before, side by side in one run (docs/performance.md, "An elastic
commit's delivery").

    .venv/bin/python benchmarks/bench_commit.py [--commits 2000] [--rounds 5]

A rank process (a child started through the supervisor's ``RankProcess``, its events relayed over a
``KernelLink`` to a ``ChannelServer`` whose queue a thread empties, as the kernel's job loop does) logs
one metric row and then flushes or delivers, ``--commits`` times a round, the two in turn, in a rotating
order; it times each call with ``time.perf_counter``. Printed: the median and the 99th percentile per
call of each, over every round, and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hvdmagic import channel
from hvdmagic.protocol import Boot
from hvdmagic.task.kernel_link import KernelLink
from hvdmagic.task.rank_process import RankProcess

RANK = """
import json, os, sys, time
from hvdmagic import protocol
from hvdmagic.rank import telemetry

protocol.read_boot(sys.stdin.buffer)
telemetry.open_events()
commits, rounds = int(sys.argv[1]), int(sys.argv[2])
calls = {"flush": telemetry.flush, "deliver": telemetry.deliver}
names = list(calls)
times = {name: [] for name in names}
for round_ in range(rounds):
    for name in names[round_ % 2:] + names[:round_ % 2]:
        for step in range(commits):
            telemetry.log_metrics(step=step, loss=1.0)
            started = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - started)
with open(os.environ["BENCH_COMMIT_OUT"], "w") as out:
    json.dump(times, out)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    secret = channel.new_secret()
    server = channel.ChannelServer("127.0.0.1", secret)
    link = KernelLink(*server.address, secret)
    link.open()
    done = threading.Event()

    def kernel() -> None:
        while not done.is_set():
            try:
                server.events.get(timeout=0.1)
            except queue.Empty:
                pass

    threading.Thread(target=kernel, daemon=True).start()
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        def start(env, events_w):
            return subprocess.Popen([sys.executable, "-c", RANK, str(args.commits), str(args.rounds)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    pass_fds=(events_w,), env={**env, "BENCH_COMMIT_OUT": out.name})

        rank = RankProcess(0, link.send, link.send_raw, link)
        try:
            assert rank.start(dict(os.environ), Boot(0), start)
            code = rank.wait()
            assert code == 0, f"the rank exited with {code}"
            times = json.loads(Path(out.name).read_text())
        finally:
            done.set()
            link.close()
            server.close()
    print(f"{args.commits} commits a round, {args.rounds} rounds, one metric row before each; per call:")
    medians = {}
    for name, runs in times.items():
        medians[name] = statistics.median(runs) * 1e6
        p99 = statistics.quantiles(runs, n=100)[98] * 1e6
        print(f"  {name:<8} median {medians[name]:8.1f} µs, 99th percentile {p99:8.1f} µs")
    print(f"  deliver/flush: {medians['deliver'] / medians['flush']:.1f}x the median")
    return 0


if __name__ == "__main__":
    sys.exit(main())
