#!/usr/bin/env bash
# One idempotent set-up for a fresh machine: Java check, Open MPI, virtualenv,
# torch, the cached horovod build, and hvdmagic itself. `make demo` and `make test` call it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HVDMAGIC_VENV:-$here/.venv}"
python="${PYTHON:-python3}"
torch_spec="${HVDMAGIC_TORCH:-torch==2.13.0}"
horovod_version="0.28.1"
extras="${HVDMAGIC_EXTRAS:-dev}"

say() { printf '[setup] %s\n' "$*"; }

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
    fi
    "$venv/bin/python" -m pip install -q --upgrade pip wheel setuptools >/dev/null
}

# The build prerequisites from DESIGN.md; horovod builds without isolation against them.
install_build_deps() {
    "$venv/bin/python" -m pip install -q "$torch_spec" numpy cloudpickle psutil pyyaml packaging cffi
}

# The wheel's cache path names everything it was built with (torch, MPI, NCCL):
# a venv holding another build of the same version gets this one instead.
install_horovod() {
    local wheel marker="$venv/.hvdmagic-horovod-wheel"
    wheel="$("$venv/bin/python" "$here/scripts/build_horovod.py" --version "$horovod_version")"
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
    say "installing hvdmagic[$extras] (editable)"
    # Pin the torch that horovod was just built against: an extra that wants another
    # torch (lightning) must fail here, not silently replace it and break horovod.
    local torch_version
    torch_version="$("$venv/bin/python" -c 'import importlib.metadata as md; print(md.version("torch"))')"
    "$venv/bin/python" -m pip install -q -c <(echo "torch==$torch_version") -e "$here[$extras]"
}

check_java
install_mpi
make_venv
install_build_deps
install_horovod
install_project
bash "$here/scripts/install_browser.sh" || say "continuing without chromium: tests/test_browser.py will fail until scripts/install_browser.sh succeeds"
say "ready: $venv"
