"""Build (or reuse) a horovod wheel for the PyTorch and TensorFlow installed in this Python.

    python -m hvdmagic.build_horovod [--frameworks pytorch,tensorflow] [--gpu] [--version 0.28.1]

prints the wheel's path on stdout (everything else goes to stderr); install it with
``pip install --no-deps <path>``. Without ``--frameworks`` it builds for those of
torch and tensorflow that this Python can import. The wheel is kept in
``$HVDMAGIC_CACHE/hvdmagic/wheels`` (default ``~/.cache``), keyed by everything that
changes the binary: horovod, Python, torch and TensorFlow versions, those of setuptools,
wheel and cmake (BUILD_TOOLS), the build flags and the source patches. Only the first
build on a machine pays the 5 to 10 minutes.

horovod 0.28.1's sdist does not build against today's frameworks as it is:

- Its CMakeLists pins C++14, but torch >= 2.1 headers need C++17: the build runs
  with a compiler wrapper (WRAPPER) that rewrites the flag.
- PATCHES fixes the source before the build:
  * Gloo: every process set's context, the global one included, is built on an empty
    interface name, so Gloo falls back to the address the hostname resolves to. Where
    that is a loopback address (Debian's "127.0.1.1 hostname", containers), ranks on
    other hosts are told to connect to 127.0.0.1 and the first collective aborts. The
    fix uses the global context's interface (HOROVOD_GLOO_IFACE), as every other
    context already does (tests/test_multihost.py).
  * Gloo's stall inspector: the Gloo controller reserves its list of the process set's
    ranks instead of sizing it, so the list stays empty and Horovod's "Missing ranks"
    warning never comes under Gloo (MPI sizes it). The fix sizes it; ``--stall-check``
    and the dashboard's hang notices depend on it (tests/test_hang_reports.py).
  * TensorFlow >= 2.18 (XLA moved out of tensorflow/compiler): xla_mpi_ops.cc includes
    tensorflow/compiler/xla/client/xla_builder.h, now xla/hlo/builder/xla_builder.h,
    and XLA's headers include highwayhash and farmhash from directories TF ships but
    does not put on its include path. Without the fix, TF 2.21 fails to compile. The
    file's GPU part (XLA custom calls) also names xla::StatusOr, now absl::StatusOr.
  * Keras: horovod.tensorflow.keras takes its backend from the standalone ``keras``
    package, which is Keras 3 on TF >= 2.16 even when ``TF_USE_LEGACY_KERAS=1`` makes
    ``tf.keras`` the Keras 2 of ``tf_keras``; MetricAverageCallback then fails. The fix
    uses ``tf.keras.backend``, which is what it meant. And since horovod's Keras
    DistributedOptimizer silently does not average gradients under Keras 3, importing
    horovod.tensorflow.keras there raises an ImportError that says what to do.
  * GCC >= 13: two headers lack the <string> and <stdexcept> that older libstdc++
    brought in through other headers.
- CMake >= 4 refuses the bundled Gloo's minimum version without CMAKE_POLICY_VERSION_MINIMUM.

MPI is built in when ``mpicxx`` and ``mpirun`` are on PATH (Gloo always is). ``--gpu``
builds NCCL operations (HOROVOD_GPU_OPERATIONS=NCCL); it needs the CUDA toolkit
(nvcc) and NCCL (``HOROVOD_NCCL_HOME``, or the nvidia-nccl wheel of a CUDA torch), and compiles
CUDA kernels for the GPUs nvidia-smi lists (HOROVOD_BUILD_CUDA_CC_LIST). With
neither ``--gpu`` nor ``--no-gpu`` it is on when nvcc is found and a framework is a CUDA
build. See docs/frameworks.md.

This file runs on executor images that have nothing of hvdmagic's dependencies: it
imports only the standard library (and the frameworks, to read their build), and also
runs by path: ``python build_horovod.py ...``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

HOROVOD_VERSION = "0.28.1"

# --frameworks name -> (import name, horovod's build switch)
FRAMEWORKS = {
    "pytorch": ("torch", "PYTORCH"),
    "tensorflow": ("tensorflow", "TENSORFLOW"),
}

# Apache retired MXNet in 2023; hvdmagic builds without it, always.
BASE_FLAGS = {
    "HOROVOD_WITH_GLOO": "1",
    "HOROVOD_WITHOUT_MXNET": "1",
}

# Read by horovod's build and so part of the cache key when set; every other
# HOROVOD_WITH*/GPU setting of the caller's environment is replaced by ours.
PASSED_THROUGH = ("HOROVOD_CUDA_HOME", "HOROVOD_CUDA_INCLUDE", "HOROVOD_CUDA_LIB", "HOROVOD_NCCL_HOME",
                  "HOROVOD_NCCL_INCLUDE", "HOROVOD_NCCL_LIB", "HOROVOD_NCCL_LINK", "HOROVOD_BUILD_CUDA_CC_LIST",
                  "HOROVOD_GPU")

# What horovod's setup.py needs importable when it builds without isolation.
BUILD_PREREQUISITES = ("setuptools", "wheel", "cloudpickle", "psutil", "yaml", "packaging", "cffi")

# The build's tools that requirements/lock.txt pins: their versions are part of the cache key
# (where installed; cmake often comes from the system instead), so a changed pin builds anew.
# Not numpy, nor the other prerequisites: the build imports them but its output does not depend on them.
BUILD_TOOLS = ("setuptools", "wheel", "cmake")

WRAPPER = """#!/bin/sh
# horovod 0.28.1 asks for C++14; torch's and TensorFlow's headers need C++17, and torch >= 2.15's
# C++20: a compile that includes torch's headers gets the standard they ask for ({torch_std}).
std=c++17
case " $* " in *"/torch/include"*) std={torch_std} ;; esac
for a in "$@"; do
  shift
  case "$a" in -std=c++14|-std=gnu++14|-std=c++17|--std=c++17) a=-std=$std ;; esac
  set -- "$@" "$a"
