"""What a template's check before each fork costs: inotify's news of changed files against a stat of each.

A template (``hvdmagic/rank/template.py``) imports torch, then before every fork asks whether any of
the files it imported changed on disk. This times that whole check (``Template.unsafe``: threads,
files, environment, initialised frameworks) with the file watch (``rank/file_watch.py``) and with a
stat of every file, taking turns, in one process. Run: ``python benchmarks/bench_template_check.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from hvdmagic.rank.template import Orders, Template


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", type=int, default=500, help="timed checks of each kind")
    parser.add_argument("--modules", default="torch,horovod.torch", help="what the template imports")
    args = parser.parse_args()
    template = Template(Orders(socket="", log="", lock="", token="", modules=args.modules.split(","),
                               owner=os.getpid(), idle=1.0, idle_cap=3, own_keys=[], own_prefixes=[]))
    template.load()
    watch = template.watch
    env = dict(os.environ)
    times: dict[str, list[float]] = {"file watch": [], "stat of every file": []}
    for _ in range(args.checks):
        for kind in times:
            template.watch = watch if kind == "file watch" else None
            started = time.perf_counter()
            reason = template.unsafe(env)
            times[kind].append(time.perf_counter() - started)
            assert not reason, reason
    print(f"{len(template.stamps)} files imported ({args.modules}); {args.checks} checks of each kind, taking turns:")
    for kind, seconds in times.items():
        ms = sorted(s * 1e3 for s in seconds)
        print(f"  {kind}: median {statistics.median(ms):.3f} ms, p90 {ms[int(len(ms) * 0.9)]:.3f} ms")


if __name__ == "__main__":
    main()
