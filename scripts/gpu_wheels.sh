#!/usr/bin/env bash
# What a GPU machine without a package index lacks for scripts/gpu_check.sh, fetched here into one folder:
#
#   scripts/gpu_wheels.sh [FOLDER]            (default .whl; about 25 MB)
#   then, on the GPU machine:  GPU_CHECK_WHEELS=FOLDER scripts/gpu_check.sh
#
# - wheels for CPython $GPU_PYTHON (default 3.12) on x86-64 Linux, at requirements/lock.txt's versions:
#   hvdmagic's own dependencies, a Jupyter kernel for the benchmarks, DeepSpeed's pure-Python needs, and
#   cffi for horovod's build;
# - DeepSpeed's sdist (it ships no wheel; gpu_check.sh installs it with DS_BUILD_OPS=0, ops compiled when used);
# - horovod's sdist in FOLDER/src, where hvdmagic.build_horovod's download finds it (gpu_check.sh points
#   PIP_FIND_LINKS there).
# What the machine's image has (torch, transformers, accelerate, numpy, pandas, pyarrow, psutil, cloudpickle,
# xxhash, pytest) is not fetched: the list is what this workplace's 'cuda' image lacked on 2026-11-29
# (docs/gpu-run.md).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
folder="${1:-$here/.whl}"
python_version="${GPU_PYTHON:-3.12}"
lock="$here/requirements/lock.txt"

wheels=(ipython ipython-pygments-lexers traitlets jedi parso prompt-toolkit wcwidth pexpect ptyprocess
        matplotlib-inline stack-data asttokens executing pure-eval ipywidgets comm widgetsnbextension
        jupyterlab-widgets nbformat fastjsonschema jsonschema jsonschema-specifications referencing rpds-py
        jupyter-core platformdirs blake3 ipykernel jupyter-client pyzmq tornado debugpy nest-asyncio2
        hjson pydantic pydantic-core annotated-types typing-inspection cffi pycparser)

pinned() {  # NAME==VERSION from the lock, or NAME alone where the lock has none
    local line
    line=$(grep -iE "^$1==" "$lock" || true)
    echo "${line:-$1}"
}

mkdir -p "$folder/src"
specs=()
for name in "${wheels[@]}"; do specs+=("$(pinned "$name")"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$folder" "${specs[@]}"
# scripts/setup.sh's DeepSpeed and hvdmagic.build_horovod's horovod.
python3 -m pip download -q --no-deps --no-binary=:all: -d "$folder" deepspeed==0.19.8
python3 -m pip download -q --no-deps --no-binary=:all: -d "$folder/src" horovod==0.28.1
echo "$(ls "$folder" | wc -l) files, $(du -sh "$folder" | cut -f1), in $folder"