done
exec {cxx} "$@"
"""

_KERAS_BACKEND_OLD = """if is_version_greater_equal_than(tf.__version__, "2.6.0"):
    from keras import backend as K
else:
    from tensorflow.python.keras import backend as K
"""
_KERAS_BACKEND_NEW = """# hvdmagic: tf.keras's own backend. On TF >= 2.16 the standalone `keras` package is
# Keras 3 even when TF_USE_LEGACY_KERAS=1 makes tf.keras the Keras 2 of tf_keras.
K = keras.backend
"""
_KERAS3_GUARD = """
# hvdmagic: horovod's Keras DistributedOptimizer does not average gradients under
# Keras 3 (the default from TF 2.16): the ranks would silently diverge.
if str(getattr(keras, "__version__", None) or "2").split(".")[0] not in ("1", "2"):
    raise ImportError(
        "horovod.tensorflow.keras needs Keras 2, but tf.keras is Keras %s: under Keras 3 its "
        "DistributedOptimizer does not average gradients. Install tf-keras matching TensorFlow "
        "(pip install --no-deps tf-keras==<TF version>) and set TF_USE_LEGACY_KERAS=1 before TensorFlow "
        "is imported; or use horovod.tensorflow's DistributedGradientTape." % keras.__version__)
"""

# (file, text in 0.28.1, replacement, what it fixes): applied to the sdist before building.
PATCHES = [
    ("horovod/common/gloo/gloo_context.cc",
     "  attr device_attr;\n  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n"
     "  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;",
     "  gloo_iface_ = global_context.gloo_iface_;\n"
     "  attr device_attr;\n  device_attr.iface = gloo_iface_;\n  device_attr.ai_family = AF_UNSPEC;\n"
     "  auto dev = CreateDevice(device_attr);\n\n  global_ctx = global_context.ctx;",
     "the Gloo interface of process sets"),
    # reserve() leaves size() 0: CheckForStalledTensors then loops over no rank and never warns.
    ("horovod/common/gloo/gloo_controller.cc",
     "  global_ranks_.reserve(size_);\n",
     "  global_ranks_.resize(size_);  // hvdmagic: sized, so that the stall inspector sees every rank\n",
     "the Gloo controller's rank list (the stall inspector's)"),
    ("horovod/tensorflow/xla_mpi_ops.cc",
     '#include "tensorflow/compiler/xla/client/xla_builder.h"\n',
     '#if __has_include("tensorflow/compiler/xla/client/xla_builder.h")\n'
     '#include "tensorflow/compiler/xla/client/xla_builder.h"\n'
     "#define HVDMAGIC_XLA_STATUSOR ::xla::StatusOr\n"
     "#else  // TensorFlow >= 2.18: XLA's builder moved, and xla::StatusOr is absl's (hvdmagic)\n"
     '#include "xla/hlo/builder/xla_builder.h"\n'
     "#define HVDMAGIC_XLA_STATUSOR ::absl::StatusOr\n"
     "#endif\n",
     "the XLA builder header of TensorFlow >= 2.18"),
    # The GPU build's XLA custom call (HAVE_GPU only): xla::StatusOr is gone from TF 2.21's XLA.
    ("horovod/tensorflow/xla_mpi_ops.cc",
     "  ::xla::StatusOr<::xla::XlaOp> BuildAllreduceCustomCall(",
     "  HVDMAGIC_XLA_STATUSOR<::xla::XlaOp> BuildAllreduceCustomCall(",
     "the XLA StatusOr of TensorFlow >= 2.18"),
    ("horovod/tensorflow/xla_mpi_ops.cc",
     "\n::xla::StatusOr<::xla::XlaOp> HVDAllreduceOp::BuildAllreduceCustomCall(",
     "\nHVDMAGIC_XLA_STATUSOR<::xla::XlaOp> HVDAllreduceOp::BuildAllreduceCustomCall(",
     "the XLA StatusOr of TensorFlow >= 2.18"),
    ("horovod/tensorflow/CMakeLists.txt",
     "include_directories(SYSTEM ${Tensorflow_INCLUDE_DIRS})\n",
     "include_directories(SYSTEM ${Tensorflow_INCLUDE_DIRS})\n"
     "# hvdmagic: XLA's headers (TensorFlow >= 2.18) include these two from TF's bundled copies.\n"
     "foreach(tf_external external/highwayhash external/farmhash_archive/src)\n"
     '    if(EXISTS "${Tensorflow_INCLUDE_DIRS}/${tf_external}")\n'
     '        include_directories(SYSTEM "${Tensorflow_INCLUDE_DIRS}/${tf_external}")\n'
     "    endif()\n"
     "endforeach()\n",
     "the include path of TensorFlow's XLA headers"),
    # A CPU build (--no-gpu, or no NCCL found) against a CUDA torch: horovod would still compile its torch
    # extension with the CUDA toolkit, which a runtime's torch for CUDA 12 does not match (or which is not
    # there), and its cmake step fails. HVDMAGIC_CPU_ONLY (build_flags) makes it a plain C++ extension.
    ("cmake/Modules/FindPytorch.cmake",
     'string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)\n',
     'string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)\n'
     'if ("$ENV{HVDMAGIC_CPU_ONLY}" STREQUAL "1")  # hvdmagic: a CPU build against a CUDA torch\n'
     "    set(Pytorch_CUDA FALSE)\n"
     "endif()\n",
     "the CPU build of the torch extension against a CUDA torch"),
    ("horovod/torch/CMakeLists.txt",
     'execute_process(COMMAND ${PY_EXE} -c "from distutils.sysconfig import get_python_inc; print(get_python_inc())"',
     'execute_process(COMMAND ${PY_EXE} -c "import sysconfig; print(sysconfig.get_paths()[\'include\'])"',
     "distutils in the torch extension's build (Python >= 3.12)"),
    # Python code the ranks import (horovod.runner, horovod.spark): the modules 0.28.1 used are gone.
    ("horovod/runner/js_run.py",
     "from distutils.spawn import find_executable\n",
     "from shutil import which as find_executable  # hvdmagic: Python 3.12 removed distutils\n",
     "distutils in horovod.runner (Python >= 3.12)"),
    ("horovod/spark/common/util.py",
     "    elif dtype == np.bool:\n",
     "    elif dtype == bool:  # hvdmagic: numpy >= 1.24 removed np.bool\n",
     "np.bool in horovod.spark (numpy >= 1.24)"),
    ("horovod/spark/common/util.py",
     "        return np.bool\n",
     "        return bool  # hvdmagic: numpy >= 1.24 removed np.bool\n",
     "np.bool in horovod.spark (numpy >= 1.24)"),
    # Some TensorFlow wheels' XLA headers include headers the wheel does not ship (TF 2.19's
    # xla/stream_executor/gpu/tma_metadata.h includes llvm/ADT/ArrayRef.h): xla_ops_fail() finds
    # out, and HVDMAGIC_WITHOUT_XLA_OPS leaves out horovod's XLA ops (opt-in at run time anyway).
    ("horovod/tensorflow/CMakeLists.txt",
     'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\n',
     'if(NOT "$ENV{HVDMAGIC_WITHOUT_XLA_OPS}" STREQUAL "1")  # hvdmagic: headers that cannot compile them\n'
     '    list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\n'
     "endif()\n",
     "XLA ops against TensorFlow headers that cannot compile them"),
    ("horovod/tensorflow/keras/__init__.py", _KERAS_BACKEND_OLD, _KERAS_BACKEND_NEW + _KERAS3_GUARD,
     "the Keras backend of horovod.tensorflow.keras"),
    ("horovod/tensorflow/keras/callbacks.py", _KERAS_BACKEND_OLD, _KERAS_BACKEND_NEW,
     "the Keras backend of horovod.tensorflow.keras.callbacks"),
    # GCC >= 13's libstdc++ no longer includes these through other headers (the GPU machine's
    # Ubuntu 24.04 has GCC 13.3): "'string' in namespace 'std' does not name a type".
    ("horovod/common/group_table.h", "#include <unordered_map>\n#include <vector>\n",
     "#include <string>  // hvdmagic: GCC >= 13\n#include <unordered_map>\n#include <vector>\n",
     "a missing #include <string> (GCC >= 13)"),
    ("horovod/common/common.h", "#include <string>\n#include <unordered_map>\n",
     "#include <stdexcept>  // hvdmagic: GCC >= 13\n#include <string>\n#include <unordered_map>\n",
     "a missing #include <stdexcept> (GCC >= 13)"),
]


def log(msg: str) -> None:
    print(f"[build_horovod] {msg}", file=sys.stderr, flush=True)


def fail(msg: str) -> None:
    sys.exit(f"[build_horovod] {msg}")


def cache_root() -> Path:
    base = os.environ.get("HVDMAGIC_CACHE") or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hvdmagic" / "wheels"


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def installed_versions(names) -> dict[str, str]:
    """The versions of those distributions in ``names`` that are installed, from the metadata."""
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


@functools.cache
def distributions(module: str) -> dict[str, str]:
    """The installed distributions that provide ``module`` and their versions, from the
    metadata (importing TensorFlow to ask takes seconds): {"tensorflow-cpu": "2.21.0"}."""
    names = metadata.packages_distributions().get(module, [])
    found = installed_versions(sorted({name.lower().replace("_", "-") for name in names}))
    if not found:  # e.g. a framework built from source without metadata
        out = subprocess.run([sys.executable, "-c", f"import {module}; print({module}.__version__)"],
                             capture_output=True, text=True)
        if out.returncode == 0:
            found[module] = out.stdout.strip().splitlines()[-1]
    return found


def default_frameworks() -> list[str]:
    return [name for name, (module, _) in FRAMEWORKS.items() if importable(module)]


def parse_frameworks(text: str | None) -> list[str]:
    if text is None:
        chosen = default_frameworks()
        if not chosen:
            fail("neither torch nor tensorflow is importable in this Python: install one first "
                 "(or name them with --frameworks).")
        return chosen
    chosen = [part.strip().lower() for part in text.split(",") if part.strip()]
    chosen = ["pytorch" if name == "torch" else name for name in chosen]
    unknown = [name for name in chosen if name not in FRAMEWORKS]
    if unknown or not chosen:
        fail(f"--frameworks takes a comma-separated list of {', '.join(FRAMEWORKS)}, not {text!r}"
             + (" (MXNet was retired by Apache in 2023: hvdmagic does not build it)" if "mxnet" in unknown else "")
             + ".")
    missing = [name for name in chosen if not importable(FRAMEWORKS[name][0])]
    if missing:
        fail(f"--frameworks names {', '.join(missing)}, but {sys.executable} cannot import "
             f"{', '.join(FRAMEWORKS[name][0] for name in missing)}: install it first (see docs/frameworks.md).")
    return sorted(set(chosen), key=list(FRAMEWORKS).index)


def toolkit_root(nvcc: str) -> Path:
    """The CUDA toolkit an nvcc belongs to, through any link (/usr/local/bin/nvcc -> /usr/local/cuda-13.0)."""
    return Path(os.path.realpath(nvcc)).parent.parent


def find_nvcc() -> str | None:
    for home in (os.environ.get("HOROVOD_CUDA_HOME"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cpu_build(name: str) -> bool:
    """Known from the metadata to be a CPU-only build: torch's "+cpu" wheels, tensorflow-cpu."""
    dists = distributions(FRAMEWORKS[name][0])
    if name == "pytorch":
        return bool(dists) and all(version.endswith("+cpu") for version in dists.values())
    return bool(dists) and set(dists) <= {"tensorflow-cpu"}


