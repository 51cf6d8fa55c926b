"""Today's trainers on one GPU: the same script in a ``%%torchrun --np -1`` cell and under ``torchrun``.

    python benchmarks/bench_gpu_trainers.py [--rounds 2] [--steps 60] [--device cuda|cpu] [--json FILE]

Three trainers, each a script that rank 0 stamps (the wall clock at its first line and at the end of
each training step, after ``torch.cuda.synchronize()``, so that a step's stamp is the GPU's end of it):

- ``hf_bf16``: ``transformers.Trainer`` with ``bf16=True`` on a GPT-2 built from a config (6 layers,
  512 wide, 256 tokens, batch 16), nothing downloaded;
- ``deepspeed_zero2``: ``deepspeed.initialize`` with ZeRO stage 2 and bf16 on a 4-layer MLP (2048
  wide, batch 256), torch's AdamW (DeepSpeed's own would compile a CUDA op first);
- ``fsdp2``: ``fully_shard`` with NCCL and a bf16 ``MixedPrecisionPolicy`` on the same MLP.

Sides, taken in turns (the cell first in odd rounds, torchrun first in even ones):

- ``cell``: ``%%torchrun --np -1`` in a real Jupyter kernel with widgets on, warm (a first, uncounted
  cell starts its rank template);
- ``torchrun``: ``python -m torch.distributed.run --standalone --nproc-per-node 1 job.py``, cold as it
  always is.

**samples/s** is over the steps after ``--warm-steps``; **to 1st step** runs from the execute request or
the subprocess' start to the end of the first step, imports and set-up included. ``--device cpu``
runs the same on CPU with gloo and fp32, at a tenth of the sizes: a smoke run for a machine without a
GPU. scripts/gpu_check.sh runs it on a GPU machine; docs/gpu-run.md has the last figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common

# Every script starts with FOLDER, STEPS, DEVICE and BF16 set (globals in the cell, argv in a file), then STAMPS.
STAMPS = """
import json, os, time
STARTED = time.time()
import torch
ENDS = []

def stamp():
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    ENDS.append(time.time())

def write_stamps(batch):
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(FOLDER, "rank0.json"), "w") as out:
            json.dump({"started": STARTED, "ends": ENDS, "batch": batch, "world": int(os.environ["WORLD_SIZE"])}, out)
"""

# The MLP that DeepSpeed and FSDP2 train: 4 layers, 2048 wide (a tenth on CPU), built on the CPU first.
MLP = """
WIDTH, BATCH = (2048, 256) if DEVICE == "cuda" else (256, 32)
torch.manual_seed(0)
layers = [torch.nn.Linear(64, WIDTH), torch.nn.ReLU()]
for _ in range(3):
    layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))
"""

TRAINERS = {
    "hf_bf16": """
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

SCALE = 1 if DEVICE == "cuda" else 8
torch.manual_seed(0)
config = GPT2Config(vocab_size=4096, n_positions=256 // SCALE, n_embd=512 // SCALE, n_layer=6, n_head=8,
                    bos_token_id=0, eos_token_id=0)
ids = (torch.randint(0, 4096, (4096, 1)) + torch.arange(256 // SCALE)) % 4096

class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return len(ids)

    def __getitem__(self, i):
        return {"input_ids": ids[i], "labels": ids[i]}

class Stamp(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        stamp()

args = TrainingArguments(output_dir=FOLDER, per_device_train_batch_size=16, max_steps=STEPS, learning_rate=1e-3,
                         logging_steps=10, save_strategy="no", report_to=[], bf16=BF16, use_cpu=DEVICE == "cpu",
                         seed=0, dataloader_num_workers=0)
Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Rows(), callbacks=[Stamp()]).train()
write_stamps(args.per_device_train_batch_size)
""",
    "deepspeed_zero2": MLP + """
import deepspeed

config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
          "zero_optimization": {"stage": 2}, "bf16": {"enabled": BF16}, "zero_allow_untested_optimizer": True}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                       config=config)
dtype = torch.bfloat16 if BF16 else torch.float32
x = torch.randn(BATCH * 8, 64, device=engine.device)
y = x.sum(dim=1, keepdim=True)
for step in range(STEPS):
    rows = slice(step % 8 * BATCH, step % 8 * BATCH + BATCH)
    loss = torch.nn.functional.mse_loss(engine(x[rows].to(dtype)).float(), y[rows])
    engine.backward(loss)
    engine.step()
    stamp()
write_stamps(BATCH)
""",
    "fsdp2": MLP + """
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

if DEVICE == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
model = model.to(DEVICE)
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if BF16 else None, reduce_dtype=torch.float32)
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mp_policy=policy)
fully_shard(model, mp_policy=policy)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(BATCH * 8, 64, device=DEVICE)
y = x.sum(dim=1, keepdim=True)
for step in range(STEPS):
    rows = slice(step % 8 * BATCH, step % 8 * BATCH + BATCH)
    torch.nn.functional.mse_loss(model(x[rows]).float(), y[rows]).backward()
    optimizer.step()
    optimizer.zero_grad()
    stamp()
