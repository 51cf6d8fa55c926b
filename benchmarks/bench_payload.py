#!/usr/bin/env python
"""What a large notebook global costs the cell that reads it, against its serialization floor.

One command, from the repository root:

    .venv/bin/python benchmarks/bench_payload.py            # the full run (about 7 minutes on a busy 2-core machine)
    .venv/bin/python benchmarks/bench_payload.py --quick    # one repeat of each measurement (2-3 minutes)

It prints a table and writes every sample to ``artifacts/bench_payload.json``
(docs/performance.md, "Large notebook values", shows and explains the figures).

A float64 numpy global ``X`` of each size (``--sizes``, MiB: 1, 100, 1024 and 2048 by
default; 1 MiB is exactly the size from which a buffer leaves the pickle as a blob) is read
by a cell, ``float(X[:10].sum())`` after ``hvd.init()``. The cost of ``X`` (its "extra") is
the cell's wall time less that of the same cell reading a 1 KiB global ``Y`` instead (the
same source, one name changed), run beside it in the same repeat: the difference per
repeat, median over the repeats. Every cell goes through one in-process IPython shell
(``IPython.testing.globalipapp``, hvdmagic loaded, ``HVDMAGIC_NONINTERACTIVE=1``): the wall
time around ``ip.run_cell``. For each size:

- **floor**: ``cloudpickle.dumps(X)`` and two ``pickle.loads`` of it, in this process (the
  two ranks' copies kept until both exist), with the BLAKE3 and xxh3 passes over ``X`` that
  the kernel makes (``launch.shipment``) timed alone beside it;
- **fresh local**: ``%%horovod --np -2`` cells. *Cold*: ``X`` holds content the kernel has
  not seen (one element changed), and ``HVDMAGIC_BLOB_CACHE`` names a new, empty directory,
  so the kernel names the buffer (BLAKE3) and the host fetches it. *Warm*: the same content
  again right after, in a fresh job whose host cache has the blob;
- **session**: ``%horovod start --np -2`` (its own empty cache directory) and a set-up cell
  (``import horovod.torch``, ``hvd.init()``), then ``%%horovod`` cells: *first* (``X`` with
  content new to the session: sent), *unchanged* (nothing sent: the kernel's xxh3 check;
  ``--session-cells`` of them per repeat, taking turns with as many 1 KiB cells) and
  *changed in place* (``X[1] += 1``: sent again);
- **fresh Spark** (``--spark-sizes``): ``%%horovod --np 2`` on an embedded ``local[2]``
  SparkSession (driver and executors on 127.0.0.1), cold and warm as for local mode. The
  Spark workers took ``HVDMAGIC_BLOB_CACHE`` from the environment the session started with,
  so a cold cell empties that directory first.

Every cell's ``hvdmagic.last_run().shipping`` is checked: a cold or changed cell must send
``X``'s bytes once, a warm or unchanged one nothing, and every rank must return the right
sum. A size whose 4x is more than the memory available is skipped (recorded as such).
Fresh cells repeat ``--fresh-reps`` times per size and mode (a fresh cell's wall time varies
by a second on a shared 2-core machine), the floor and a session's first and changed cells
``--reps`` times. Other processes' CPU use is sampled throughout. Nothing is asserted about
timings.
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ["HVDMAGIC_NONINTERACTIVE"] = "1"  # the text view: no widgets in a benchmark
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

from benchmarks import _common  # noqa: E402

log = _common.Log("bench_payload")

MiB = 1 << 20
CACHE_ENV = "HVDMAGIC_BLOB_CACHE"  # hvdmagic.task.blob_cache.DIR_ENV
BODY = "import horovod.torch as hvd\nhvd.init()\nfloat({name}[:10].sum())\n"
SESSION_SETUP = "%%horovod\nimport horovod.torch as hvd\nhvd.init()\nhvd.rank()\n"
SESSION_CELL = "%%horovod\nfloat({name}[:10].sum())\n"
SMALL_BYTES = 1024
MEMORY_FACTOR = 4  # a size is measured only with this many times its bytes available
# The goals.
GOAL_RATIO = 2.0  # extra <= 2x floor, at GOAL_SIZES
GOAL_SIZES = (100, 1024)
GOAL_UNCHANGED_MS = 20.0  # an unchanged session global, at 1 GiB
# Below this floor an extra / floor ratio is noise over a near-zero denominator: not shown in the table.
RATIO_MIN_FLOOR_S = 0.05


def label(mib: int) -> str:
    return f"{mib // 1024} GiB" if mib >= 1024 and mib % 1024 == 0 else f"{mib} MiB"


class Bench:
    def __init__(self, root: Path, spark_cache: Path):
        import hvdmagic

        self.hvdmagic = hvdmagic
        self.root = root
        self.spark_cache = spark_cache
        self.ip = _common.ipython_shell()
        self.ip.user_ns["Y"] = self.small = np_arange(SMALL_BYTES // 8)
        self._unique = 0.0
        self._dirs = 0
        # The kernel's time naming the cell's buffers (launch.shipment.blobs_of: BLAKE3 for new
        # content, xxh3 for known content), per cell: the part of the extra that a wall-time
        # difference measures only coarsely.
        from hvdmagic.launch import shipment

        self.naming = 0.0
        original = shipment.blobs_of

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.naming += time.perf_counter() - t0

        shipment.blobs_of = timed

    # -- helpers ------------------------------------------------------------------------
    def new_dir(self, what: str) -> Path:
        self._dirs += 1
        return self.root / f"{what}-{self._dirs}"

    def renew(self, x) -> None:
        """Content the kernel has not seen: one element changed."""
        self._unique -= 1.0
        x[0] = self._unique

    def cell(self, source: str, x, sent: int | None) -> dict:
        """Run a cell reading ``x`` ("X" or "Y" in ``source``); check every rank's value and what was
        shipped (``sent``: X's bytes, or None for nothing)."""
        self.naming = 0.0
        _, t0, t1 = _common.checked_cell(self.ip, source)
        record = self.hvdmagic.last_run()
        expected = float(x[:10].sum())
        if record.results != [expected] * len(record.results) or not record.results:
            raise RuntimeError(f"{source!r}: the ranks returned {record.results!r}, not {expected!r}")
        shipping = record.shipping
        got = shipping["sent"] if shipping else None
        if sent is not None and got != sent:
            raise RuntimeError(f"{source!r}: expected {sent} bytes sent, the run sent {got} ({shipping})")
        if sent is None and x is not self.small and got:
            raise RuntimeError(f"{source!r}: expected nothing sent, the run sent {got} ({shipping})")
        return {"wall": t1 - t0, "start": t0, "naming": self.naming, "sent": got,
                "shipping": shipping and shipping.get("text")}

    # -- floor --------------------------------------------------------------------------
    def floor(self, x, reps: int) -> dict:
        import blake3
        import cloudpickle
        import xxhash

        out: dict = {"dumps": [], "loads": [], "total": [], "blake3": [], "xxh3": []}
        for _ in range(reps):
            gc.collect()
            t0 = time.perf_counter()
            data = cloudpickle.dumps(x)
            t1 = time.perf_counter()
            first = pickle.loads(data)
            second = pickle.loads(data)
            t2 = time.perf_counter()
            del data, first, second
            gc.collect()
            view = memoryview(x).cast("B")
            t3 = time.perf_counter()
            blake3.blake3(view, max_threads=blake3.blake3.AUTO).hexdigest()
            t4 = time.perf_counter()
            xxhash.xxh3_128_digest(view)
            t5 = time.perf_counter()
            view.release()
            out["dumps"].append(t1 - t0)
            out["loads"].append(t2 - t1)
            out["total"].append(t2 - t0)
            out["blake3"].append(t4 - t3)
            out["xxh3"].append(t5 - t4)
        return out

    # -- fresh cells --------------------------------------------------------------------
    def fresh(self, x, np: int, reps: int, tag: str) -> dict:
        """Per repeat: a 1 KiB cell, and a cold cell followed by a warm one (order rotating)."""
        out: dict = {"baseline": [], "cold": [], "warm": [], "cold_naming": [], "warm_naming": [], "cold_sent": [],
                     "warm_sent": [], "cold_shipping": []}
        source = f"%%horovod --np {np}\n" + BODY
        for r in range(reps):
            for kind in _common.rotated(["baseline", "cold"], r):
                if kind == "baseline":
                    out["baseline"].append(self.cell(source.format(name="Y"), self.small, None)["wall"])
                    continue
                self.renew(x)
                if np < 0:
                    cache = self.new_dir("local")
                    os.environ[CACHE_ENV] = str(cache)
                else:  # the Spark workers' directory, fixed when the session started: emptied
                    cache = self.spark_cache
                    shutil.rmtree(cache, ignore_errors=True)
                cold = self.cell(source.format(name="X"), x, x.nbytes)
                if not any(p.stat().st_size == x.nbytes for p in cache.iterdir()):
                    raise RuntimeError(f"the host cache {cache} holds no blob of X's size: the tasks used another")
                warm = self.cell(source.format(name="X"), x, None)
                if np < 0:
                    shutil.rmtree(cache, ignore_errors=True)
                out["cold"].append(cold["wall"])
                out["warm"].append(warm["wall"])
                out["cold_naming"].append(cold["naming"])
                out["warm_naming"].append(warm["naming"])
                out["cold_sent"].append(cold["sent"])
                out["warm_sent"].append(warm["sent"])
                out["cold_shipping"].append(cold["shipping"])
            log(f"  {tag} repeat {r + 1}: 1 KiB {out['baseline'][-1]:.2f} s, cold {out['cold'][-1]:.2f} s, "
                f"warm {out['warm'][-1]:.2f} s ({out['cold_shipping'][-1]})")
        return out

    # -- a session ----------------------------------------------------------------------
    def session(self, x, reps: int, cells: int) -> dict:
        cache = self.new_dir("session")
        os.environ[CACHE_ENV] = str(cache)
        out: dict = {"baseline": [], "unchanged": [], "first": [], "changed": [], "unchanged_naming": [],
                     "first_naming": [], "changed_naming": [], "first_shipping": []}
        t0 = time.perf_counter()
        _common.checked_cell(self.ip, "%horovod start --np -2")
        _common.checked_cell(self.ip, SESSION_SETUP)
        out["start_and_setup"] = time.perf_counter() - t0
        small, big = SESSION_CELL.format(name="Y"), SESSION_CELL.format(name="X")
        try:
            for _ in range(2):  # warm-up
                self.cell(small, self.small, None)
            for r in range(reps):
                for entry in cache.iterdir():  # the earlier repeats' blobs: no later cell asks for them
                    entry.unlink(missing_ok=True)
                self.renew(x)
                first = self.cell(big, x, x.nbytes)
                out["first"].append(first["wall"])
                out["first_naming"].append(first["naming"])
                out["first_shipping"].append(first["shipping"])
                base, same, naming = [], [], []
                for i in range(2 * cells):
                    if (i + r) % 2 == 0:
                        base.append(self.cell(small, self.small, None)["wall"])
                    else:
                        run = self.cell(big, x, None)
                        same.append(run["wall"])
                        naming.append(run["naming"])
                out["baseline"].append(base)
                out["unchanged"].append(same)
                out["unchanged_naming"].append(naming)
                x[1] += 1.0
                changed = self.cell(big, x, x.nbytes)
                out["changed"].append(changed["wall"])
                out["changed_naming"].append(changed["naming"])
                log(f"  session repeat {r + 1}: 1 KiB {1e3 * statistics.median(base):.0f} ms, first "
                    f"{out['first'][-1]:.2f} s, unchanged {1e3 * statistics.median(same):.0f} ms (naming X "
                    f"{1e3 * statistics.median(naming):.1f} ms), changed "
                    f"{out['changed'][-1]:.2f} s ({first['shipping']})")
        finally:
            _common.checked_cell(self.ip, "%horovod stop")
            shutil.rmtree(cache, ignore_errors=True)
        return out


def np_arange(n: int):
    import numpy as np

    return np.arange(n, dtype=np.float64)  # every page written: no zero pages to hash for free


# -- summaries --------------------------------------------------------------------------------

def differences(values: list, baselines: list) -> list:
    return [v - b for v, b in zip(values, baselines) if v is not None and b is not None]


def summarize(size: dict) -> dict:
    """Medians of the extras (paired within a repeat), their ratio to the floor's median."""
    out: dict = {}
    floor = size.get("floor")
    floor_s = statistics.median(floor["total"]) if floor else None
    if floor:
        out["floor_s"] = _common.describe(floor["total"])
        out["dumps_s"] = _common.describe(floor["dumps"])
        out["two_loads_s"] = _common.describe(floor["loads"])
        out["blake3_s"] = _common.describe(floor["blake3"])
        out["xxh3_s"] = _common.describe(floor["xxh3"])

    def extra(name: str, values: list, baselines: list) -> None:
        d = _common.describe(differences(values, baselines))
        if d.get("n"):
            d["over_floor"] = d["median"] / floor_s if floor_s else None
            d["ratio_shown"] = bool(floor_s and floor_s >= RATIO_MIN_FLOOR_S)
            d["per_gib"] = d["median"] / (size["bytes"] / 2**30)
        out[name] = d

    for mode in ("local", "spark"):
        runs = size.get(mode)
        if runs:
            out[f"{mode}_baseline_s"] = _common.describe(runs["baseline"])
            extra(f"{mode}_cold", runs["cold"], runs["baseline"])
            extra(f"{mode}_warm", runs["warm"], runs["baseline"])
            out[f"{mode}_cold_naming_s"] = _common.describe(runs["cold_naming"])
            out[f"{mode}_warm_naming_s"] = _common.describe(runs["warm_naming"])
    runs = size.get("session")
    if runs:
        base = [statistics.median(b) for b in runs["baseline"]]
        out["session_baseline_s"] = _common.describe(base)
        extra("session_first", runs["first"], base)
        extra("session_unchanged", [statistics.median(s) for s in runs["unchanged"]], base)
        extra("session_changed", runs["changed"], base)
        out["session_unchanged_naming_s"] = _common.describe([n for rep in runs["unchanged_naming"] for n in rep])
        out["session_first_naming_s"] = _common.describe(runs["first_naming"])
    return out


ROWS = [  # (summary key, row title, unit)
    ("local_cold", "fresh local, cold host cache: extra", "s"),
    ("local_warm", "fresh local, warm host cache: extra", "s"),
    ("session_first", "session, first cell with X (sent): extra", "s"),
    ("session_unchanged", "session, X unchanged (nothing sent): extra", "ms"),
    ("session_changed", "session, X changed in place (sent again): extra", "s"),
    ("spark_cold", "fresh Spark, cold host cache: extra", "s"),
    ("spark_warm", "fresh Spark, warm host cache: extra", "s"),
]


def table(result: dict) -> str:
    sizes = result["sizes"]
    labels = list(sizes)
    lines = ["| | " + " | ".join(labels) + " |", "| --- |" + " --- |" * len(labels)]

    def row(title: str, cell) -> None:
        cells = []
        for name in labels:
            s = sizes[name]
            cells.append("skipped" if s.get("skipped") else cell(s.get("summary", {})))
        if any(c not in ("-", "skipped") for c in cells):
            lines.append(f"| {title} | " + " | ".join(cells) + " |")

    def stat(key: str, unit: str = "s"):
        def cell(summary: dict) -> str:
            d = summary.get(key) or {}
            if not d.get("n"):
                return "-"
            scale, fmt = (1e3, "{:.1f}") if unit == "ms" else (1, "{:.2f}")
            return fmt.format(scale * d["median"])
        return cell

    row("floor: cloudpickle.dumps + 2 pickle.loads, s", stat("floor_s"))
    for key, title, unit in ROWS:
        def cell(summary: dict, key=key, unit=unit) -> str:
            d = summary.get(key) or {}
            if not d.get("n"):
                return "-"
            scale, fmt = (1e3, "{:.1f}") if unit == "ms" else (1, "{:.2f}")
            ratio = f" ({d['over_floor']:.2f}x)" if d.get("ratio_shown") and unit == "s" else ""
            spread = f" [{fmt.format(scale * d['min'])} to {fmt.format(scale * d['max'])}]" if d["n"] > 1 else ""
            return fmt.format(scale * d["median"]) + ratio + spread
        row(f"{title}, {unit}" + (" (x floor)" if unit == "s" else "") + " [min to max]", cell)
    row("session, X unchanged: the kernel's xxh3 check (shipment.blobs_of), ms",
        stat("session_unchanged_naming_s", "ms"))
    row("fresh local, cold: the kernel naming X (BLAKE3), s", stat("local_cold_naming_s"))
    row("in-process BLAKE3 of X (naming a new buffer), s", stat("blake3_s"))
    row("in-process xxh3 of X (recognising a known one), ms", stat("xxh3_s", "ms"))
    row("1 KiB cell wall, fresh local, s", stat("local_baseline_s"))
    row("1 KiB cell wall, session, ms", stat("session_baseline_s", "ms"))
    row("1 KiB cell wall, fresh Spark, s", stat("spark_baseline_s"))
    return "\n".join(lines)


def goals(result: dict) -> list[str]:
    out = []
    sizes = {s["mib"]: s for s in result["sizes"].values()}
    for key in ("local_cold", "spark_cold", "session_first", "session_changed"):
        for mib in GOAL_SIZES:
            d = (sizes.get(mib, {}).get("summary") or {}).get(key) or {}
            if d.get("over_floor") is not None:
                out.append(f"{key} at {label(mib)}: extra {d['median']:.2f} s = {d['over_floor']:.2f}x floor, "
                           f"goal <= {GOAL_RATIO:g}x: {'met' if d['over_floor'] <= GOAL_RATIO else 'NOT met'}")
    for key in ("local_cold", "spark_cold", "session_first"):
        per_gib = [(label(mib), (s.get("summary") or {}).get(key, {}).get("per_gib")) for mib, s in sizes.items()
                   if mib >= 100]
        per_gib = [(n, v) for n, v in per_gib if v is not None]
        if len(per_gib) >= 2:
            out.append(f"{key} extra per GiB (linear growth: the same at every size): "
                       + ", ".join(f"{n} {v:.2f} s" for n, v in per_gib))
    if 2048 in sizes:
        s = sizes[2048]
        out.append("2 GiB: " + ("skipped (too little memory)" if s.get("skipped")
                                else "every cell ran, sent the right bytes and returned the right sum"))
    summary = sizes.get(1024, {}).get("summary") or {}
    d, check = summary.get("session_unchanged") or {}, summary.get("session_unchanged_naming_s") or {}
    if d.get("n"):
        ms, check_ms = 1e3 * d["median"], 1e3 * check["median"]
        out.append(f"unchanged session global at 1 GiB: extra {ms:.0f} ms (of which the kernel's xxh3 check "
                   f"{check_ms:.0f} ms), goal <= {GOAL_UNCHANGED_MS:.0f} ms: "
                   f"{'met' if ms <= GOAL_UNCHANGED_MS else 'NOT met'}")
    return out


# option: (full-run default, --quick default, help)
COUNTS = {"reps": (3, 1, "repeats of the floor and of a session's first and changed cells {}"),
          "fresh_reps": (5, 1, "repeats of the fresh cells (1 KiB, cold, warm) per size and mode {}"),
          "session_cells": (10, 2, "unchanged session cells (and as many 1 KiB ones) per repeat {}")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repeat of everything, 2 unchanged session cells")
    _common.add_counts(parser, COUNTS)
    parser.add_argument("--sizes", default="1,100,1024,2048", help="sizes of X in MiB, comma-separated")
    parser.add_argument("--spark-sizes", default="1,100,1024,2048",
                        help="the sizes also run on Spark (empty: no Spark)")
    parser.add_argument("--parts", default="floor,local,session,spark", help="comma-separated, of these four")
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench_payload.json"))
    args = parser.parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    cfg = {"quick": args.quick, **_common.counts(args, COUNTS), "parts": sorted(parts),
           "sizes_mib": [int(s) for s in args.sizes.split(",") if s.strip()],
           "spark_sizes_mib": [int(s) for s in args.spark_sizes.split(",") if s.strip()] if "spark" in parts else [],
           "command": _common.command_line()}
    import psutil
    import xxhash

    result: dict = {"config": cfg, "started": time.time(),
                    "environment": _common.environment("numpy", "cloudpickle", "blake3", "xxhash", "pyspark",
                                                       "horovod", xxhash_version=xxhash.VERSION,
                                                       temp_dir=tempfile.gettempdir()),
                    "sizes": {}}
    root = Path(tempfile.mkdtemp(prefix="bench_payload-"))  # beside the default host cache: the same file system
    spark_cache = root / "spark"
    user_cache = os.environ.get(CACHE_ENV)
    try:
        with _common.LoadMonitor() as load:
            if cfg["spark_sizes_mib"]:
                os.environ[CACHE_ENV] = str(spark_cache)  # what the Spark workers keep
                log("starting the embedded SparkSession (local[2])")
                t = time.time()
                _common.start_spark(2)
                result["spark_start_s"] = time.time() - t
            bench = Bench(root, spark_cache)
            log("warm-up: a fresh local cell" + (" and a fresh Spark cell" if cfg["spark_sizes_mib"] else ""))
            os.environ[CACHE_ENV] = str(bench.new_dir("warmup"))
            bench.cell("%%horovod --np -2\n" + BODY.format(name="Y"), bench.small, None)
            if cfg["spark_sizes_mib"]:
                bench.cell("%%horovod --np 2\n" + BODY.format(name="Y"), bench.small, None)
            for mib in cfg["sizes_mib"]:
                nbytes = mib * MiB
                name = label(mib)
                entry: dict = {"mib": mib, "bytes": nbytes}
                result["sizes"][name] = entry
                available = psutil.virtual_memory().available
                entry["available_bytes"] = available
                if available < MEMORY_FACTOR * nbytes:
                    entry["skipped"] = (f"{available / 2**30:.1f} GiB available, under {MEMORY_FACTOR}x "
                                        f"{name}")
                    log(f"{name}: skipped ({entry['skipped']})")
                    continue
                x = bench.ip.user_ns["X"] = np_arange(nbytes // 8)
                started = time.time()
                if "floor" in parts:
                    entry["floor"] = bench.floor(x, cfg["reps"])
                    log(f"{name}: floor {statistics.median(entry['floor']['total']):.3f} s "
                        f"(BLAKE3 {statistics.median(entry['floor']['blake3']):.3f} s, "
                        f"xxh3 {1e3 * statistics.median(entry['floor']['xxh3']):.1f} ms)")
                if "local" in parts:
                    log(f"{name}: fresh local cells")
                    entry["local"] = bench.fresh(x, -2, cfg["fresh_reps"], "local")
                if "session" in parts:
                    log(f"{name}: a session")
                    entry["session"] = bench.session(x, cfg["reps"], cfg["session_cells"])
                if mib in cfg["spark_sizes_mib"]:
                    log(f"{name}: fresh Spark cells")
                    entry["spark"] = bench.fresh(x, 2, cfg["fresh_reps"], "spark")
                entry["load"] = load.summary(started, time.time())
                entry["summary"] = summarize(entry)
                del x
                bench.ip.user_ns.pop("X", None)
                gc.collect()
                _common.write_json(args.out, result)  # what is done so far survives a later failure
            result["load"] = load.summary()
    finally:
        if user_cache is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = user_cache
        shutil.rmtree(root, ignore_errors=True)
    result["ended"] = time.time()
    result["table"] = table(result)
    result["goals"] = goals(result)
    path = _common.write_json(args.out, result)
    print(result["table"])
    print()
    print("\n".join(result["goals"]))
    others = result["load"].get("others_cores") if result.get("load") else None
    print(f"\nother processes' CPU: {_common.num(others)} cores on average; {time.time() - result['started']:.0f} s; "
          f"every sample: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
