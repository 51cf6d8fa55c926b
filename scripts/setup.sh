#!/usr/bin/env bash
# One idempotent set-up for a fresh machine: Java check, Open MPI, virtualenv, torch,
# TensorFlow with Keras 2, the cached horovod build, and hvdmagic itself. `make demo` and
# `make test` call it. docs/frameworks.md says which versions and why.
#
#   HVDMAGIC_VENV        the virtualenv (default: .venv beside this repository)
#   HVDMAGIC_CACHE       where the horovod wheel and the JVM's class-data archive are cached
#                        (default: ~/.cache)
#   HVDMAGIC_TORCH       torch requirement (default torch==2.13.0, the CPU wheel here)
#   HVDMAGIC_TENSORFLOW  TensorFlow requirement (default tensorflow-cpu==2.21.0), or "none":
#                        no TensorFlow, and horovod is built for PyTorch only
#   HVDMAGIC_TF_KERAS    tf-keras requirement (default: the one matching TensorFlow, for
#                        TF >= 2.16), or "none"
#   HVDMAGIC_NUMPY, HVDMAGIC_PYARROW   their requirements (defaults below resolve together)
#   HVDMAGIC_EXTRAS      hvdmagic's extras (default dev,spark)
#   HVDMAGIC_DEEPSPEED   DeepSpeed requirement with the dev extras (default deepspeed==0.19.8), or "none"
#   HVDMAGIC_LOCK        the constraints every pip install here obeys (docs/dependencies.md):
#                        requirements/lock.txt (default; `make lock` writes it), another file,
#                        "none" (only the specs above and pyproject.toml's ranges), or "latest": no
#                        lock, every package upgraded to the newest those allow, numpy and pyarrow
#                        unpinned (`make test-latest`). A HVDMAGIC_TORCH/TENSORFLOW/TF_KERAS/NUMPY/
#                        PYARROW setting takes its package out of the lock; the rest stays locked.
#
#   scripts/setup.sh tools   only the virtualenv and uv (`make lock` needs no more)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HVDMAGIC_VENV:-$here/.venv}"
python="${PYTHON:-python3}"
# These defaults are requirements/lock.in's too: change both, then `make lock`.
torch_spec="${HVDMAGIC_TORCH:-torch==2.13.0}"
# tensorflow-cpu, not tensorflow: the same TF without the CUDA libraries (a fifth of the size).
tensorflow_spec="${HVDMAGIC_TENSORFLOW:-tensorflow-cpu==2.21.0}"
tf_keras_spec="${HVDMAGIC_TF_KERAS:-}"
# TensorFlow 2.21 wants numpy >= 1.26, and pyarrow >= 16 is built for numpy 2 (26 needs it).
numpy_spec="${HVDMAGIC_NUMPY:-numpy==2.4.6}"
pyarrow_spec="${HVDMAGIC_PYARROW:-pyarrow==26.0.1}"
horovod_version="0.28.1"
extras="${HVDMAGIC_EXTRAS:-dev,spark}"
deepspeed_spec="${HVDMAGIC_DEEPSPEED:-deepspeed==0.19.8}"

say() { printf '[setup] %s\n' "$*"; }

lock_mode="${HVDMAGIC_LOCK:-$here/requirements/lock.txt}"
# What pip gets: -c with the lock (less what an override replaces), --upgrade for "latest".
lock_args=()
upgrade_args=()
case "$lock_mode" in
    none) ;;
    latest)
        upgrade_args=(--upgrade --upgrade-strategy eager)
        # Only the frameworks horovod is built for stay pinned.
        numpy_spec="${HVDMAGIC_NUMPY:-numpy}"
        pyarrow_spec="${HVDMAGIC_PYARROW:-pyarrow}"
        ;;
    *)
        if [ ! -f "$lock_mode" ]; then
            say "HVDMAGIC_LOCK: no file $lock_mode ('make lock' writes requirements/lock.txt; HVDMAGIC_LOCK=none goes without)" >&2
            exit 1
        fi
        lock_args=(-c "$venv/.hvdmagic-constraints.txt")
        ;;
esac

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

# Optional Debian packages, where we may install them (root with apt-get): apt_optional WHAT
# PACKAGES IF_FAILED IF_NOT_ALLOWED, each message saying what is lost without them.
apt_optional() {
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
        say "installing $1 (apt-get install $2)"
        # shellcheck disable=SC2086  # $2 is a list of packages
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $2 >/dev/null || say "$3"
    else
        say "$4"
    fi
}

