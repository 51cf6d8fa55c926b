"""A fitted TorchModel's ``write().save(path)`` and ``load(path)`` at the size of a large model, to a local path,
through Spark's Hadoop writer and through fsspec's, beside the floor: ``torch.save``/``torch.load`` of the same
state_dict to the same disk.

One model of ``--mb`` MB of float32 weights (one Linear layer). Each round saves and loads it once per
destination, in turn (the order rotates each round):

- ``local``: a local path (what a FUSE mount is to the driver);
- ``hadoop``: a ``viewfs://`` URL mounted on a local folder, which goes through the classic session's Hadoop
  file system (``copyFromLocalFile``), as ``hdfs://``/``s3a://``/``abfss://`` do on a cluster;
- ``fsspec``: an ``s3://`` URL on moto's S3 server on loopback, through s3fs (a laptop's Spark has no s3://);
- ``floor``: ``torch.save(state_dict)`` and ``torch.load`` of the same file, nothing else.

Per operation: the wall time and the peak of the process's resident memory above the model's own (sampled
every 5 ms): a save or load that held the weights twice shows about the model's size there.

    .venv/bin/python benchmarks/bench_model_io.py [--mb 1024] [--rounds 3] [--quick]

Every figure goes to ``artifacts/bench_model_io.json``; the table to stdout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import ROOT, Log, describe, environment, rotated, start_spark, write_json

log = Log()


class PeakMemory:
    """The peak resident memory of this process while the block runs, above its size when the block began."""

    def __init__(self):
        import psutil

        self.process, self.peak, self.base, self._done = psutil.Process(), 0, 0, threading.Event()

    def __enter__(self):
        self.base = self.peak = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def above(self) -> int:
        return self.peak - self.base


def _moto_server(folder: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=(folder / "moto.log").open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while socket.socket().connect_ex(("127.0.0.1", port)) != 0:
        if time.monotonic() > deadline or server.poll() is not None:
            raise RuntimeError(f"moto's server did not start: {(folder / 'moto.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return server, f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=None, help="the model's weights in MB (default 1024, quick 64)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 1)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    mb, rounds = args.mb or (64 if args.quick else 1024), args.rounds or (1 if args.quick else 3)

    import s3fs
    import torch

    from hvdmagic.spark.torch import TorchModel

    folder = Path(tempfile.mkdtemp(prefix="bench-model-io-"))
    server, endpoint = _moto_server(folder)
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    s3fs.S3FileSystem().mkdir("bench-model-io")
    spark = start_spark(2)
    mounted = folder / "mounted"
    mounted.mkdir()
    spark.sparkContext._jsc.hadoopConfiguration().set("fs.viewfs.mounttable.bench.link./models", mounted.as_uri())

    side = int((mb * 2**20 / 4) ** 0.5)
    torch.manual_seed(0)
    model = TorchModel(history={"loss": [1.0]}, output_sizes=[side])
    model._set(model=torch.nn.Linear(side, side, bias=False), feature_cols=["features"], label_cols=["y"])
    size = sum(t.numel() * t.element_size() for t in model.getModel().state_dict().values())
    log(f"model: {size / 2**20:.0f} MiB of weights; {rounds} round(s)")

    destinations = {"local": str(folder / "local"), "hadoop": "viewfs://bench/models/m",
                    "fsspec": "s3://bench-model-io/m", "floor": str(folder / "floor.pt")}
    times: dict = {(name, op): [] for name in destinations for op in ("save", "load")}
    memory: dict = {(name, op): [] for name in destinations for op in ("save", "load")}
    try:
        for r in range(rounds):
            for name in rotated(list(destinations), r):
                where = destinations[name]
                for op in ("save", "load"):
                    with PeakMemory() as peak:
                        started = time.perf_counter()
                        if name == "floor":
                            loaded = (torch.save(model.getModel().state_dict(), where) if op == "save"
                                      else torch.load(where, map_location="cpu"))
                        else:
                            loaded = model.write().overwrite().save(where) if op == "save" else TorchModel.load(where)
                        times[name, op].append(time.perf_counter() - started)
                    memory[name, op].append(peak.above)
                    del loaded
                    log(f"round {r + 1} {name} {op}: {times[name, op][-1]:.2f} s, "
                        f"+{peak.above / 2**20:.0f} MiB resident at the peak")
    finally:
        server.terminate()
        spark.stop()
        shutil.rmtree(folder, ignore_errors=True)

    rows = []
    print(f"\n{size / 2**20:.0f} MiB of weights, {rounds} round(s); median [min–max]\n")
    print("| destination | save | save / floor | load | load / floor | peak memory above the model, save / load |")
    print("| --- | --- | --- | --- | --- | --- |")
    floor = {op: describe(times["floor", op])["median"] for op in ("save", "load")}
    for name in destinations:
        stats = {op: describe(times[name, op]) for op in ("save", "load")}
        peaks = {op: max(memory[name, op]) / 2**20 for op in ("save", "load")}
        rows.append({"destination": name, "seconds": {op: times[name, op] for op in ("save", "load")},
                     "peak_above_model_bytes": {op: memory[name, op] for op in ("save", "load")}})
        cells = [f"{s['median']:.2f} s [{s['min']:.2f}–{s['max']:.2f}]" for s in stats.values()]
        print(f"| {name} | {cells[0]} | {stats['save']['median'] / floor['save']:.2f}× | {cells[1]} | "
              f"{stats['load']['median'] / floor['load']:.2f}× | {peaks['save']:.0f} / {peaks['load']:.0f} MiB |")
    write_json(ROOT / "artifacts" / "bench_model_io.json",
               {"environment": environment("torch", "pyspark", "s3fs", "moto"), "model_bytes": size,
                "rounds": rounds, "rows": rows})


if __name__ == "__main__":
    main()
