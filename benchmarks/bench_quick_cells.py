#!/usr/bin/env python
"""Trivial session cells in a real Jupyter kernel with widgets on: the dashboard's delay against none.

One command, from the repository root:

    .venv/bin/python benchmarks/bench_quick_cells.py            # about a minute on 2 cores
    .venv/bin/python benchmarks/bench_quick_cells.py --quick    # a smoke run

One kernel (started through jupyter_client, widgets on, as in JupyterLab) gets a local
session (``%horovod start --np -2``) and a set-up cell (``import torch``,
``horovod.torch``, ``hvd.init()``). Then each cell is the trivial
``%%horovod\\nhvd.allreduce(torch.ones(1)).item()``, timed from its execute request to the
kernel's idle, in three kinds that take turns cell by cell (the order rotates each round):

- ``widgets, delay 0``: ``HVDMAGIC_DASHBOARD_DELAY=0``, the widgets at once, as before the delay;
- ``widgets, default delay``: the delay unset (``hvdmagic.kernel.ui.live.DELAY``);
- ``text view``: ``HVDMAGIC_NONINTERACTIVE=1``, for reference.

The kind is set by an untimed cell before each timed one (hvdmagic reads both variables
when a run starts). For each kind it records the wall time and the messages the cell sent
(widget models opened, widget updates, displays). ``--fresh N`` adds N fresh
``%%horovod --np -2`` cells of each widget kind (they start their own ranks and outlive
the delay), to show that fresh cells are no slower. Last, ``--global-mib N`` (default 1024)
session cells read an unchanged N MiB global ``X``, taking turns with the same cell on a 1 KiB
``Y`` (``float(X[:10].sum())``, widgets on): X's extra time is what the kernel spends checking
that X did not change, since nothing is sent. It prints a table and writes every sample to
``artifacts/bench_quick_cells.json``. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import _common  # noqa: E402

log = _common.Log("bench_quick_cells")

IMPORTS = "import torch\nimport horovod.torch as hvd\nhvd.init()\n"
SETUP_CELL = "%%horovod\n" + IMPORTS + "hvd.rank()\n"
TRIVIAL_CELL = "%%horovod\nhvd.allreduce(torch.ones(1)).item()\n"
FRESH_CELL = "%%horovod --np -2\n" + IMPORTS + "hvd.allreduce(torch.ones(1)).item()\n"
KINDS = {  # the environment a kind's cells run with, set in the kernel before each
    "widgets_delay_0": {"HVDMAGIC_DASHBOARD_DELAY": "0", "HVDMAGIC_NONINTERACTIVE": None},
    "widgets_default_delay": {"HVDMAGIC_DASHBOARD_DELAY": None, "HVDMAGIC_NONINTERACTIVE": None},
    "text_view": {"HVDMAGIC_DASHBOARD_DELAY": None, "HVDMAGIC_NONINTERACTIVE": "1"},
}
LABELS = {"widgets_delay_0": "widgets, delay 0 (before)", "widgets_default_delay": "widgets, default delay (after)",
          "text_view": "text view (HVDMAGIC_NONINTERACTIVE=1)"}
GOAL_MS = 20.0  # median of a trivial session cell, widgets on


class Kernel(_common.Kernel):
    """A python3 kernel from this virtualenv, widgets on."""

    def __init__(self):
        super().__init__({"HVDMAGIC_NONINTERACTIVE": None, "HVDMAGIC_DASHBOARD_DELAY": None})

    def run(self, code: str, timeout: float = 300) -> dict:
        """Run a cell: seconds from the execute request to the kernel's idle, and what it sent on iopub."""
        counts = {"widget_opens": 0, "widget_updates": 0, "widget_closes": 0, "displays": 0, "display_updates": 0,
                  "result": None}

        def count(message: dict) -> None:
            kind, content = message["msg_type"], message["content"]
            if kind == "comm_open" and content.get("target_name") == "jupyter.widget":
                counts["widget_opens"] += 1
            elif kind == "comm_msg":
                counts["widget_updates"] += 1
            elif kind == "comm_close":
                counts["widget_closes"] += 1
            elif kind == "display_data":
                counts["displays"] += 1
            elif kind == "update_display_data":
                counts["display_updates"] += 1
            elif kind == "execute_result":
                counts["result"] = content["data"].get("text/plain")

        seconds, _, _ = self.execute(code, timeout, on_message=count)
        return {"seconds": seconds, **counts}

    def use(self, kind: str) -> None:
        lines = ["import os"] + [f"os.environ[{name!r}] = {value!r}" if value is not None
                                 else f"os.environ.pop({name!r}, None)" for name, value in KINDS[kind].items()]
        self.run("\n".join(lines))


def measure(kernel: Kernel, kinds: list[str], source: str, rounds: int) -> dict:
    """``rounds`` cells of each kind, taking turns; each must return the average of two ranks' ones, 1.0."""
    samples: dict = {kind: [] for kind in kinds}
    for r in range(rounds):
        for kind in _common.rotated(kinds, r):
            kernel.use(kind)
            sample = kernel.run(source)
            if sample["result"] != "1.0":
                raise RuntimeError(f"{kind}: the cell returned {sample['result']!r}, not 1.0")
            samples[kind].append(sample)
    return samples