def cuda_frameworks(frameworks: list[str]) -> list[str]:
    """Those of ``frameworks`` that are CUDA builds. Imports those that the metadata does not
    tell (seconds each, once)."""
    return [name for name in frameworks if not cpu_build(name) and cuda_build(name)]


@functools.cache
def cuda_build(name: str) -> bool:
    if name == "pytorch":
        return bool(torch_cuda()[0])
    probe = "import tensorflow as tf; print(tf.test.is_built_with_cuda())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip().endswith("True")


# What the build asks torch, in one import of it (seconds): its CUDA version, and the architectures it was
# built for (get_arch_list() is [] without a GPU, so the compiler's flags).
_TORCH_CUDA = """
import json, torch
cuda = torch.version.cuda or ""
print(json.dumps([cuda, torch._C._cuda_getArchFlags() if cuda else ""]))
"""


@functools.cache
def torch_cuda() -> tuple[str, str]:
    """(the CUDA release torch was built for, "" for a CPU build; its architecture flags, "sm_80 sm_90")."""
    out = subprocess.run([sys.executable, "-c", _TORCH_CUDA], capture_output=True, text=True)
    try:
        cuda, arches = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return "", ""
    return str(cuda), str(arches)


def usable_toolkit(nvcc: str) -> bool:
    """Whether nvcc's toolkit can build for this torch: it has CUDA's runtime (headers and library),
    and its CUDA is the major release torch was built for. A runtime's torch for CUDA 12 beside a
    CUDA 13 nvcc, or an nvcc without its runtime, gets a CPU build with a line saying so, unless
    ``--gpu`` insists."""
    root = toolkit_root(nvcc)
    runtime = [*root.glob("lib64/libcudart.so*"), *root.glob("lib/libcudart.so*"),
               *root.glob("targets/*/lib/libcudart.so*")]
    if not (root / "include" / "cuda_runtime.h").exists() or not runtime:
        log(f"nvcc ({nvcc}) has no CUDA runtime (headers and libcudart) beside it in {root}: building without "
            "NCCL (--gpu to insist, with HOROVOD_CUDA_HOME naming a whole toolkit)")
        return False
    torch_release = torch_cuda()[0]
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    toolkit = next((part.split(",")[0] for part in out.split("release ")[1:2]), "")
    if torch_release and toolkit and torch_release.split(".")[0] != toolkit.split(".")[0]:
        log(f"nvcc is CUDA {toolkit} but torch was built for CUDA {torch_release}: building without NCCL "
            "(--gpu to insist, with a matching HOROVOD_CUDA_HOME)")
        return False
    return True


