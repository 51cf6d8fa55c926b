"""The same Hugging Face Trainer script in a ``%%torchrun`` cell, under ``torchrun``, ``accelerate launch``
and pyspark's ``TorchDistributor``.

One script (``TRAINER``): a GPT-2 built from a config, trained by ``transformers.Trainer`` on 2 CPU
ranks with gloo, nothing downloaded. Rank 0 stamps, with the wall clock, its script's start and the
end of each training step, and writes them with the ranks' thread counts to
``<folder>/rank0.json``. Sides, taken in turns (A B C D E F, then B C D E F A, ...: none always
first) because this machine has two cores and may be shared:

- ``cell_local``: ``%%torchrun --np -2`` in a real Jupyter kernel with widgets on, warm (its first
  cell, which starts the kernel's template, is not counted);
- ``cell_spark``: ``%%torchrun --np 2`` in the same kernel, on its embedded Spark (started by a
  warm-up cell, not counted);
- ``torchrun``: ``torchrun --nproc-per-node 2 job.py``, a cold process as it always is;
- ``accelerate``: ``accelerate launch --multi_gpu --num_processes 2 job.py`` (``--multi_gpu`` is
  accelerate's multi-process launcher, torchrun's, GPUs or not; ``--cpu`` would run one process);
- ``distributor``: a pyspark user's driver program (``DRIVER``), a cold process that starts its own
  ``local[2]`` SparkSession (on 127.0.0.1) and calls
  ``TorchDistributor(num_processes=2, local_mode=True, use_gpu=False).run(job.py, ...)``, which runs
  ``python -m torch.distributed.run --standalone --nnodes=1 --nproc_per_node=2 job.py`` (through
  pyspark's wrapper that kills it if the driver dies) on the driver, and relays its output;
- ``distributor_tasks``: the same with ``local_mode=False``: two barrier tasks on the session's
  executor (``local[2]`` has two slots) each run ``torch.distributed.run --nnodes=2
  --nproc_per_node=1`` with task 0's address and a free port as the rendezvous, so rank 0 is in
  task 0's process tree; the driver starts a log server and relays the tasks' output.

The figures per side and round:

- **throughput**: samples per second over the steps after the ``--warm-steps`` first (the
  issue's goal: the cell >= 0.98x torchrun);
- **to the first step**: from the moment the side was started (the execute request, or the
  subprocess' start) to the end of the first training step, imports, rendezvous and the
  Trainer's set-up included; **to script** is the part of it before rank 0's script began (its
  first line, before it imports torch). For the two ``distributor`` sides that clock includes the
  driver's pyspark import and its SparkSession's start (the JVM's); the driver also stamps the
  moment it calls ``run()``, and **from run()** is the time from there to the end of the first
  step, which is what a user whose session is already up waits.

Every side gets OMP_NUM_THREADS=1, torchrun's own default for several processes per node (the
distributors' ranks inherit it from the driver, through the executor on ``distributor_tasks``).
Rank 0 writes ``rank0.json`` to the folder named on the script's command line, an absolute path on
this one machine, wherever its process runs.

    .venv/bin/python benchmarks/bench_trainers.py [--rounds 3] [--steps 60] [--quick]

The table goes to stdout, every sample to ``artifacts/bench_trainers.json``.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common

BIN = Path(sys.executable).parent

# The script every side runs; FOLDER and STEPS are set before it (a global in the cell, argv in a script).
TRAINER = """
import json, os, time
STARTED = time.time()
import torch
from datasets import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

class Stamps(TrainerCallback):
    def __init__(self):
        self.ends = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.time())

torch.manual_seed(0)
config = GPT2Config(vocab_size=256, n_positions=64, n_embd=128, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
ids = ((torch.randint(0, 256, (4096, 1)) + torch.arange(64)) % 256).tolist()
args = TrainingArguments(output_dir=FOLDER, per_device_train_batch_size=16, max_steps=STEPS, learning_rate=1e-3,
                         logging_steps=10, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                         ddp_find_unused_parameters=False, dataloader_num_workers=0)
stamps = Stamps()
trainer = Trainer(model=GPT2LMHeadModel(config), args=args, callbacks=[stamps],
                  train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}))
trainer.train()
if int(os.environ.get("RANK", "0")) == 0:
    with open(os.path.join(FOLDER, "rank0.json"), "w") as out:
        json.dump({"started": STARTED, "ends": stamps.ends, "world": int(os.environ["WORLD_SIZE"]),
                   "threads": torch.get_num_threads(), "batch": args.per_device_train_batch_size}, out)
"""
SCRIPT_HEAD = "import sys\nFOLDER, STEPS = sys.argv[1], int(sys.argv[2])\n"

# A pyspark user's driver program: argv is the mode ("local" or "tasks"), then job.py, FOLDER and STEPS.
DRIVER = """
import json, os, sys, time
from pyspark.ml.torch.distributor import TorchDistributor
from pyspark.sql import SparkSession

mode, job, folder, steps = sys.argv[1:5]
spark = (SparkSession.builder.master("local[2]").config("spark.driver.host", "127.0.0.1")
         .config("spark.ui.showConsoleProgress", "false").getOrCreate())
distributor = TorchDistributor(num_processes=2, local_mode=mode == "local", use_gpu=False)
run_called = time.time()
distributor.run(job, folder, steps)
with open(os.path.join(folder, "driver.json"), "w") as out:
    json.dump({"run_called": run_called, "run_returned": time.time()}, out)
