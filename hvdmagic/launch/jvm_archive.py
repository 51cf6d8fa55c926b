"""The embedded Spark's class-data archive: where it lives and the JVM option that maps it.

Runs in the kernel, for ``spark_session``; ``hvdmagic.build_jvm_archive`` (run once by the set-up)
makes the archive. The embedded Spark's JVM spends most of its start parsing and verifying the
classes Spark loads: about 12 s on a 2-core machine before the session exists, then 6 s more in
the first job. Java's class-data sharing keeps them in an archive that a later JVM maps as they
were, and both halve (docs/performance-launch.md).

An archive is valid only for the JVM build and the jars it was made with, so its name is a
digest of those. A JVM handed an archive of another build ignores it; one handed a truncated
archive dies (SIGBUS) before the session exists, so ``spark_session`` deletes an archive that a
start failed with (``forget``) and starts again without it. Imports only the standard library.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path


def _java() -> Path | None:
    """The java binary pyspark's spark-submit will run: $JAVA_HOME's, else the one on PATH."""
    home = os.environ.get("JAVA_HOME")
    found = Path(home) / "bin" / "java" if home else shutil.which("java")
    return Path(found).resolve() if found and Path(found).exists() else None


def spark_jars() -> Path | None:
    """The directory of Spark's jars on the JVM's class path: $SPARK_HOME's, else pyspark's own."""
    if home := os.environ.get("SPARK_HOME"):
        jars = Path(home) / "jars"
    elif (spec := importlib.util.find_spec("pyspark")) is not None and spec.submodule_search_locations:
        jars = Path(spec.submodule_search_locations[0]) / "jars"
    else:
        return None
    return jars if jars.is_dir() else None


def archive_path(jars: Path | None = None) -> Path | None:
    """Where the archive for this JVM and these jars (by default this pyspark's) lives, whether or not
    it exists yet; None when there is no java or no pyspark to make one for."""
    java, jars = _java(), jars or spark_jars()
    if java is None or jars is None:
        return None
    digest = hashlib.sha256()
    for path in (java, *sorted(jars.glob("*.jar"))):  # the JVM checks each jar's size and time on use
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    base = os.environ.get("HVDMAGIC_CACHE") or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hvdmagic" / "jvm" / f"spark-{digest.hexdigest()[:16]}.jsa"


def options() -> str:
    """The JVM option that maps this JVM's archive, or "" when none has been made."""
    path = archive_path()
    return f"-XX:SharedArchiveFile={path}" if path is not None and path.is_file() else ""


def forget(option: str) -> None:
    """Delete the archive ``option`` names: a JVM could not start with it."""
    if option.startswith("-XX:SharedArchiveFile="):
        Path(option.split("=", 1)[1]).unlink(missing_ok=True)
