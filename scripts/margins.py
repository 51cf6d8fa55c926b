"""How far above their accuracy floor horovod's three Spark example scripts land, over many runs.

Not part of the test suite. The suite runs each example once (tests/test_spark_estimators.py,
test_spark_keras_estimator.py, test_spark_lightning_estimator.py), at the smallest data and epochs
that still pass its floor (test accuracy > 0.6; chance is 0.1); a floor met with luck is a flake
later. This runs an example ``--runs`` times exactly as its test does (the import changed, the same
arguments and data size), each run on the digits shifted with another seed, the models' own
initialisation and the example's ``randomSplit`` unseeded as in the test, and prints every accuracy,
the lowest, the median and the lowest one's margin over the floor.

    .venv/bin/python scripts/margins.py pytorch [--runs 20]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

from digits_mnist import write_libsvm  # noqa: E402
from helpers import users_shell  # noqa: E402

FLOOR = 0.6
# The example, its arguments and its data's copies of the digits, as its test runs it.
EXAMPLES = {
    "pytorch": ("pytorch_spark_mnist.py", ["--epochs", "8", "--batch-size", "64"], 4),
    "keras": ("keras_spark_mnist.py", ["--epochs", "2", "--batch-size", "64"], 2),
    "lightning": ("pytorch_lightning_spark_mnist.py", ["--epochs", "5", "--batch-size", "32"], 4),
}


def run_once(example: str, seed: int) -> float:
    name, arguments, copies = EXAMPLES[example]
    with tempfile.TemporaryDirectory(prefix="hvdmagic-margin-") as folder:
        work = Path(folder)
        script = work / name
        script.write_text((TESTS / "horovod_examples" / name).read_text().replace("horovod.spark", "hvdmagic.spark"))
        write_libsvm(work / "mnist.bz2", copies=copies, seed=seed)
        done = subprocess.run([sys.executable, str(script), "--num-proc", "2", *arguments, "--work-dir",
                               str(work / "work"), "--data-dir", str(work)],
                              capture_output=True, text=True, timeout=900, cwd=work, env=users_shell())
        found = re.search(r"Test accuracy: ([\d.]+)", done.stdout)
        if done.returncode != 0 or found is None:
            raise SystemExit(f"run {seed} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
        return float(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("example", choices=sorted(EXAMPLES))
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    accuracies = []
    for seed in range(args.runs):
        started = time.monotonic()
        accuracies.append(run_once(args.example, seed))
        print(f"run {seed + 1:2d}: test accuracy {accuracies[-1]:.3f} ({time.monotonic() - started:.0f} s)",
              flush=True)
    lowest = min(accuracies)
    print(f"{args.example}: {args.runs} runs, lowest {lowest:.3f}, median {statistics.median(accuracies):.3f}, "
          f"highest {max(accuracies):.3f}; the floor {FLOOR} with a margin of {lowest - FLOOR:+.3f} at the lowest")
    return 0 if lowest > FLOOR else 1


if __name__ == "__main__":
    sys.exit(main())
