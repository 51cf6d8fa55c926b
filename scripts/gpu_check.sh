#!/usr/bin/env bash
# Everything hvdmagic checks on an NVIDIA GPU, in one run, with one Markdown report:
#
#   scripts/gpu_check.sh [REPORT_DIR]        (default artifacts/gpu)
#
# 1. builds horovod 0.28.1 with NCCL (python -m hvdmagic.build_horovod --frameworks pytorch --gpu) for this
#    Python's CUDA torch, for the GPU's own architecture, with as many jobs as cores, and installs it;
# 2. runs the gpu tier (tests/test_gpu.py: NCCL under %%horovod and %%torchrun cells, a CNN trained both
#    ways, the Hugging Face Trainer in bf16, DeepSpeed ZeRO 2 and FSDP2 with NCCL in cells, pinning, CUDA
#    touched in the kernel first, two ranks on one GPU, NVML, the flight recorder; and, where Java and pyspark
#    are on the machine, a standalone Spark worker that finds the GPU with scripts/gpu_discovery.sh, with
#    cells, the TorchDistributor drop-in, a warm session, the slot check and the torch estimator on it);
# 3. times the three trainers in a %%torchrun cell against torchrun (benchmarks/bench_gpu_trainers.py);
# 4. times ResNet-50 through a %%horovod cell and through horovodrun (benchmarks/bench_gpu_synthetic.py);
# 5. runs two ranks on the one GPU without hvdmagic (scripts/gpu_two_ranks.py): NCCL and Gloo as they are;
# and writes REPORT_DIR/report.md beside each step's log. A step that fails is reported and the next runs.
#
# Needs: nvidia-smi, CUDA's nvcc (PATH, $HOROVOD_CUDA_HOME or /usr/local/cuda), a CUDA torch with its
# nvidia-nccl wheel, torchvision, and hvdmagic's dependencies (pip install -e '.[gpu]' pytest pytest-timeout).
#   HVDMAGIC_HOROVOD_WHEEL   a horovod wheel to install if the build fails (the report says it was used)
#   GPU_CHECK_SECONDS        the whole run's budget (default 3000); each step gets a share of what is left
#   GPU_CHECK_STEPS          the steps to run (default "build tier trainers resnet two_ranks"): a machine
#                            lent for minutes runs some in one call and the rest in the next
#   GPU_CHECK_K              a pytest -k expression choosing the tier's tests, e.g. 'not watchdog'
#   GPU_CHECK_WHEELS         a folder made by scripts/gpu_wheels.sh, for a machine with no package index: its
#                            wheels and DeepSpeed's sdist are installed first (no index, no dependencies), and the
#                            build takes horovod's sdist from its src/ (docs/gpu-run.md)
set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$(mkdir -p "${1:-$here/artifacts/gpu}" && cd "${1:-$here/artifacts/gpu}" && pwd)"
python="${PYTHON:-python3}"
budget="${GPU_CHECK_SECONDS:-3000}"
report="$out/report.md"
cd "$here"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 SPARK_LOCAL_IP=127.0.0.1

steps=" ${GPU_CHECK_STEPS:-build tier trainers resnet two_ranks} "
wanted() { [[ "$steps" == *" $1 "* ]]; }
left() { echo $(( budget - SECONDS )); }
# What the wanted steps after step $1 need at least, kept back from it.
declare -A need=([tier]=170 [trainers]=120 [resnet]=60 [two_ranks]=40)
later() { local total=0 after="" step
          for step in build tier trainers resnet two_ranks; do
            [[ -n "$after" ]] && wanted "$step" && total=$(( total + ${need[$step]:-0} ))
            [[ "$step" == "$1" ]] && after=1
          done; echo "$total"; }
# A step's deadline: at most $1 seconds, and never past the budget less what later steps need ($2).
deadline() { local most=$1 reserve=$2 rest; rest=$(( $(left) - reserve )); (( rest < most )) && most=$rest
             (( most < 10 )) && most=10; echo "$most"; }
say() { printf '%s\n' "$*" >>"$report"; }
fence() { say '```'; cat "$@" >>"$report"; say '```'; }

: >"$report"
say "# hvdmagic on a GPU: scripts/gpu_check.sh, $(date -u '+%Y-%m-%d %H:%M UTC'), commit ${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
say ""
say "## Machine"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader
  echo "cores: $(nproc)"
  "$python" - <<'PY'