write_stamps(BATCH)
dist.destroy_process_group()
""",
}
SIDES = ["cell", "torchrun"]


def settings(folder: Path, steps: int, device: str) -> str:
    return f"FOLDER, STEPS, DEVICE, BF16 = {str(folder)!r}, {steps}, {device!r}, {device == 'cuda'}\n"


def figures(started: float, folder: Path, warm_steps: int) -> dict:
    stamps = json.loads((folder / "rank0.json").read_text())
    ends = stamps["ends"]
    samples = (len(ends) - warm_steps) * stamps["batch"] * stamps["world"]
    return {"samples_per_s": samples / (ends[-1] - ends[warm_steps - 1]), "to_first_step_s": ends[0] - started,
            "to_script_s": stamps["started"] - started, "steps": len(ends), "world": stamps["world"]}


class Sides:
    def __init__(self, steps: int, warm_steps: int, device: str):
        self.steps, self.warm_steps, self.device = steps, warm_steps, device
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-gpu-trainers-"))
        self.count = 0
        self.kernel = _common.Kernel(cwd=self.tmp, name="trainer kernel")
        self.kernel.execute("%load_ext hvdmagic")
        self.kernel.execute("%%torchrun --np -1\nimport torch\ntorch.zeros(1)", timeout=600)  # the template starts

    def folder(self) -> Path:
        self.count += 1
        folder = self.tmp / f"run{self.count}"
        folder.mkdir()
        return folder

    def run(self, trainer: str, side: str) -> dict:
        folder = self.folder()
        script = settings(folder, self.steps, self.device) + STAMPS + TRAINERS[trainer]
        started = time.time()
        if side == "cell":
            self.kernel.execute("%%torchrun --np -1\n" + script, timeout=900)
        else:
            job = folder / "job.py"
            job.write_text(script)
            done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   "--nproc-per-node", "1", str(job)], cwd=folder, timeout=900,
                                  capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"torchrun {trainer} failed ({done.returncode}):\n"
                                   f"{(done.stdout + done.stderr)[-3000:]}")
        return figures(started, folder, self.warm_steps)

    def stop(self) -> None:
        self.kernel.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warm-steps", type=int, default=10)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--trainers", default=",".join(TRAINERS), help="a comma-separated subset of them")
    parser.add_argument("--json", default="artifacts/bench_gpu_trainers.json")
    args = parser.parse_args()
    if not 0 < args.warm_steps < args.steps:
        parser.error("--warm-steps must be at least 1 and below --steps")
    trainers = args.trainers.split(",")
    if unknown := set(trainers) - set(TRAINERS):
        parser.error(f"unknown trainer(s) {sorted(unknown)}: choose from {list(TRAINERS)}")
    samples = {trainer: {side: [] for side in SIDES} for trainer in trainers}
    failed = {}
    sides = Sides(args.steps, args.warm_steps, args.device)
    try:
        for r in range(args.rounds):
            for trainer in trainers:
                if trainer in failed:
                    continue
                for side in _common.rotated(SIDES, r):
                    try:
                        samples[trainer][side].append(sides.run(trainer, side))
                    except (RuntimeError, subprocess.TimeoutExpired) as error:  # the others still run
                        failed[trainer] = f"{side}: {error}"
                        print(f"{trainer} failed on {failed[trainer]}", flush=True)
                        break
                    print(f"round {r + 1} {trainer} {side}: {samples[trainer][side][-1]}", flush=True)
    finally:
        sides.stop()
    gpu = "CPU"
    if args.device == "cuda":
        import torch
        gpu = torch.cuda.get_device_name()
    print(f"\n1 rank on {gpu}, {args.steps} steps ({args.warm_steps} warm), {args.rounds} round(s):")
    print(f"{'trainer':<16} {'side':<9} {'samples/s':>11} {'x torchrun (each round)':>24} {'to 1st step':>12}")
    table = {}
    for trainer in trainers:
        if trainer in failed:
            print(f"{trainer:<16} failed: {failed[trainer].splitlines()[0]}")
            continue
        torchrun = [s["samples_per_s"] for s in samples[trainer]["torchrun"]]
        for side in SIDES:
            rates = [s["samples_per_s"] for s in samples[trainer][side]]
            ratios = _common.paired_ratios(rates, torchrun)
            table[f"{trainer} {side}"] = row = {
                "samples_per_s": statistics.median(rates), "ratio_vs_torchrun": ratios,
                "to_first_step_s": statistics.median(s["to_first_step_s"] for s in samples[trainer][side])}
            said = " ".join(f"{ratio:.3f}" for ratio in ratios)
            print(f"{trainer:<16} {side:<9} {row['samples_per_s']:>11.1f} {said:>24} {row['to_first_step_s']:>11.2f}s")
    _common.write_json(args.json, {
        "environment": _common.environment("torch", "transformers", "deepspeed", gpu=gpu),
        "arguments": vars(args), "table": table, "samples": samples, "failed": failed})
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