# The MPI controller (--controller mpi). Gloo needs none of it, so a machine where we may not
# install it only loses that option.
install_mpi() {
    command -v mpirun >/dev/null 2>&1 && command -v mpicxx >/dev/null 2>&1 && return
    apt_optional "Open MPI for --controller mpi" "openmpi-bin libopenmpi-dev" \
        "could not install Open MPI: horovod is built with Gloo only, and --controller mpi is unavailable" \
        "Open MPI not found: horovod is built with Gloo only (install openmpi-bin and libopenmpi-dev, then re-run, for --controller mpi)"
}

# pandoc, which nbconvert's AsciiDoc export needs for any HTML output (the snapshot's);
# tests/test_frontends.py exports a notebook with it. Nothing of hvdmagic itself needs it.
install_pandoc() {
    command -v pandoc >/dev/null 2>&1 && return
    apt_optional "pandoc for nbconvert's AsciiDoc export" pandoc \
        "could not install pandoc: the AsciiDoc export test is skipped" \
        "pandoc not found: the AsciiDoc export test is skipped (install pandoc, then re-run)"
}

# For the tests only: iptables, with which tests/test_network_faults.py blackholes and drops the
# packets of a job's connections inside its own network namespace (ss -K, from iproute2, resets them).
install_iptables() {
    command -v iptables >/dev/null 2>&1 && return
    apt_optional "iptables for the network-fault tests" iptables \
        "could not install iptables: the network-fault tests will fail" \
        "iptables not found: the network-fault tests need it, and root"
}

# pip's arguments: the lock's, then the upgrade's, then the caller's. (Empty arrays expand
# to nothing, also under set -u of bash < 4.4.)
pip_install() {
    "$venv/bin/python" -m pip install -q ${lock_args[@]+"${lock_args[@]}"} ${upgrade_args[@]+"${upgrade_args[@]}"} "$@"
}

