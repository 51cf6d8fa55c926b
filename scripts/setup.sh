#!/usr/bin/env bash
# One idempotent set-up for a fresh machine: Java check, Open MPI, virtualenv, torch,
# TensorFlow with Keras 2, the cached horovod build, and hvdmagic itself. `make demo` and
# `make test` call it. docs/frameworks.md says which versions and why.
#
#   HVDMAGIC_VENV        the virtualenv (default: .venv beside this repository)
#   HVDMAGIC_CACHE       where the horovod wheel is cached (default: ~/.cache)
#   HVDMAGIC_TORCH       torch requirement (default torch==2.13.0, the CPU wheel here)
#   HVDMAGIC_TENSORFLOW  TensorFlow requirement (default tensorflow-cpu==2.21.0), or "none":
#                        no TensorFlow, and horovod is built for PyTorch only
#   HVDMAGIC_TF_KERAS    tf-keras requirement (default: the one matching TensorFlow, for
#                        TF >= 2.16), or "none"
#   HVDMAGIC_NUMPY, HVDMAGIC_PYARROW   their requirements (defaults below resolve together)
#   HVDMAGIC_EXTRAS      hvdmagic's extras (default dev)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HVDMAGIC_VENV:-$here/.venv}"
python="${PYTHON:-python3}"
torch_spec="${HVDMAGIC_TORCH:-torch==2.13.0}"
# tensorflow-cpu, not tensorflow: the same TF without the CUDA libraries (a fifth of the size).
tensorflow_spec="${HVDMAGIC_TENSORFLOW:-tensorflow-cpu==2.21.0}"
tf_keras_spec="${HVDMAGIC_TF_KERAS:-}"
# TensorFlow 2.21 wants numpy >= 1.26, and pyarrow >= 16 is built for numpy 2 (26 needs it).
numpy_spec="${HVDMAGIC_NUMPY:-numpy==2.4.6}"
pyarrow_spec="${HVDMAGIC_PYARROW:-pyarrow==26.0.1}"
horovod_version="0.28.1"
extras="${HVDMAGIC_EXTRAS:-dev}"

say() { printf '[setup] %s\n' "$*"; }

with_tensorflow() { [ "$tensorflow_spec" != "none" ]; }

install_java() {
    # Only where we are allowed to: root on a Debian/Ubuntu machine.
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        say "installing Java 17 for Spark (apt-get install openjdk-17-jre-headless)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null
    fi
}

check_java() {
    local version major
    command -v java >/dev/null 2>&1 || install_java
    if ! command -v java >/dev/null 2>&1; then
        say "Java was not found. Spark needs Java 17 or newer."
        say "Install it with 'apt-get install -y openjdk-17-jre-headless' (Debian/Ubuntu),"
        say "'brew install openjdk@17' (macOS), or point JAVA_HOME at an existing JDK."
        say "Local mode (%%horovod --np -N) works without Java."
        exit 1
    fi
    version="$(java -version 2>&1 | awk -F'"' '/version/ {print $2; exit}')"
    major="${version%%.*}"
    if [ "$major" = "1" ]; then major="$(echo "$version" | cut -d. -f2)"; fi
    if [ "${major:-0}" -lt 17 ]; then
        say "Java $version was found, but Spark 4 needs Java 17 or newer."
        say "Install a newer JDK (e.g. 'apt-get install -y openjdk-17-jre-headless') and put it first on PATH."
        exit 1
    fi
}

# Optional: the MPI controller (--controller mpi). Gloo needs none of it, so a
# machine where we may not install it only loses that option.
install_mpi() {
    command -v mpirun >/dev/null 2>&1 && command -v mpicxx >/dev/null 2>&1 && return
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        say "installing Open MPI for --controller mpi (apt-get install openmpi-bin libopenmpi-dev)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null \
            || say "could not install Open MPI: horovod is built with Gloo only, and --controller mpi is unavailable"
    else
        say "Open MPI not found: horovod is built with Gloo only (install openmpi-bin and libopenmpi-dev, then re-run, for --controller mpi)"
    fi
}

make_venv() {
    if [ ! -x "$venv/bin/python" ]; then
        say "creating virtualenv $venv"
        "$python" -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip wheel setuptools >/dev/null
    fi
}