def cuda_architectures() -> dict[str, str]:
    """HOROVOD_BUILD_CUDA_CC_LIST for the GPUs this machine has (nvidia-smi), else for those this torch
    was built for. horovod's own default list starts at sm_35, which CUDA 13's nvcc no longer knows,
    and compiling every architecture is slow."""
    if os.environ.get("HOROVOD_BUILD_CUDA_CC_LIST"):
        return {}
    smi = shutil.which("nvidia-smi")
    out = _output([smi, "--query-gpu=compute_cap", "--format=csv,noheader"]) if smi else ""
    # Only "9.0"-like lines: an old driver answers "Field "compute_cap" is not a valid field", a MIG one "[N/A]".
    found = {line.strip().replace(".", "") for line in out.splitlines() if re.fullmatch(r"\d+\.\d+", line.strip())}
    if not found:
        found = {arch[3:] for arch in torch_cuda()[1].split() if re.fullmatch(r"sm_\d+", arch)}
    if not found:
        return {}
    log(f"compiling horovod's CUDA kernels for sm_{', sm_'.join(sorted(found))}")
    return {"HOROVOD_BUILD_CUDA_CC_LIST": ",".join(sorted(found, key=int))}


def _output(cmd: list[str]) -> str:
    """A probe's stdout; "" if it fails or takes over a minute (a wedged driver hangs nvidia-smi)."""
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout if result.returncode == 0 else ""


