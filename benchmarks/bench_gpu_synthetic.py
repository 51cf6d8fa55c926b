"""ResNet-50 on synthetic images, through a %%horovod cell and through horovodrun, side by side.

    python benchmarks/bench_gpu_synthetic.py [--np 1] [--json FILE]

The training loop is ours, with the parameters of horovod's examples/pytorch/pytorch_synthetic_benchmark.py
(ResNet-50, batch 64 per GPU, SGD at 0.01 x ranks, 10 warm-up batches, then 10 timed iterations of 10
batches; img/s per GPU is the mean over the iterations, with 1.96 standard deviations). Both halves run the
same function on the same machine, one after the other: the cell in an IPython shell with hvdmagic loaded
(local mode, the ranks pinned one GPU each), and ``horovodrun -np N`` on the same script
(``--rank``). scripts/gpu_check.sh runs it on a GPU machine; docs/frameworks.md has the last figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def synthetic_benchmark(batch_size: int = 64, warmup_batches: int = 10, batches_per_iter: int = 10,
                        iters: int = 10, model_name: str = "resnet50") -> dict:
    """One rank's training on random images; returns rank 0's figures (every rank computes its own)."""
    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F
    from torchvision import models

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    torch.backends.cudnn.benchmark = True
    model = getattr(models, model_name)().cuda()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    data = torch.randn(batch_size, 3, 224, 224, device="cuda")
    target = torch.randint(0, 1000, (batch_size,), device="cuda")

    def batches(count: int) -> float:
        start = time.perf_counter()
        for _ in range(count):
            optimizer.zero_grad()
            F.cross_entropy(model(data), target).backward()
            optimizer.step()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    batches(warmup_batches)
    rates = [batch_size * batches_per_iter / batches(batches_per_iter) for _ in range(iters)]
    return {"img_per_sec_per_gpu": statistics.mean(rates), "ci95": 1.96 * statistics.stdev(rates),
            "ranks": hvd.size(), "model": model_name, "batch_size": batch_size,
            "gpu": torch.cuda.get_device_name(), "nccl": bool(hvd.nccl_built())}


def through_a_cell(np: int) -> dict:
    """The function run by a %%horovod cell, as a user runs it: an IPython shell, hvdmagic loaded."""
    from IPython.core.interactiveshell import InteractiveShell

    # The ranks import this module by name, as horovodrun's do (through_horovodrun).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "hvdmagic")
    shell.run_cell("from benchmarks.bench_gpu_synthetic import synthetic_benchmark")
    start = time.perf_counter()
    outcome = shell.run_cell(f"%%horovod --np -{np}\nsynthetic_benchmark()")
    wall = time.perf_counter() - start
    if outcome.error_in_exec is not None or outcome.error_before_exec is not None:
        raise SystemExit(f"the %%horovod cell failed: {outcome.error_in_exec or outcome.error_before_exec}")
    return {**outcome.result, "wall_s": wall}


def through_horovodrun(np: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        cmd = [sys.executable, "-m", "horovod.runner.launch", "--gloo", "-np", str(np), "-H", f"localhost:{np}",
               sys.executable, __file__, "--rank", "--json", str(out)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        start = time.perf_counter()
        subprocess.run(cmd, check=True, env=env)
        return {**json.loads(out.read_text()), "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=1, help="ranks, one GPU each (default 1)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--rank", action="store_true", help="run one rank's half (what horovodrun starts)")
    args = parser.parse_args()
    if args.rank:
        figures = synthetic_benchmark()
        if os.environ.get("HOROVOD_RANK", "0") == "0" and args.json:
            Path(args.json).write_text(json.dumps(figures))
        return
    sys.path.insert(0, str(ROOT))
    results = {"%%horovod cell": through_a_cell(args.np), "horovodrun": through_horovodrun(args.np)}
    cell, runner = results["%%horovod cell"], results["horovodrun"]
    results["cell / horovodrun"] = cell["img_per_sec_per_gpu"] / runner["img_per_sec_per_gpu"]
    print(f"{cell['model']}, batch {cell['batch_size']}, {cell['ranks']} rank(s) on {cell['gpu']}:")
    for name in ("%%horovod cell", "horovodrun"):
        r = results[name]
        print(f"  {name:15} {r['img_per_sec_per_gpu']:8.1f} ± {r['ci95']:.1f} img/s per GPU "
              f"(whole run {r['wall_s']:.1f} s)")
    print(f"  ratio {results['cell / horovodrun']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