# The version of an installed distribution, or nothing.
installed() {
    "$venv/bin/python" - "$1" <<'PY' 2>/dev/null || true
import importlib.metadata as md, sys
print(md.version(sys.argv[1]))
PY
}

# The frameworks and build prerequisites; horovod builds without isolation against them.
install_build_deps() {
    local specs=("$torch_spec" "$numpy_spec" "$pyarrow_spec" cloudpickle psutil pyyaml packaging cffi wheel setuptools)
    command -v cmake >/dev/null 2>&1 || specs+=(cmake)
    if with_tensorflow; then specs+=("$tensorflow_spec"); fi
    say "installing ${specs[*]}"
    "$venv/bin/python" -m pip install -q "${specs[@]}"
    with_tensorflow || return 0
    # Keras 2 for horovod.tensorflow.keras (under Keras 3 its DistributedOptimizer does
    # not average). --no-deps: tf-keras requires `tensorflow`, which would pull the full
    # 572 MB build on top of tensorflow-cpu.
    if [ -z "$tf_keras_spec" ]; then
        local tf_version
        tf_version="$("$venv/bin/python" -c 'import importlib.metadata as md, sys
for name in ("tensorflow-cpu", "tensorflow"):
    try:
        print(md.version(name)); sys.exit()
    except md.PackageNotFoundError:
        pass')"
        case "$tf_version" in
            2.1[0-5].*|1.*) tf_keras_spec=none ;;  # Keras 2 is TensorFlow's own
            *) tf_keras_spec="tf-keras~=$(echo "$tf_version" | cut -d. -f1-2).0" ;;
        esac
    fi
    if [ "$tf_keras_spec" != "none" ]; then
        "$venv/bin/python" -m pip install -q --no-deps "$tf_keras_spec"
    fi
}

# The wheel's cache path names everything it was built with (torch, TensorFlow, MPI,
# NCCL, the patches): a venv holding another build of the same version gets this one instead.
install_horovod() {
    local wheel frameworks=pytorch marker="$venv/.hvdmagic-horovod-wheel"
    if with_tensorflow; then frameworks=pytorch,tensorflow; fi
    # By path: it needs only the standard library, and hvdmagic is installed after it.
    wheel="$(PATH="$venv/bin:$PATH" "$venv/bin/python" "$here/hvdmagic/build_horovod.py" \
        --version "$horovod_version" --frameworks "$frameworks")"
    if [ -f "$marker" ] && [ "$(cat "$marker")" = "$wheel" ] && "$venv/bin/python" -c 'import horovod' 2>/dev/null; then
        say "horovod $horovod_version already installed ($wheel)"
        return
    fi
    say "installing $wheel"
    "$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$wheel"
    "$venv/bin/python" -m pip install -q cloudpickle psutil pyyaml packaging cffi
    echo "$wheel" > "$marker"
}

install_project() {
    # Pin what horovod was just built against, and numpy/pyarrow: an extra that wants
    # another torch (lightning) or numpy must fail here, not silently replace it and break horovod.
    local pins name version stamp="$venv/.hvdmagic-project" want
    pins=""
    for name in torch numpy pyarrow tensorflow-cpu tensorflow tf-keras; do
        version="$(installed "$name")"
        if [ -n "$version" ]; then pins+="$name==$version"$'\n'; fi
    done
    # Nothing to do when the same hvdmagic (its pyproject.toml), extras and pins are installed.
    want="$({ printf '%s\n%s\n' "$extras" "$pins"; cat "$here/pyproject.toml"; } \
        | "$venv/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
        && [ "$("$venv/bin/python" -c 'import hvdmagic, os; print(os.path.dirname(hvdmagic.__file__))' 2>/dev/null)" = "$here/hvdmagic" ]; then
        say "hvdmagic[$extras] already installed (editable)"
        return
    fi
    say "installing hvdmagic[$extras] (editable)"
    "$venv/bin/python" -m pip install -q -c <(printf '%s' "$pins") -e "$here[$extras]"
    echo "$want" > "$stamp"
}

check_java
install_mpi
make_venv
install_build_deps
install_horovod
install_project
bash "$here/scripts/install_browser.sh" || say "continuing without chromium: tests/test_browser.py will fail until scripts/install_browser.sh succeeds"
say "ready: $venv"