def nccl_from_wheel() -> dict[str, str]:
    """HOROVOD_NCCL_INCLUDE/LIB from the nvidia-nccl wheel that a CUDA torch installs, unless the caller
    names an NCCL. The wheel ships libnccl.so.2 without the libnccl.so that horovod's CMake looks for:
    a link to it in the cache stands in."""
    if any(os.environ.get(name) for name in ("HOROVOD_NCCL_HOME", "HOROVOD_NCCL_INCLUDE", "HOROVOD_NCCL_LIB")):
        return {}
    for entry in sys.path:
        home = Path(entry or ".") / "nvidia" / "nccl"
        if (home / "include" / "nccl.h").exists() and (library := next(home.glob("lib/libnccl.so.*"), None)):
            break
    else:
        log("no HOROVOD_NCCL_HOME and no nvidia-nccl wheel in this Python: horovod's CMake looks for NCCL "
            "in the CUDA toolkit")
        return {}
    links = cache_root().parent / "nccl-link" / hashlib.sha256(str(library).encode()).hexdigest()[:12]
    links.mkdir(parents=True, exist_ok=True)
    link = links / "libnccl.so"
    if not link.exists():
        link.symlink_to(library.resolve())
    log(f"NCCL from {home}")
    return {"HOROVOD_NCCL_INCLUDE": str(home / "include"), "HOROVOD_NCCL_LIB": str(links),
            "HOROVOD_NCCL_LINK": "SHARED"}