# The lock as pip's constraints, less the packages a HVDMAGIC_* setting replaces: written
# into the virtualenv on every run (the stamp of install_project hashes it).
write_constraints() {
    [ ${#lock_args[@]} -gt 0 ] || return 0
    local dropped=() pattern
    [ -z "${HVDMAGIC_TORCH:-}" ] || dropped+=(torch)
    if [ -n "${HVDMAGIC_TENSORFLOW:-}" ] && [ "$HVDMAGIC_TENSORFLOW" != none ]; then
        dropped+=(tensorflow-cpu tensorflow tf-keras)
    fi
    if [ -n "${HVDMAGIC_TF_KERAS:-}" ] && [ "$HVDMAGIC_TF_KERAS" != none ]; then dropped+=(tf-keras); fi
    [ -z "${HVDMAGIC_NUMPY:-}" ] || dropped+=(numpy)
    [ -z "${HVDMAGIC_PYARROW:-}" ] || dropped+=(pyarrow)
    pattern='^$'  # matches no requirement line
    if [ ${#dropped[@]} -gt 0 ]; then
        pattern="^($(IFS='|'; echo "${dropped[*]}"))=="
        say "not locking ${dropped[*]} (set by HVDMAGIC_*); the rest of $lock_mode applies (HVDMAGIC_LOCK=none if pip finds a conflict)"
    fi
    { grep -E '^[A-Za-z0-9]' "$lock_mode" | grep -v -i -E "$pattern" || true; } > "$venv/.hvdmagic-constraints.txt"
}

make_venv() {
    local new=""
    if [ ! -x "$venv/bin/python" ]; then
        say "creating virtualenv $venv"
        "$python" -m venv "$venv"
        printf '*\n' > "$venv/.gitignore"  # as Python >= 3.13 does: git ignores it wherever it is
        new=1
    fi
    write_constraints
    if [ -n "$new" ]; then
        pip_install --upgrade pip wheel setuptools >/dev/null
    fi
}

# uv, the lock's resolver (`make lock`), pinned by the lock like everything else.
tools=(uv)

# The version of an installed distribution, or nothing.
installed() {
    "$venv/bin/python" - "$1" <<'PY' 2>/dev/null || true
import importlib.metadata as md, sys
print(md.version(sys.argv[1]))
PY
}

# The frameworks and build prerequisites; horovod builds without isolation against them.
install_build_deps() {
    local specs=("$torch_spec" "$numpy_spec" "$pyarrow_spec" cloudpickle psutil pyyaml packaging cffi wheel setuptools "${tools[@]}")
    command -v cmake >/dev/null 2>&1 || specs+=(cmake)
    if with_tensorflow; then specs+=("$tensorflow_spec"); fi
    say "installing ${specs[*]}"
    pip_install "${specs[@]}"
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
        pip_install --no-deps "$tf_keras_spec"
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
    if [ -f "$marker" ] && "$venv/bin/python" -c 'import horovod' 2>/dev/null; then
        local installed_wheel
        installed_wheel="$(cat "$marker")"
        # The same file under another cache path (a moved cache, a renamed key) needs no reinstall.
        if [ "$installed_wheel" = "$wheel" ] || { [ -f "$installed_wheel" ] && cmp -s "$installed_wheel" "$wheel"; }; then
            [ "$installed_wheel" = "$wheel" ] || echo "$wheel" > "$marker"
            say "horovod $horovod_version already installed ($wheel)"
            return
        fi
    fi
    say "installing $wheel"
    "$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$wheel"
    pip_install cloudpickle psutil pyyaml packaging cffi
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
    # Nothing to do when the same hvdmagic (its pyproject.toml), extras, pins and lock are
    # installed; "latest" always asks the index for newer versions.
    want="$({ printf '%s\n%s\n%s\n' "$extras" "$pins" "$lock_mode"
              if [ ${#lock_args[@]} -gt 0 ]; then cat "$venv/.hvdmagic-constraints.txt"; fi
              cat "$here/pyproject.toml"; } \
        | "$venv/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
    if [ "$lock_mode" != latest ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
        && [ "$("$venv/bin/python" -c 'import hvdmagic, os; print(os.path.dirname(hvdmagic.__file__))' 2>/dev/null)" = "$here/hvdmagic" ]; then
        say "hvdmagic[$extras] already installed (editable)"
        return
    fi
    say "installing hvdmagic[$extras] (editable)"
    pip_install -c <(printf '%s' "$pins") -e "$here[$extras]"
    echo "$want" > "$stamp"
}

# DeepSpeed publishes only a source distribution, whose build imports torch: it is built here
# without isolation against the virtualenv's torch (as horovod is), its ops left to compile on
# first use (DS_BUILD_OPS=0; on a CPU, its shared-memory op for gloo, once per machine). Its
# dependencies are the lock's. With the dev extras only: tests/test_trainers.py trains with it.
install_deepspeed() {
    [ "$deepspeed_spec" != none ] || return 0
    case ",$extras," in *,dev,*) ;; *) return 0 ;; esac
    if [ "$(installed deepspeed)" = "${deepspeed_spec#deepspeed==}" ]; then
        say "$deepspeed_spec already installed"
        return
    fi
    say "installing $deepspeed_spec (built against the virtualenv's torch)"
    DS_BUILD_OPS=0 pip_install --no-build-isolation "$deepspeed_spec"
    # Compiled now rather than by the first DeepSpeed cell's ranks, which would wait for it.
    say "compiling DeepSpeed's communication op for this virtualenv's torch (once: a minute or two)"
    "$venv/bin/python" -c 'from deepspeed.accelerator import get_accelerator
builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
builder is None or builder.load()' >/dev/null 2>&1 || say "could not compile it now: the first DeepSpeed cell will"
}

# tests/test_tracebacks.py runs again under the oldest cloudpickle that pyproject.toml allows, put
# first on PYTHONPATH: its releases change what they write (3.1.3 renamed every shipped code's file).
install_oldest_cloudpickle() {
    local target="$venv/oldest-cloudpickle" floor
    floor="$(sed -n 's/^ *"cloudpickle>=\([0-9.]*\)".*/\1/p' "$here/pyproject.toml")"
    if [ -z "$floor" ]; then
        say "pyproject.toml names no cloudpickle floor: tests/test_tracebacks.py cannot test the oldest"
        return 1
    fi
    # PEP 440 pads with zeros: the floor ">=3" is release 3.0.0.
    if [ -n "$(compgen -G "$target/cloudpickle-$floor*.dist-info")" ]; then
        return 0
    fi
    say "installing cloudpickle==$floor into $target (the oldest allowed, for tests/test_tracebacks.py)"
    rm -rf "$target"
    "$venv/bin/python" -m pip install -q --no-deps --target "$target" "cloudpickle==$floor"
}

# tests/test_versions.py gives one Spark worker's executors a Python of their own: a second
# virtualenv with the lock's pins for what a task needs up to the version check, less one: the
# oldest cloudpickle allowed. hvdmagic is the repository's, editable, so the task runs this code.
# Rebuilt only when the pins, the repository's place or hvdmagic's version change (the stamp).
# pip, not uv, installs: pyspark is published as a source archive only, and pip reuses the wheel it
# built for this virtualenv (about 10 s); uv builds its own from a 450 MB download (20-50 s here).
install_oldest_cloudpickle_venv() {
    local target="$venv/oldest-cloudpickle-venv" stamp floor pins want
    local packages=(pyspark py4j cloudpickle psutil)
    stamp="$target/.hvdmagic-stamp"
    floor="$(sed -n 's/^ *"cloudpickle>=\([0-9.]*\)".*/\1/p' "$here/pyproject.toml")"
    [ -n "$floor" ] || { say "pyproject.toml names no cloudpickle floor: tests/test_versions.py cannot test it"; return 1; }
    if [ ${#lock_args[@]} -gt 0 ]; then
        pins="$(grep -i -v '^cloudpickle==' "$venv/.hvdmagic-constraints.txt")"
    else  # no lock: the kernel's own versions
        pins="$(for name in "${packages[@]}"; do printf '%s==%s\n' "$name" "$(installed "$name")"; done \
                | grep -v -e '^cloudpickle==' -e '==$')"
    fi
    pins+=$'\n'"cloudpickle==$floor"
    want="$(printf '%s\n%s\n%s\n%s\n' "$pins" "${packages[*]}" "$here" "$(grep -m1 '^version' "$here/pyproject.toml")" \
        | "$venv/bin/python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())')"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$target/bin/python" ]; then
        return 0
    fi
    say "building $target: ${packages[*]} as pinned, cloudpickle==$floor (for tests/test_versions.py)"
    rm -rf "$target"
    "$venv/bin/uv" venv -q --python "$venv/bin/python" "$target"
    printf '%s\n' "$pins" > "$target/.hvdmagic-constraints.txt"
    "$venv/bin/python" -m pip --python "$target/bin/python" install -q -c "$target/.hvdmagic-constraints.txt" \
        "${packages[@]}"
    "$venv/bin/python" -m pip --python "$target/bin/python" install -q --no-deps -e "$here"
    echo "$want" > "$stamp"
}

# For `make test-latest`: what differs from the lock, the first suspects when tests fail.
report_latest() {
    [ "$lock_mode" = latest ] && [ -f "$here/requirements/lock.txt" ] || return 0
    "$venv/bin/python" - "$here/requirements/lock.txt" <<'PY'
import importlib.metadata as md, re, sys
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
locked = {norm(m[1]): m[2] for m in re.finditer(r"^([A-Za-z0-9][\w.-]*)==(\S+)", open(sys.argv[1]).read(), re.M)}
newer, new = [], []
for dist in md.distributions():
    name = norm(dist.metadata["Name"] or "")
    if name in ("", "pip", "horovod", "hvdmagic"):
        continue
    if name not in locked:
        new.append(f"{name} {dist.version}")
    elif locked[name] != dist.version:
        newer.append(f"{name} {locked[name]} -> {dist.version}")
print("[setup] not as requirements/lock.txt has them: " + (", ".join(sorted(newer)) or "none"))
print("[setup] not in requirements/lock.txt: " + (", ".join(sorted(new)) or "none"))
PY
}

if [ "${1:-}" = tools ]; then
    make_venv
    pip_install "${tools[@]}"
    say "ready: $venv/bin/uv"
    exit 0
fi
check_java
install_mpi
install_pandoc
install_iptables
make_venv
install_build_deps
install_horovod
install_project
install_deepspeed
install_oldest_cloudpickle
install_oldest_cloudpickle_venv
report_latest
# The embedded Spark's class-data archive, once per Java and pyspark: the first Spark cell of each
# kernel then starts in about 60% of the time (hvdmagic/launch/jvm_archive.py says why).
"$venv/bin/python" -m hvdmagic.build_jvm_archive || say "continuing without the class-data archive: Spark starts slower"
bash "$here/scripts/install_browser.sh" || say "continuing without chromium: tests/test_browser.py will fail until scripts/install_browser.sh succeeds"
say "ready: $venv"
