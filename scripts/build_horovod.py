"""Build (or reuse) a horovod wheel that works with the installed torch.

horovod 0.28.1's CMakeLists pins C++14, but torch >= 2.1 headers need C++17.
We build with a compiler wrapper that rewrites the flag, and keep the wheel in
the user's cache keyed by everything that changes the binary, so only the first
set-up on a machine pays the ~6 minute build. Prints the wheel's path on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

BUILD_FLAGS = {
    "HOROVOD_WITH_PYTORCH": "1",
    "HOROVOD_WITH_GLOO": "1",
    "HOROVOD_WITHOUT_TENSORFLOW": "1",
    "HOROVOD_WITHOUT_MXNET": "1",
    "HOROVOD_WITHOUT_MPI": "1",
}

WRAPPER = """#!/bin/sh
# horovod 0.28.1 asks for C++14; torch's headers need C++17.
for a in "$@"; do
  shift
  case "$a" in -std=c++14|-std=gnu++14) a=-std=c++17 ;; esac
  set -- "$@" "$a"
done
exec {cxx} "$@"
"""


def log(msg: str) -> None:
    print(f"[build_horovod] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    base = os.environ.get("HVDMAGIC_CACHE") or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hvdmagic" / "wheels"


def cache_key(version: str, flags: dict[str, str]) -> str:
    import torch  # the build links against it, so its exact version is part of the key

    ident = {
        "horovod": version,
        "torch": torch.__version__,
        "python": sysconfig.get_python_version(),
        "platform": sysconfig.get_platform(),
        "flags": flags,
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return f"horovod-{version}-torch-{torch.__version__}-py{sysconfig.get_python_version()}-{digest}"


def build(version: str, flags: dict[str, str], dest: Path) -> Path:
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if not cxx:
        sys.exit("[build_horovod] no C++ compiler found: install g++ (e.g. 'apt-get install -y g++') and cmake.")
    if not shutil.which("cmake"):
        sys.exit("[build_horovod] cmake was not found: install it (e.g. 'apt-get install -y cmake' or 'pip install cmake').")
    with tempfile.TemporaryDirectory(prefix="hvd-build-") as tmp:
        wrapper = Path(tmp) / "cxx17"
        wrapper.write_text(WRAPPER.format(cxx=cxx))
        wrapper.chmod(0o755)
        env = dict(os.environ, **flags, CXX=str(wrapper))
        env.setdefault("MAKEFLAGS", f"-j{os.cpu_count() or 2}")
        out = Path(tmp) / "wheel"
        log(f"building horovod {version} (takes several minutes; later set-ups reuse the cached wheel)")
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
               "--no-binary", "horovod", "-w", str(out), f"horovod=={version}"]
        result = subprocess.run(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr)
        if result.returncode != 0:
            sys.exit(f"[build_horovod] the horovod build failed (exit {result.returncode}); see the compiler output above.")
        (wheel,) = out.glob("horovod-*.whl")
        dest.mkdir(parents=True, exist_ok=True)
        # Copy then rename, so an interrupted build never leaves a half wheel in the cache.
        partial = dest / (wheel.name + ".partial")
        shutil.copy2(wheel, partial)
        final = dest / wheel.name
        partial.replace(final)
        return final


def build_flags() -> dict[str, str]:
    """Gloo always; NCCL as well when torch is a CUDA build and nvcc is on PATH."""
    import torch

    flags = dict(BUILD_FLAGS)
    if torch.version.cuda and shutil.which("nvcc"):
        flags["HOROVOD_GPU_OPERATIONS"] = "NCCL"
        log(f"CUDA torch ({torch.version.cuda}) and nvcc found: building with NCCL")
    return flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--version", default="0.28.1")
    args = parser.parse_args()
    flags = build_flags()
    dest = cache_root() / cache_key(args.version, flags)
    cached = sorted(dest.glob("horovod-*.whl"))
    if cached:
        log(f"using cached wheel {cached[0]}")
        print(cached[0])
        return
    print(build(args.version, flags, dest))


if __name__ == "__main__":
    main()