import platform, torch
print(f"Python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, GPUs visible to torch: {torch.cuda.device_count()}")
PY
  { command -v nvcc >/dev/null && nvcc --version || "${HOROVOD_CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version; } | tail -1
  # What Spark's GPU scheduling and TensorFlow need: the report's last section says what could not run.
  echo "java: $(command -v java >/dev/null && java -version 2>&1 | head -1 || echo none)"
  for module in pyspark tensorflow deepspeed transformers; do
    "$python" -c "import importlib.metadata as m; print('$module', m.version('$module'))" 2>/dev/null || echo "$module: none"
  done
} >"$out/machine.txt" 2>&1
fence "$out/machine.txt"; rm -f "$out/machine.txt"

if [[ -n "${GPU_CHECK_WHEELS:-}" ]]; then
  say ""
  say "Installed from $(basename "$GPU_CHECK_WHEELS")/, without an index: $(cd "$GPU_CHECK_WHEELS" && ls -- *.whl *.tar.gz | sed 's/-[0-9].*//' | sort -u | tr '\n' ' ')"
  "$python" -m pip install -q --no-index --no-deps --no-compile "$GPU_CHECK_WHEELS"/*.whl >"$out/wheels.log" 2>&1 \
    || say "**Installing the wheels failed**: see wheels.log."
  for sdist in "$GPU_CHECK_WHEELS"/*.tar.gz; do  # DeepSpeed ships no wheel: its ops are compiled when used
    [[ -e "$sdist" ]] || continue
    DS_BUILD_OPS=0 "$python" -m pip install -q --no-index --no-deps --no-build-isolation "$sdist" >>"$out/wheels.log" 2>&1 \
      || say "**Installing $(basename "$sdist") failed**: see wheels.log."
  done
  export PIP_NO_INDEX=1 PIP_FIND_LINKS="$(cd "$GPU_CHECK_WHEELS/src" && pwd)"  # the build's `pip download horovod`
fi

if wanted build; then
say ""
say "## 1. horovod's NCCL build"
start=$SECONDS
wheel=$(timeout "$(deadline 900 "$(later build)")" "$python" -m hvdmagic.build_horovod --frameworks pytorch --gpu 2>"$out/build.log")
status=$?
took=$(( SECONDS - start ))
if [[ $status -eq 0 && -f "$wheel" ]]; then
  say "Built in **${took} s** on $(nproc) cores (or reused from the cache, if build.log says so): \`$(basename "$wheel")\`, $(du -m "$wheel" | cut -f1) MB."
else
  say "**The build failed** (exit $status after ${took} s); the end of build.log:"
  tail -25 "$out/build.log" >"$out/build-tail.txt"; fence "$out/build-tail.txt"; rm -f "$out/build-tail.txt"
  wheel="${HVDMAGIC_HOROVOD_WHEEL:-}"
  [[ -n "$wheel" ]] && say "Every later step uses the given wheel instead: \`$wheel\` (HVDMAGIC_HOROVOD_WHEEL)."
fi
grep '^\[build_horovod\]' "$out/build.log" | cut -c1-400 >"$out/build-lines.txt"; fence "$out/build-lines.txt"; rm -f "$out/build-lines.txt"
if [[ -n "$wheel" ]]; then
  "$python" -m pip install -q --no-deps --no-index --force-reinstall "$wheel" >>"$out/build.log" 2>&1 \
    || say "**Installing the wheel failed**: see build.log."
fi
"$python" -c "import horovod, horovod.torch as hvd; print('horovod', horovod.__version__, 'from', horovod.__file__);
print('nccl_built', hvd.nccl_built(), 'cuda_built', hvd.cuda_built(), 'gloo_built', hvd.gloo_built(), 'mpi_built', hvd.mpi_built())" >"$out/horovod.txt" 2>&1
fence "$out/horovod.txt"; rm -f "$out/horovod.txt"
fi

if wanted tier; then
say ""
say "## 2. The gpu tier (tests/test_gpu.py), in an IPython shell with hvdmagic loaded"
start=$SECONDS
timeout "$(deadline 500 "$(later tier)")" "$python" -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -v -s -rA \
  ${GPU_CHECK_K:+-k "$GPU_CHECK_K"} --junitxml="$out/gpu-tier.xml" >"$out/gpu-tier.log" 2>&1
say "pytest exit $? after $(( SECONDS - start )) s (gpu-tier.log has every test's printed figures):"
"$python" - "$out/gpu-tier.xml" >"$out/tier.md" 2>&1 <<'PY'
import sys, xml.etree.ElementTree as ET
print("| test | outcome | s |\n| --- | --- | --- |")
for case in ET.parse(sys.argv[1]).iter("testcase"):
    bad = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
    why = "" if bad is None else f": {(bad.get('message') or '').splitlines()[0][:160]}" if bad.get("message") else ""
    print(f"| {case.get('name')} | {'passed' if bad is None else bad.tag}{why.replace('|', '/')} | {float(case.get('time', 0)):.1f} |")
PY
cat "$out/tier.md" >>"$report"; rm -f "$out/tier.md"
grep -E '^(timeline activities|horovod CNN|DDP CNN|HF Trainer bf16|DeepSpeed ZeRO-2|FSDP2|%%(horovod|torchrun) --np -?1|note before launch|outcome|NVML sample|TorchEstimator on)' \
  "$out/gpu-tier.log" | cut -c1-600 >"$out/tier-lines.txt"
fence "$out/tier-lines.txt"; rm -f "$out/tier-lines.txt"
fi

if wanted trainers; then
say ""
say "## 3. The trainers in a %%torchrun cell and under torchrun (benchmarks/bench_gpu_trainers.py)"
timeout "$(deadline 300 "$(later trainers)")" "$python" benchmarks/bench_gpu_trainers.py --json "$out/trainers.json" >"$out/trainers.log" 2>&1
say "exit $?:"
sed -n '/^1 rank on/,$p' "$out/trainers.log" >"$out/trainer-lines.txt"
[[ -s "$out/trainer-lines.txt" ]] || tail -20 "$out/trainers.log" >"$out/trainer-lines.txt"
fence "$out/trainer-lines.txt"; rm -f "$out/trainer-lines.txt"
fi

if wanted resnet; then
say ""
say "## 4. ResNet-50, batch 64: a %%horovod cell and horovodrun (benchmarks/bench_gpu_synthetic.py)"
timeout "$(deadline 200 "$(later resnet)")" "$python" benchmarks/bench_gpu_synthetic.py --json "$out/synthetic.json" >"$out/synthetic.log" 2>&1
say "exit $?:"
grep -E 'rank\(s\) on|img/s per GPU|ratio|Error' "$out/synthetic.log" >"$out/bench-lines.txt"; fence "$out/bench-lines.txt"; rm -f "$out/bench-lines.txt"
fi

if wanted two_ranks; then
say ""
say "## 5. Two ranks on one GPU, without hvdmagic"
: >"$out/two-ranks.log"
probe() {  # name, then the command
  local name=$1 code; shift
  echo "### $name: $*" >>"$out/two-ranks.log"
  timeout "$(deadline 40 0)" "$@" >>"$out/two-ranks.log" 2>&1; code=$?
  say "- **$name**: exit $code$([[ $code -eq 124 ]] && echo ' (still running after 40 s: a hang)')"
}
probe "horovod, NCCL" "$python" -m horovod.runner.launch --gloo -np 2 -H localhost:2 "$python" scripts/gpu_two_ranks.py horovod
probe "torch.distributed, nccl" "$python" -m torch.distributed.run --standalone --nproc-per-node 2 scripts/gpu_two_ranks.py nccl
probe "torch.distributed, gloo" "$python" -m torch.distributed.run --standalone --nproc-per-node 2 scripts/gpu_two_ranks.py gloo
grep -E '^### |allreduce of a CUDA tensor gave|Error|error|Duplicate|invalid|WARNING' "$out/two-ranks.log" | cut -c1-300 | head -40 >"$out/two-lines.txt"
fence "$out/two-lines.txt"; rm -f "$out/two-lines.txt"
fi

say ""
say "## Not run here"
say "- Steps left out of this call (GPU_CHECK_STEPS):$(for step in build tier trainers resnet two_ranks; do wanted $step || printf ' %s' $step; done)"
say "- More than one GPU: NCCL between ranks, and pinning of several ranks (tests/test_magic_local.py checks that on a fake nvidia-smi)."
say "- Spark on the GPU (the tier's gpu_cluster tests) where the machine section says java or pyspark: none; they are skipped"
say "  (tests/test_cluster.py checks Spark's GPU path with a fake discovery script)."
say "- TensorFlow and Keras on the GPU: no step runs them yet (docs/frameworks.md says what has run on a GPU)."
say ""
say "Whole run: ${SECONDS} s."
echo "report: $report"