def summary(samples: dict) -> dict:
    out = {}
    for kind, runs in samples.items():
        ms = [1e3 * s["seconds"] for s in runs]
        out[kind] = {"ms": _common.describe(ms, p10=10, p90=90),
                     **{key: _common.describe([s[key] for s in runs])
                        for key in ("widget_opens", "widget_updates", "widget_closes", "displays",
                                    "display_updates")}}
    return out


def table(result: dict) -> str:
    rows = [("", "n", "median ms", "p90 ms", "min-max ms", "widgets opened", "widget updates", "display updates")]

    def add(section: str, stats: dict) -> None:
        for kind, s in stats.items():
            ms = s["ms"]
            if not ms.get("n"):
                continue
            rows.append((f"{section}: {LABELS[kind]}", str(ms["n"]), f"{ms['median']:.1f}", f"{ms['p90']:.1f}",
                         f"{ms['min']:.1f}-{ms['max']:.1f}", f"{s['widget_opens']['median']:g}",
                         f"{s['widget_updates']['median']:g}", f"{s['display_updates']['median']:g}"))

    add("session cell", result["summary"]["session"])
    if result["summary"].get("fresh"):
        add("fresh cell", result["summary"]["fresh"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in rows]
    after = result["summary"]["session"]["widgets_default_delay"]["ms"]
    if after.get("n"):
        lines += ["", f"trivial session cell, widgets on: {after['median']:.1f} ms median, goal <= {GOAL_MS:.0f} ms: "
                      f"{'met' if after['median'] <= GOAL_MS else 'NOT met'}"]
    return "\n".join(lines)


def unchanged_global(kernel: Kernel, mib: int, cells: int) -> dict:
    """Session cells reading an unchanged ``mib`` MiB global X, taking turns with the same cell on a
    1 KiB Y, widgets on: X's extra time is the kernel's check that X did not change (nothing is sent)."""
    kernel.use("widgets_default_delay")
    kernel.run(f"import numpy as np\nX = np.ones({mib} * 2**20 // 8)\nY = np.ones(128)")
    samples: dict = {"X": [], "Y": []}
    for i in range(2 * cells + 2):
        name = "XY"[i % 2]
        sample = kernel.run(f"%%horovod\nfloat({name}[:10].sum())\n")
        if sample["result"] != "10.0":
            raise RuntimeError(f"the {name} cell returned {sample['result']!r}, not 10.0")
        if i >= 2:  # the first X cell sends X to the host's cache
            samples[name].append(1e3 * sample["seconds"])
    extra = statistics.median(samples["X"]) - statistics.median(samples["Y"])
    return {"mib": mib, "ms": samples, "extra_ms": extra}


COUNTS = {"cells": (30, 10, "timed trivial session cells per kind {}"),
          "fresh": (5, 2, "fresh %%%%horovod --np -2 cells per widget kind (0: none) {}")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 10 cells per kind, 2 fresh cells")
    _common.add_counts(parser, COUNTS)
    parser.add_argument("--global-mib", type=int, default=1024,
                        help="an unchanged session global of this many MiB, against a 1 KiB one (0: skip)")
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench_quick_cells.json"))
    args = parser.parse_args(argv)
    cfg = {"quick": args.quick, **_common.counts(args, COUNTS), "command": _common.command_line()}
    result: dict = {"config": cfg, "started": time.time(),
                    "environment": _common.environment("ipykernel", "ipywidgets", "jupyter_client"), "samples": {}}
    load = _common.LoadMonitor()
    log("starting the kernel, the session (%horovod start --np -2) and its set-up cell")
    kernel = Kernel()
    try:
        for code in ("%load_ext hvdmagic", "%horovod start --np -2", SETUP_CELL):
            kernel.run(code)
        log("warm-up: 3 cells of each kind")
        measure(kernel, list(KINDS), TRIVIAL_CELL, 3)
        log(f"{cfg['cells']} trivial session cells of each kind, taking turns")
        result["samples"]["session"] = measure(kernel, list(KINDS), TRIVIAL_CELL, cfg["cells"])
        result["load_session"] = load.sample()
        if cfg["fresh"]:
            log(f"{cfg['fresh']} fresh %%horovod --np -2 cells of each widget kind")
            result["samples"]["fresh"] = measure(kernel, ["widgets_delay_0", "widgets_default_delay"], FRESH_CELL,
                                                 cfg["fresh"])
            result["load_fresh"] = load.sample()
        if args.global_mib:
            log(f"{cfg['cells']} session cells reading an unchanged {args.global_mib} MiB global, as many a 1 KiB one")
            result["unchanged_global"] = unchanged_global(kernel, args.global_mib, cfg["cells"])
        kernel.run("%horovod stop")
    finally:
        kernel.stop()
    result["summary"] = {part: summary(samples) for part, samples in result["samples"].items()}
    result["ended"] = time.time()
    result["table"] = table(result)
    path = _common.write_json(args.out, result)
    print(result["table"])
    if (unchanged := result.get("unchanged_global")) is not None:
        x, y = (statistics.median(unchanged["ms"][name]) for name in "XY")
        print(f"\nsession cell reading an unchanged {unchanged['mib']} MiB global: {x:.1f} ms median, a 1 KiB one "
              f"{y:.1f} ms: extra {unchanged['extra_ms']:.1f} ms (n = {len(unchanged['ms']['X'])} each)")
    print(f"\nother processes' CPU during the session cells: {result['load_session']['others_cores']:.2f} cores; "
          f"every sample: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
