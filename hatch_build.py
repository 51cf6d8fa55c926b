"""Builds hvdmagic/_rowlog.c, the C version of ``log_metrics``, into the package.

Without a C compiler (or Python headers) the build goes on pure Python: report.py
then uses its Python ``log_metrics``, which keeps the same rows, only slower.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sysconfig
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class RowlogBuildHook(BuildHookInterface):
    def initialize(self, version: str, build_data: dict) -> None:
        root = Path(self.root)
        source = root / "hvdmagic" / "_rowlog.c"
        target = source.with_name("_rowlog" + sysconfig.get_config_var("EXT_SUFFIX"))
        compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
        command = [*compiler, "-O2", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
                   "-o", str(target), str(source)]
        try:
            subprocess.run(command, check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            self.app.display_warning(f"hvdmagic: C log_metrics not built, the Python one will be used: {detail}")
            return
        build_data["pure_python"] = False
        build_data["infer_tag"] = True
        build_data["artifacts"].append(target.relative_to(root).as_posix())  # git ignores it, so name it
