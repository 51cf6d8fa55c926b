"""Make the embedded Spark's class-data archive: ``python -m hvdmagic.build_jvm_archive``.

The set-up (scripts/setup.sh) runs it once per Java and pyspark; ``launch.jvm_archive`` says where
the archive lives and why it halves the embedded Spark's start. A dynamic archive (JDK 13+) holds
the classes one JVM loaded, and is written as that JVM exits. So the command starts the embedded
session as a cell would, in a fresh interpreter, runs a barrier stage and a DataFrame job, stops
the session and waits for its JVM to exit. The archive is written under a temporary name and
renamed once the JVM has exited cleanly: a JVM handed a truncated archive dies at start.
Idempotent: an archive already there is kept.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from hvdmagic.launch import jvm_archive

BUILD_DEADLINE = 600  # seconds the JVM gets to start, run the jobs, write the archive and exit
LOCK_STALE = 900  # seconds after which a lock left by a builder that died no longer holds back another


def _dump(target: Path) -> None:
    """In a fresh interpreter: start the embedded session writing ``target`` as its JVM exits, load
    what a run loads, stop it and wait for the JVM's exit."""
    from pyspark import SparkContext

    from hvdmagic.launch import spark_session

    session = spark_session.start_embedded(2, f"-XX:ArchiveClassesAtExit={target}")
    rows = session.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(lambda part: part).collect()
    assert sorted(rows) == [0, 1], rows
    assert session.range(100).selectExpr("sum(id) AS total").first().total == 4950
    jvm = SparkContext._gateway.proc
    session.stop()
    jvm.stdin.close()  # Spark's gateway exits when its stdin ends, and writes the archive as it does
    if jvm.wait(BUILD_DEADLINE) != 0:
        raise SystemExit(f"the JVM exited with {jvm.returncode} while writing the archive")


def _locked(lock: Path) -> bool:
    """Take ``lock`` for this builder; False while another builder holds it."""
    try:
        os.close(os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        return True
    except FileExistsError:
        if time.time() - lock.stat().st_mtime < LOCK_STALE:
            return False
        lock.unlink(missing_ok=True)
        return _locked(lock)


def _forget_orphans(directory: Path) -> None:
    """Delete the archives made for Spark jars that are gone or changed (a removed virtualenv, a clone
    made again in the same place): 155 MB each, and no JVM would use them."""
    for source in directory.glob("*.jars"):
        jars = Path(source.read_text().strip())
        if not jars.is_dir() or jvm_archive.archive_path(jars) != source.with_suffix(".jsa"):
            source.with_suffix(".jsa").unlink(missing_ok=True)
            source.unlink(missing_ok=True)


def build(log=print) -> Path | None:
    """Make this Java's and pyspark's archive unless it is there; its path, or None where none was made."""
    path = jvm_archive.archive_path()
    if path is None:
        log("no java or no pyspark here: no archive to make")
        return None
    if path.parent.is_dir():
        _forget_orphans(path.parent)
    if path.is_file():
        log(f"the embedded Spark's class-data archive is there: {path}")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_suffix(".lock")
    if not _locked(lock):
        log(f"another process is making {path}; Spark starts without it until then")
        return None
    partial = path.with_suffix(f".{os.getpid()}.partial")
    try:
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "hvdmagic.build_jvm_archive", "--dump", str(partial)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=BUILD_DEADLINE)
        path.with_suffix(".jars").write_text(f"{jvm_archive.spark_jars()}\n")  # for _forget_orphans
        os.replace(partial, path)
        log(f"made the embedded Spark's class-data archive in {time.monotonic() - started:.0f} s: {path}")
        return path
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        log(f"could not make the embedded Spark's class-data archive ({exc}); Spark starts without it")
        return None
    finally:
        partial.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--dump"]:
        _dump(Path(argv[1]))
    else:
        build(lambda message: print(f"[build_jvm_archive] {message}", file=sys.stderr, flush=True))


if __name__ == "__main__":
    main(sys.argv[1:])
