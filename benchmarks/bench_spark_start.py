"""How long the embedded Spark takes to start: the first Spark cell's wait, on a quiet machine and under load.

Each sample is a fresh interpreter that imports hvdmagic's Spark launcher and starts the embedded
session as the first ``%%horovod --np N`` cell does (pyspark's import, the Java check, the JVM,
the session), then stops it. "Under load" runs ``--busy`` processes that spin on the CPU meanwhile,
as a laptop busy with something else would. Run: ``python benchmarks/bench_spark_start.py``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

ONE_START = """
import os, time
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
started = time.perf_counter()
from hvdmagic.launch import spark_session
session = spark_session._start_embedded(2)
print(time.perf_counter() - started)
session.stop()
"""


def one_start() -> float:
    done = subprocess.run([sys.executable, "-c", ONE_START], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def spin(deadline: float) -> None:
    while time.monotonic() < deadline:
        pass


def starts(repeats: int, busy: int) -> list[float]:
    deadline = time.monotonic() + 3600
    spinners = [multiprocessing.Process(target=spin, args=(deadline,), daemon=True) for _ in range(busy)]
    for process in spinners:
        process.start()
    try:
        return [one_start() for _ in range(repeats)]
    finally:
        for process in spinners:
            process.terminate()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--busy", type=int, default=2 * (os.cpu_count() or 1),
                        help="processes spinning on the CPU for the loaded runs (default: twice the cores)")
    args = parser.parse_args()
    for label, busy in (("quiet", 0), (f"{args.busy} busy processes on {os.cpu_count()} cores", args.busy)):
        seconds = starts(args.repeats, busy)
        print(f"{label}: median {statistics.median(seconds):.1f} s, "
              f"[{min(seconds):.1f}-{max(seconds):.1f}] (n = {len(seconds)})", flush=True)


if __name__ == "__main__":
    main()
