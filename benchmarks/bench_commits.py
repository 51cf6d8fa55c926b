#!/usr/bin/env python
"""This checkout against another commit, side by side, as a user feels it: cells through real kernels.

One command, from the repository root:

    .venv/bin/python benchmarks/bench_commits.py --base HEAD~3   # about 5 minutes on 2 cores

It unpacks ``--base`` (``git archive``) into a temporary folder and starts two Jupyter
kernels from this virtualenv: one imports hvdmagic from that folder, one from this
checkout. Each round sends the same cells to both, in an order that alternates from round
to round, and times each from its execute request to the kernel's idle (jupyter_client,
widgets on, as in JupyterLab):

- ``fresh``: ``%%horovod --np N`` starting new ranks that import horovod.torch, call
  ``hvd.init()`` and return their rank;
- ``session``: the same body's last line on a warm session's ranks (``%horovod start``,
  then a set-up cell), i.e. ``%%horovod\\nhvd.rank()``.

It prints medians, and the paired ratios (this checkout / base) with their spread, and
writes every sample to ``artifacts/bench_commits.json``. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import _common  # noqa: E402

SETUP = "import horovod.torch as hvd\nhvd.init()\n"
CELLS = {"fresh": "%%horovod --np {np}\n" + SETUP + "hvd.rank()\n", "session": "%%horovod\nhvd.rank()\n"}


class Kernel(_common.Kernel):
    """One Jupyter kernel whose hvdmagic comes from ``source``, widgets on as in any Jupyter front end."""

    def __init__(self, name: str, source: Path):
        super().__init__({"PYTHONPATH": str(source), "HVDMAGIC_NONINTERACTIVE": None}, cwd=source, name=name)

    def run(self, code: str, timeout: float = 300) -> float:
        """Seconds from the execute request to the kernel's idle; raises if the cell failed."""
        return self.execute(code, timeout)[0]

    def where_from(self) -> str:
        """The file its hvdmagic was imported from: the comparison means nothing if both are the same."""
        return self.execute("import hvdmagic; print(hvdmagic.__file__)", timeout=60)[2].strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD", help="the commit to compare this checkout with")
    parser.add_argument("--np", type=int, default=-2, help="the cells' --np (negative: local mode)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--session-cells", type=int, default=5, help="session cells per kernel per round")
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench_commits.json"))
    args = parser.parse_args()

    base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="hvdmagic-base-") as folder:
        base_dir = Path(folder)
        archive = subprocess.run(["git", "archive", base_rev], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base_dir)], input=archive, check=True)
        kernels = {"base": Kernel("base", base_dir), "this": Kernel("this", ROOT)}
        samples: dict[str, dict[str, list[float]]] = {cell: {k: [] for k in kernels} for cell in CELLS}
        try:
            origins = {name: kernel.where_from() for name, kernel in kernels.items()}
            if origins["base"] == origins["this"]:
                raise RuntimeError(f"both kernels import hvdmagic from {origins['base']}")
            for kernel in kernels.values():
                kernel.run("%load_ext hvdmagic")
                kernel.run(f"%horovod start --np {args.np}")
                kernel.run("%%horovod\n" + SETUP)
                kernel.run(CELLS["fresh"].format(np=args.np))  # warm-up: page cache, the first Spark stage
            for r in range(args.rounds):
                for name in _common.rotated(list(kernels), r):
                    kernel = kernels[name]
                    samples["fresh"][name].append(kernel.run(CELLS["fresh"].format(np=args.np)))
                    samples["session"][name].extend(kernel.run(CELLS["session"])
                                                    for _ in range(args.session_cells))
                print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        finally:
            for kernel in kernels.values():
                kernel.stop()

    figures = {"base": base_rev, "np": args.np, "origins": origins, "environment": _common.environment(),
               "cells": {cell: {"base": _common.describe(s["base"]), "this": _common.describe(s["this"]),
                                "this/base": _common.paired(s["this"], s["base"], totals=True), "samples": s}
                         for cell, s in samples.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(figures, indent=1, default=str))
    print(f"this checkout against {base_rev}, --np {args.np}, widgets on, request to idle "
          f"({args.rounds} rounds; {args.session_cells} session cells per kernel per round)")
    for cell, figure in figures["cells"].items():
        ratio = figure["this/base"]
        base, this = figure["base"]["median"] * 1000, figure["this"]["median"] * 1000
        spread = f"[{_common.num(ratio.get('min'))}-{_common.num(ratio.get('max'))}]"
        print(f"  {cell:8s} base {base:7.1f} ms   this {this:7.1f} ms   this/base median "
              f"{_common.num(ratio.get('median'))} {spread}, its 95% interval "
              f"{'-'.join(map(_common.num, ratio.get('median_ci95') or [])) or 'n/a'}, "
              f"ratio of totals {_common.num(ratio.get('ratio_of_totals'))}")


if __name__ == "__main__":
    main()
