"""How long the embedded Spark takes to start: the first Spark cell's wait, on a quiet machine and under load,
with the class-data archive (hvdmagic.launch.jvm_archive) and without it, side by side.

Each sample is a fresh interpreter that imports hvdmagic's Spark launcher and starts the embedded
session as the first ``%%horovod --np N`` cell does (pyspark's import, the Java check, the JVM,
the session), then runs a first barrier stage, as a cell's, and stops it. The two sides take
turns. "Under load" runs ``--busy`` processes that spin on the CPU meanwhile, as a laptop busy
with something else would. The archive must have been made (``python -m hvdmagic.build_jvm_archive``,
which the set-up runs). Run: ``python benchmarks/bench_spark_start.py``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

from hvdmagic.launch import jvm_archive

ONE_START = """
import os, sys, time
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
started = time.perf_counter()
from hvdmagic.launch import spark_session
session = spark_session.start_embedded(2, None if sys.argv[1] == "archive" else "")
ready = time.perf_counter()
session.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(lambda part: part).collect()
print(ready - started, time.perf_counter() - ready)
session.stop()
"""
SIDES = ("without the archive", "with the archive")


def one_start(side: str) -> tuple[float, float]:
    """The session's start and its first stage's, in seconds."""
    done = subprocess.run([sys.executable, "-c", ONE_START, "archive" if side == SIDES[1] else "none"],
                          capture_output=True, text=True, check=True)
    start, stage = done.stdout.strip().splitlines()[-1].split()
    return float(start), float(stage)


def spin(deadline: float) -> None:
    while time.monotonic() < deadline:
        pass


def starts(repeats: int, busy: int) -> dict[str, list[tuple[float, float]]]:
    """Each side's samples, the sides taking turns (the one that goes first swapped each round)."""
    deadline = time.monotonic() + 3600
    spinners = [multiprocessing.Process(target=spin, args=(deadline,), daemon=True) for _ in range(busy)]
    for process in spinners:
        process.start()
    samples = {side: [] for side in SIDES}
    try:
        for round_ in range(repeats):
            for side in SIDES[::-1] if round_ % 2 else SIDES:
                samples[side].append(one_start(side))
        return samples
    finally:
        for process in spinners:
            process.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--busy", type=int, default=2 * (os.cpu_count() or 1),
                        help="processes spinning on the CPU for the loaded runs (default: twice the cores)")
    args = parser.parse_args()
    if not jvm_archive.options():
        sys.exit("no class-data archive for this Java and pyspark: run python -m hvdmagic.build_jvm_archive first")
    print("| machine | side | the session's start | its first stage | both |\n| --- | --- | --- | --- | --- |")
    for label, busy in (("quiet", 0), (f"{args.busy} busy processes on {os.cpu_count()} cores", args.busy)):
        for side, samples in starts(args.repeats, busy).items():
            cells = [[sample[0] for sample in samples], [sample[1] for sample in samples], [sum(s) for s in samples]]
            print(f"| {label} | {side} | " + " | ".join(
                f"{statistics.median(c):.1f} s [{min(c):.1f}-{max(c):.1f}]" for c in cells) + " |", flush=True)
    print(f"n = {args.repeats} per side and machine")


if __name__ == "__main__":
    main()