def build_flags(frameworks: list[str], gpu: bool | None) -> dict[str, str]:
    """Gloo always; each framework on or off; MPI when an MPI compiler is on PATH (unless
    HOROVOD_WITHOUT_MPI=1); NCCL
    with --gpu (or, without --gpu/--no-gpu, when nvcc is found and a framework is a CUDA build)."""
    flags = dict(BASE_FLAGS)
    for name, (_, switch) in FRAMEWORKS.items():
        flags[f"HOROVOD_WITH{'' if name in frameworks else 'OUT'}_{switch}"] = "1"
    if os.environ.get("HOROVOD_WITHOUT_MPI") == "1":
        flags["HOROVOD_WITHOUT_MPI"] = "1"  # a wheel for machines without this one's MPI
    elif shutil.which("mpicxx") and shutil.which("mpirun"):
        flags["HOROVOD_WITH_MPI"] = "1"
        log("MPI found: building with the MPI controller as well as Gloo")
    else:
        flags["HOROVOD_WITHOUT_MPI"] = "1"
    nvcc = find_nvcc()
    if gpu is None and nvcc:
        cuda = cuda_frameworks(frameworks)
        gpu = bool(cuda) and usable_toolkit(nvcc)
        if gpu:
            log(f"nvcc ({nvcc}) and a CUDA build of {', '.join(cuda)} found: building with NCCL")
    if gpu:
        if not nvcc:
            fail("--gpu needs the CUDA toolkit: nvcc was not found on PATH, in $HOROVOD_CUDA_HOME/bin, "
                 "$CUDA_HOME/bin or /usr/local/cuda/bin.")
        flags["HOROVOD_GPU_OPERATIONS"] = "NCCL"
        if not os.environ.get("HOROVOD_CUDA_HOME"):
            # nvcc's own toolkit: CMake's FindCUDAToolkit, from an nvcc linked into /usr/local/bin, looks
            # for CUDA's headers in /usr/local/include.
            flags["HOROVOD_CUDA_HOME"] = str(toolkit_root(nvcc))
        flags.update(cuda_architectures(), **nccl_from_wheel())
    elif cuda_frameworks([name for name in frameworks if name == "pytorch"]):
        # A CUDA torch (the package index's default) on a CPU build: no CUDA in horovod's torch extension.
        flags["HVDMAGIC_CPU_ONLY"] = "1"
        log("a CUDA build of torch, built for CPU tensors only: CUDA tensors need a --gpu build")
    return flags


