"""Build (or reuse) a horovod wheel that works with the installed torch.

horovod 0.28.1's CMakeLists pins C++14, but torch >= 2.1 headers need C++17.
We build with a compiler wrapper that rewrites the flag, and keep the wheel in
the user's cache keyed by everything that changes the binary, so only the first
set-up on a machine pays the ~6 minute build. Prints the wheel's path on stdout.

The source gets one fix (PATCHES): horovod 0.28.1 builds the Gloo context of
every process set, the global one included, on an empty interface name, so Gloo
falls back to the address the machine's hostname resolves to. Where that is a
loopback address (Debian's "127.0.1.1 hostname" line, containers), ranks on
other hosts are told to connect to 127.0.0.1 and the first collective aborts.
The fix uses the global context's interface (HOROVOD_GLOO_IFACE), as every other
context already does. tests/test_multihost.py fails without it.
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


# (file, text in 0.28.1, replacement): applied to the sdist before building.
PATCHES = [
    ("horovod/common/gloo/gloo_context.cc",
     "  attr device_attr;\n  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n"
     "  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;",
     "  gloo_iface_ = global_context.gloo_iface_;\n"
     "  attr device_attr;\n  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n"
     "  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;"),
]


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
        "patches": PATCHES,
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return f"horovod-{version}-torch-{torch.__version__}-py{sysconfig.get_python_version()}-{digest}"


def build(version: str, flags: dict[str, str], dest: Path) -> Path:
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if not cxx:
        sys.exit("[build_horovod] no C++ compiler found: install g++ (e.g. 'apt-get install -y g++') and cmake.")
    if not shutil.which("cmake"):
        sys.exit("[build_horovod] cmake was not found: install it "
                 "(e.g. 'apt-get install -y cmake' or 'pip install cmake').")
    with tempfile.TemporaryDirectory(prefix="hvd-build-") as tmp:
        wrapper = Path(tmp) / "cxx17"
        wrapper.write_text(WRAPPER.format(cxx=cxx))
        wrapper.chmod(0o755)
        env = dict(os.environ, **flags, CXX=str(wrapper))
        env.setdefault("MAKEFLAGS", f"-j{os.cpu_count() or 2}")
        out = Path(tmp) / "wheel"
        source = patched_source(version, Path(tmp))
        log(f"building horovod {version} (takes several minutes; later set-ups reuse the cached wheel)")
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
               "-w", str(out), str(source)]
        result = subprocess.run(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr)
        if result.returncode != 0:
            sys.exit(f"[build_horovod] the horovod build failed (exit {result.returncode}); "
                     "see the compiler output above.")
        (wheel,) = out.glob("horovod-*.whl")
        dest.mkdir(parents=True, exist_ok=True)
        # Copy then rename, so an interrupted build never leaves a half wheel in the cache.
        partial = dest / (wheel.name + ".partial")
        shutil.copy2(wheel, partial)
        final = dest / wheel.name
        partial.replace(final)
        return final


def patched_source(version: str, tmp: Path) -> Path:
    """horovod's sdist, unpacked, with PATCHES applied."""
    import tarfile

    download = tmp / "sdist"
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                             "-d", str(download), f"horovod=={version}"], stdout=sys.stderr, stderr=sys.stderr)
    if result.returncode != 0:
        sys.exit(f"[build_horovod] could not download the horovod {version} source (exit {result.returncode}).")
    (archive,) = download.glob("horovod-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp / "src", filter="data")
    (source,) = (tmp / "src").iterdir()
    for name, old, new in PATCHES:
        path = source / name
        text = path.read_text()
        if text.count(old) != 1:
            sys.exit(f"[build_horovod] {name} does not look like horovod {version}'s: cannot apply the Gloo fix.")
        path.write_text(text.replace(old, new))
    return source


def build_flags() -> dict[str, str]:
    """Gloo always; MPI as well when an MPI compiler is on PATH; NCCL when torch
    is a CUDA build and nvcc is on PATH."""
    import torch

    flags = dict(BUILD_FLAGS)
    if shutil.which("mpicxx") and shutil.which("mpirun"):
        flags["HOROVOD_WITH_MPI"] = "1"
        log("MPI found: building with the MPI controller as well as Gloo")
    else:
        flags["HOROVOD_WITHOUT_MPI"] = "1"
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