spark.stop()
"""


def figures(started: float, folder: Path, warm_steps: int) -> dict:
    stamps = json.loads((folder / "rank0.json").read_text())
    if stamps["world"] != 2:
        raise RuntimeError(f"{folder}: the script ran on {stamps['world']} process(es), not 2")
    ends = stamps["ends"]
    samples = (len(ends) - warm_steps) * stamps["batch"] * stamps["world"]
    out = {"samples_per_s": samples / (ends[-1] - ends[warm_steps - 1]), "to_first_step_s": ends[0] - started,
           "to_script_s": stamps["started"] - started, "threads": stamps["threads"], "steps": len(ends)}
    driver = folder / "driver.json"  # the distributors' driver: when it called run()
    if driver.exists():
        out["from_run_s"] = ends[0] - json.loads(driver.read_text())["run_called"]
    return out


class Sides:
    def __init__(self, steps: int, warm_steps: int):
        self.steps, self.warm_steps = steps, warm_steps
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-trainers-"))
        self.count = 0
        self.kernel = _common.Kernel(env={"OMP_NUM_THREADS": "1"}, cwd=self.tmp, name="trainer kernel")
        self.driver = self.tmp / "driver.py"
        self.driver.write_text(DRIVER)
        self.kernel.execute("%load_ext hvdmagic")
        for np in ("-2", "2"):  # the template and the embedded Spark start here, not in a timed cell
            self.cell(np)

    def folder(self) -> Path:
        self.count += 1
        folder = self.tmp / f"run{self.count}"
        folder.mkdir()
        return folder

    def cell(self, np: str) -> dict:
        folder = self.folder()
        source = f"%%torchrun --np {np}\nFOLDER, STEPS = {str(folder)!r}, {self.steps}\n{TRAINER}"
        started = time.time()
        self.kernel.execute(source, timeout=900)
        return figures(started, folder, self.warm_steps)

    def script(self, command: list[str], env: dict | None = None) -> dict:
        folder = self.folder()
        job = folder / "job.py"
        job.write_text(SCRIPT_HEAD + TRAINER)
        started = time.time()
        done = subprocess.run([*command, str(job), str(folder), str(self.steps)], cwd=folder, timeout=900,
                              env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
        return figures(started, folder, self.warm_steps)

    def run(self, side: str) -> dict:
        if side == "cell_local":
            return self.cell("-2")
        if side == "cell_spark":
            return self.cell("2")
        if side == "torchrun":
            return self.script([str(BIN / "torchrun"), "--nproc-per-node", "2"])
        if side.startswith("distributor"):
            mode = "tasks" if side == "distributor_tasks" else "local"
            # Spark's own addresses on loopback, its Python workers this interpreter (as a venv user's PATH would).
            return self.script([sys.executable, str(self.driver), mode],
                               env={"SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable})
        return self.script([str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2",
                            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"])

    def stop(self) -> None:
        self.kernel.stop()


SIDES = ["cell_local", "cell_spark", "torchrun", "accelerate", "distributor", "distributor_tasks"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warm-steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="one round of 20 steps: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warm_steps = 1, 20, 5
    if not 0 < args.warm_steps < args.steps:
        parser.error("--warm-steps must be at least 1 and below --steps")
    samples: dict[str, list[dict]] = {side: [] for side in SIDES}
    with _common.LoadMonitor() as load:
        sides = Sides(args.steps, args.warm_steps)
        try:
            for r in range(args.rounds):
                for side in _common.rotated(SIDES, r):
                    samples[side].append(sides.run(side))
                    print(f"round {r + 1} {side}: {samples[side][-1]}", flush=True)
        finally:
            sides.stop()
    table = {}
    for side in SIDES:
        throughput = [s["samples_per_s"] for s in samples[side]]
        first = [s["to_first_step_s"] for s in samples[side]]
        table[side] = {"samples_per_s": statistics.median(throughput), "to_first_step_s": statistics.median(first),
                       "to_script_s": statistics.median(s["to_script_s"] for s in samples[side]),
                       "threads": samples[side][0]["threads"]}
        if "from_run_s" in samples[side][0]:
            table[side]["from_run_s"] = statistics.median(s["from_run_s"] for s in samples[side])
    torchrun = [s["samples_per_s"] for s in samples["torchrun"]]
    for side in (s for s in SIDES if s != "torchrun"):
        ratios = _common.paired_ratios([s["samples_per_s"] for s in samples[side]], torchrun)
        table[side]["throughput_vs_torchrun"] = {"median": statistics.median(ratios), "min": min(ratios),
                                                 "max": max(ratios)}
    print(f"\n{'side':<18} {'samples/s':>10} {'x torchrun (min-max)':>22} {'to 1st step':>12} {'to script':>10} "
          f"{'from run()':>11} threads")
    for side, row in table.items():
        ratio = row.get("throughput_vs_torchrun")
        said = f"{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})" if ratio else "1"
        from_run = f"{row['from_run_s']:.2f}s" if "from_run_s" in row else "-"
        print(f"{side:<18} {row['samples_per_s']:>10.1f} {said:>22} {row['to_first_step_s']:>11.2f}s "
              f"{row['to_script_s']:>9.2f}s {from_run:>11} {row['threads']}")
    _common.write_json(Path("artifacts") / "bench_trainers.json",
                       {"environment": _common.environment("torch", "transformers", "accelerate", "pyspark"),
                        "arguments": vars(args), "load": load.summary(), "table": table, "samples": samples})


if __name__ == "__main__":
    main()