def cache_key(version: str, frameworks: list[str], flags: dict[str, str]) -> str:
    versions = {name: distributions(FRAMEWORKS[name][0]) for name in frameworks}
    ident = {
        "horovod": version,
        "python": sysconfig.get_python_version(),
        "platform": sysconfig.get_platform(),
        "frameworks": versions,
        "tools": installed_versions(BUILD_TOOLS),
        "flags": flags,
        "env": {name: os.environ[name] for name in PASSED_THROUGH if os.environ.get(name)},
        "patches": PATCHES,
        "wrapper": WRAPPER,
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    label = "-".join(f"{FRAMEWORKS[name][0]}-{next(iter(versions[name].values()), 'unknown')}"
                     for name in frameworks)
    gpu = "-nccl" if "HOROVOD_GPU_OPERATIONS" in flags else ""
    return f"horovod-{version}-{label}{gpu}-py{sysconfig.get_python_version()}-{digest}"


def check_tools() -> str:
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if not cxx:
        fail("no C++ compiler found: install g++ (e.g. 'apt-get install -y g++') and cmake.")
    if not shutil.which("cmake"):
        fail("cmake was not found: install it ('pip install cmake' or 'apt-get install -y cmake').")
    missing = [module for module in BUILD_PREREQUISITES if not importable(module)]
    if missing:
        names = " ".join("pyyaml" if module == "yaml" else module for module in missing)
        fail(f"horovod's build needs these in {sys.executable} first: pip install {names}")
    return cxx


def build(version: str, flags: dict[str, str], dest: Path) -> Path:
    cxx = check_tools()
    with tempfile.TemporaryDirectory(prefix="hvd-build-") as tmp:
        wrapper = Path(tmp) / "cxx17"
        wrapper.write_text(WRAPPER.format(cxx=cxx, torch_std=torch_standard()))
        wrapper.chmod(0o755)
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("HOROVOD_WITH_", "HOROVOD_WITHOUT_", "HOROVOD_GPU_", "HVDMAGIC_CPU_ONLY",
                                      "HVDMAGIC_WITHOUT_XLA_OPS"))}
        env.update(flags, CXX=str(wrapper))
        if cuda_home := env.get("HOROVOD_CUDA_HOME"):
            env.setdefault("CUDA_HOME", cuda_home)  # torch's cpp_extension: where libcudart is
        # Not a flag of the cache key: whether they compile follows from TensorFlow's version, which is.
        if flags.get("HOROVOD_WITH_TENSORFLOW") and (reason := xla_ops_fail(cxx, Path(tmp))):
            env["HVDMAGIC_WITHOUT_XLA_OPS"] = "1"
            log(f"building without horovod's XLA ops (HOROVOD_ENABLE_XLA_OPS): this TensorFlow's headers cannot "
                f"compile them ({reason})")
        env.setdefault("MAKEFLAGS", f"-j{os.cpu_count() or 2}")
        # CMake >= 4 (pip's cmake) refuses the bundled Gloo's cmake_minimum_required(VERSION 2.8.12).
        env.setdefault("CMAKE_POLICY_VERSION_MINIMUM", "3.5")
        out = Path(tmp) / "wheel"
        source = patched_source(version, Path(tmp))
        log(f"building horovod {version} with {' '.join(f'{k}={v}' for k, v in sorted(flags.items()))} "
            "(takes several minutes; later set-ups reuse the cached wheel)")
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
               "-w", str(out), str(source)]
        result = subprocess.run(cmd, env=env, stdout=sys.stderr, stderr=sys.stderr)
        if result.returncode != 0:
            fail(f"horovod {version} did not build for {combination(flags)} (exit {result.returncode}; "
                 "the compiler's output is above). No horovod means no %%horovod and no HorovodRunner; "
                 "%%torchrun and the TorchDistributor drop-in need none and still work. docs/frameworks.md "
                 "lists the combinations that build.")
        (wheel,) = out.glob("horovod-*.whl")
        dest.mkdir(parents=True, exist_ok=True)
        # Copy then rename, so an interrupted build never leaves a half wheel in the cache.
        partial = dest / (wheel.name + ".partial")
        shutil.copy2(wheel, partial)
        final = dest / wheel.name
        partial.replace(final)
        return final


