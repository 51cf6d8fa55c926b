"""The embedded Spark's start with the JVM's class-data archive (hvdmagic/launch/jvm_archive.py):
the set-up made one, a started JVM maps it, and a damaged one costs a retry, not the session."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from hvdmagic import build_jvm_archive
from hvdmagic.launch import jvm_archive

# In a fresh interpreter, as a kernel's first Spark cell: start the embedded session, and say which
# files its JVM has mapped (a JVM that maps its archive lists it in /proc/PID/maps).
START_AND_SAY_MAPPED = """
import json, os
from pyspark import SparkContext
from hvdmagic.launch import spark_session
session = spark_session.start_embedded(2)
assert session.range(10).count() == 10
jvm = SparkContext._gateway.proc.pid
with open(f"/proc/{jvm}/maps") as maps:
    files = sorted({line.split()[-1] for line in maps if line.rstrip().endswith(".jsa")})
session.stop()
print(json.dumps(files))
"""


def _start_and_say_mapped(env: dict, cwd=None) -> list[str]:
    done = subprocess.run([sys.executable, "-c", START_AND_SAY_MAPPED], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"the embedded Spark did not start:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_set_up_made_the_archive_and_a_started_jvm_maps_it():
    archive = jvm_archive.archive_path()
    assert archive is not None and archive.is_file(), (
        f"no class-data archive at {archive}: scripts/setup.sh runs python -m hvdmagic.build_jvm_archive")
    assert str(archive) in _start_and_say_mapped(dict(os.environ)), \
        "the embedded Spark's JVM did not map the class-data archive"


def test_a_damaged_archive_is_deleted_and_the_session_starts_without_it(tmp_path):
    archive = jvm_archive.archive_path()
    assert archive is not None and archive.is_file(), "no class-data archive to damage (see the test above)"
    env = dict(os.environ, HVDMAGIC_CACHE=str(tmp_path))
    damaged = tmp_path / archive.relative_to(archive.parents[2])
    damaged.parent.mkdir(parents=True)
    with archive.open("rb") as whole, damaged.open("wb") as cut:
        cut.write(whole.read(archive.stat().st_size // 3))  # a JVM mapping this dies with SIGBUS
    assert subprocess.run([sys.executable, "-c", "from hvdmagic.launch import jvm_archive; "
                           "print(jvm_archive.archive_path())"], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == str(damaged), "the test put the damaged archive elsewhere"
    notebook_folder = tmp_path / "notebooks"
    notebook_folder.mkdir()
    assert str(damaged) not in _start_and_say_mapped(env, cwd=notebook_folder)
    assert not list(notebook_folder.iterdir()), "the JVM that died left its crash report in the kernel's folder"
    # Deleted only where a start with it failed: so the start tried it, failed, and started again without.
    assert not damaged.exists(), "the damaged archive was kept: every later start would fail once first"


@pytest.mark.unit
def test_a_build_waits_for_nobody_and_makes_nothing_without_java_or_pyspark(tmp_path, monkeypatch):
    said = []
    monkeypatch.setenv("HVDMAGIC_CACHE", str(tmp_path))
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-java"))
    assert jvm_archive.archive_path() is None and jvm_archive.options() == ""
    assert build_jvm_archive.build(said.append) is None and "no java" in said[-1]

    monkeypatch.delenv("JAVA_HOME")
    if shutil.which("java") is None:
        pytest.fail("this machine's set-up installs Java 17; none is on PATH")
    archive = jvm_archive.archive_path()
    archive.parent.mkdir(parents=True)
    archive.with_suffix(".lock").touch()  # another builder at work
    assert build_jvm_archive.build(said.append) is None and "another process is making" in said[-1]
    assert not archive.exists() and jvm_archive.options() == ""

    archive.write_bytes(b"made before")
    assert build_jvm_archive.build(said.append) == archive and "is there" in said[-1]
    assert jvm_archive.options() == f"-XX:SharedArchiveFile={archive}"
    jvm_archive.forget(jvm_archive.options())
    assert not archive.exists()

    # An archive made for Spark jars that are gone (a removed virtualenv), or that have changed since
    # (a clone made again in the same place: another name now), goes at the next build.
    orphan = archive.with_name("spark-0123456789abcdef.jsa")
    orphan.write_bytes(b"made for a removed virtualenv")
    orphan.with_suffix(".jars").write_text(f"{tmp_path / 'removed-venv' / 'jars'}\n")
    stale = archive.with_name("spark-fedcba9876543210.jsa")
    stale.write_bytes(b"made for these jars' earlier files")
    stale.with_suffix(".jars").write_text(f"{jvm_archive.spark_jars()}\n")
    archive.write_bytes(b"made before")
    archive.with_suffix(".jars").write_text(f"{jvm_archive.spark_jars()}\n")
    build_jvm_archive.build(said.append)
    assert not orphan.exists() and not orphan.with_suffix(".jars").exists() and not stale.exists()
    assert archive.exists(), "the archive of these jars was deleted"