def torch_standard() -> str:
    """The C++ standard torch's headers ask for: C++20 from torch 2.15 (its headers stop with an
    #error below it), C++17 before. Read from the headers, without importing torch."""
    spec = importlib.util.find_spec("torch")
    for location in (spec.submodule_search_locations or []) if spec else []:
        header = Path(location) / "include" / "torch" / "csrc" / "api" / "include" / "torch" / "all.h"
        if header.exists() and "C++20 or later" in header.read_text(errors="replace"):
            return "c++20"
    return "c++17"


def xla_ops_fail(cxx: str, tmp: Path) -> str | None:
    """Why horovod's XLA ops cannot compile against this TensorFlow's headers, or None: the first
    error of a syntax-only compile of the header they build on (16 to 66 seconds here)."""
    ask = "import tensorflow as tf; print('\\n'.join(tf.sysconfig.get_compile_flags()))"
    flags = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True)
    includes = [flag[2:] for flag in flags.stdout.splitlines() if flag.startswith("-I")]
    if flags.returncode != 0 or not includes:
        return None  # the build itself will say what is wrong with TensorFlow
    probe = tmp / "xla_probe.cc"
    probe.write_text('#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"\n')
    extra = [f"-I{include}/external/{sub}" for include in includes
             for sub in ("highwayhash", "farmhash_archive/src")]  # as PATCHES adds them to the build
    result = subprocess.run([cxx, "-fsyntax-only", *flags.stdout.split(), *extra, "-std=c++17", str(probe)],
                            capture_output=True, text=True)
    if result.returncode == 0:
        return None
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    return (errors or ["the compile failed"])[0].strip()


def combination(flags: dict[str, str]) -> str:
    """What a build was for, in words: "Python 3.12, torch 2.6.0, tensorflow 2.17.0, NCCL"."""
    parts = [f"Python {sysconfig.get_python_version()}"]
    for module, switch in FRAMEWORKS.values():
        if flags.get(f"HOROVOD_WITH_{switch}"):
            parts += [f"{dist} {version}" for dist, version in distributions(module).items()]
    if "HOROVOD_GPU_OPERATIONS" in flags:
        parts.append("NCCL")
    return ", ".join(parts)


def patched_source(version: str, tmp: Path) -> Path:
    """horovod's sdist, unpacked, with PATCHES applied."""
    download = tmp / "sdist"
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                             "-d", str(download), f"horovod=={version}"], stdout=sys.stderr, stderr=sys.stderr)
    if result.returncode != 0:
        fail(f"could not download the horovod {version} source (exit {result.returncode}).")
    (archive,) = download.glob("horovod-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(tmp / "src", filter="data")
    (source,) = (tmp / "src").iterdir()
    for name, old, new, what in PATCHES:
        path = source / name
        text = path.read_text()
        if text.count(old) != 1:
            fail(f"{name} does not look like horovod {HOROVOD_VERSION}'s: cannot apply the fix for {what}.")
        path.write_text(text.replace(old, new))
    return source


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hvdmagic.build_horovod",
        description="Build (or reuse from the cache) a horovod wheel for this Python's frameworks; "
                    "prints its path on stdout.")
    parser.add_argument("--version", default=HOROVOD_VERSION, help="horovod version (default %(default)s)")
    parser.add_argument("--frameworks", metavar="LIST",
                        help="comma-separated: pytorch, tensorflow (default: those importable here)")
    parser.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None,
                        help="build NCCL GPU operations (needs CUDA's nvcc and NCCL); default: when nvcc "
                             "is found and a framework is a CUDA build")
    args = parser.parse_args(argv)
    frameworks = parse_frameworks(args.frameworks)
    flags = build_flags(frameworks, args.gpu)
    dest = cache_root() / cache_key(args.version, frameworks, flags)
    cached = sorted(dest.glob("horovod-*.whl"))
    if cached:
        log(f"using cached wheel {cached[0]}")
        print(cached[0])
        return
    print(build(args.version, flags, dest))


if __name__ == "__main__":
    main()
