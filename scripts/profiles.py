"""The runtime profiles: hvdmagic installed into the package sets its users already have.

    python3 scripts/profiles.py run dbr-16.4 [colab ...]   set up and test those profiles
    python3 scripts/profiles.py table                      print the table of the last results

Each file ``requirements/profiles/<name>.txt`` pins what one runtime pins of everything hvdmagic
touches; its comments name the runtime's Python (``# python: 3.12``), its Spark, and the line its
users install hvdmagic with (``# install: pip install ...``). For each profile this script, with the
standard library only (and uv, which ``make setup`` installs):

1. builds ``.venv-<name>`` with that Python and installs the runtime's pins with uv: the runtime as a
   user finds it (once per pin set; a stamp in the virtualenv says which). Where the file says
   ``# pyspark: built in`` (Databricks), pyspark is then made importable as the runtime has it, with
   no distribution pip can see (``build_in_pyspark``);
2. runs the install line with pip, ``hvdmagic`` standing for this repository, and compares the
   package versions before and after: a runtime package that changed, or a requirement of
   hvdmagic's that the runtime does not meet (``pip check``), fails the profile;
3. uses a horovod that imports, or builds one with ``python -m hvdmagic.build_horovod --no-gpu``
   (a build that fails is recorded, and the tests that need horovod fail with it);
4. installs the test tools with everything installed as constraints (they may add packages, never
   move one), and the front end that renders the profile's ipywidgets (for 7, JupyterLab 3.6 in
   ``.venv-lab3``);
5. runs the tests marked ``profile`` and three notebooks (``PROFILE_TESTS``), and writes
   ``artifacts/profiles/<name>.json``: versions, outcome counts, set-up and test times.

``table`` prints one Markdown table of those files, and ``--docs`` writes it between docs/runtimes.md's
``profiles`` markers, so the support table is never written by hand. docs/runtimes.md says more.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
PROFILES = HERE / "requirements" / "profiles"
RESULTS = HERE / "artifacts" / "profiles"
RUNTIMES_DOC = HERE / "docs" / "runtimes.md"
TABLE_BEGIN, TABLE_END = "<!-- profiles:begin -->", "<!-- profiles:end -->"

# The tests marked `profile`, and these notebooks (the notebook tier, of the paths named here only).
PROFILE_TESTS = ["-m", "profile or notebook", "tests", "notebooks/quickstart.ipynb", "notebooks/07_keras_mnist.ipynb",
                 "notebooks/13_spark_ml_pipeline.ipynb"]
# s3fs and moto's server: the profile tests that save to s3:// (tests/s3_server.py).
TEST_TOOLS = ["pytest>=8", "pytest-timeout>=2", "nbval>=0.11", "nbclient>=0.7", "playwright>=1.50", "hypothesis>=6",
              "s3fs", "moto[s3]>=5", "flask", "flask-cors"]
# The browser tests' front end. ipywidgets 8's is JupyterLab 4 with jupyterlab_widgets 3, installed beside
# the kernel as in the main virtualenv. ipywidgets 7's is jupyterlab_widgets 1, a JupyterLab 3 extension:
# JupyterLab 3.6 serves it from a virtualenv of its own (LAB3), and runs the profile's kernel, as a
# front end runs a kernel of another environment (tests/browser/jupyter.py, HVDMAGIC_LAB_PYTHON).
LAB_FOR_WIDGETS_8 = "jupyterlab>=4.2"
LAB3 = HERE / ".venv-lab3"
LAB3_PINS = ["jupyterlab==3.6.8", "jupyterlab-widgets==1.1.11"]
# Shown in the table, in this order: the versions each profile's virtualenv really has.
SHOWN = ["pyspark", "torch", "tensorflow", "ipywidgets", "ipython", "cloudpickle", "numpy", "pandas", "pyarrow",
         "horovod"]


def say(msg: str) -> None:
    print(f"[profiles] {msg}", flush=True)


def profile_file(name: str) -> Path:
    path = PROFILES / f"{name}.txt"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PROFILES.glob("*.txt")))
        sys.exit(f"[profiles] no profile {name!r}: requirements/profiles has {known}")
    return path


def header(path: Path, key: str, rest: bool = False, default: str | None = None) -> str:
    """The value of the profile's ``# key: value`` comment: its first word, or (``rest``) the whole line;
    ``default`` where there is none, if given."""
    match = re.search(rf"^# {key}: (.+)$", path.read_text(), re.M)
    if not match and default is not None:
        return default
    if not match:
        sys.exit(f"[profiles] {path.name} has no '# {key}: ...' line")
    return match.group(1).strip() if rest else match.group(1).split()[0]


def find_python(version: str) -> str:
    """An interpreter of that minor version: on PATH, in pyenv, or uv's (``uv python install``)."""
    candidates = [shutil.which(f"python{version}")]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates += sorted((str(p) for p in pyenv.glob(f"{version}.*/bin/python{version}")), reverse=True)
    found = subprocess.run([uv(), "python", "find", version], capture_output=True, text=True)
    candidates.append(found.stdout.strip() if found.returncode == 0 else None)
    for candidate in candidates:  # a pyenv shim of an inactive version is on PATH but fails: ask each
        if candidate and subprocess.run([candidate, "-c", ""], capture_output=True).returncode == 0:
            return candidate
    sys.exit(f"[profiles] no Python {version} found (on PATH, in pyenv, or by uv): "
             f"install one, e.g. `uv python install {version}`")


class Venv:
    def __init__(self, name: str):
        self.path = HERE / f".venv-{name}"
        self.python = str(self.path / "bin" / "python")

    def pip(self, *args: str, constraints: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
        # PIP_CONSTRAINT replaces the machine's own pip constraints (a torch cap, say): the profile's
        # pins are the only ones that apply.
        env = dict(os.environ, PIP_CONSTRAINT=str(constraints) if constraints else "",
                   PIP_DISABLE_PIP_VERSION_CHECK="1")
        result = subprocess.run([self.python, "-m", "pip", *args], env=env, text=True, capture_output=True)
        if check and result.returncode != 0:
            sys.stdout.write(result.stdout[-4000:] + result.stderr[-4000:])
            raise ProfileFailed(f"pip {' '.join(args[:3])} ... failed (exit {result.returncode})")
        return result

    def freeze(self) -> dict[str, str]:
        out = self.pip("list", "--format=json").stdout
        return {norm(p["name"]): p["version"] for p in json.loads(out)}

    def run(self, code: str) -> subprocess.CompletedProcess:
        return subprocess.run([self.python, "-c", code], text=True, capture_output=True)


class ProfileFailed(Exception):
    pass


def uv() -> str:
    """uv: on PATH, or the one `make setup` (scripts/setup.sh tools) puts in .venv."""
    found = shutil.which("uv") or str(HERE / ".venv" / "bin" / "uv")
    if not Path(found).exists():
        sys.exit("[profiles] uv not found: run `bash scripts/setup.sh tools` (or `pip install uv`) first")
    return found


def run_checked(cmd: list[str], what: str) -> None:
    result = subprocess.run(cmd, text=True, capture_output=True, env=dict(os.environ, PIP_CONSTRAINT=""))
    if result.returncode != 0:
        sys.stdout.write(result.stdout[-4000:] + result.stderr[-4000:])
        raise ProfileFailed(f"{what} failed (exit {result.returncode})")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def set_up_runtime(name: str, venv: Venv, pins: Path) -> bool:
    """The runtime as its users find it. Returns whether anything was installed."""
    stamp = venv.path / ".hvdmagic-runtime"
    want = hashlib.sha256(pins.read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == want:
        return False
    python = find_python(header(pins, "python"))
    if venv.path.exists():
        shutil.rmtree(venv.path)
    say(f"{name}: creating {venv.path.name} with {python}")
    subprocess.run([python, "-m", "venv", str(venv.path)], check=True)
    (venv.path / ".gitignore").write_text("*\n")
    venv.pip("install", "-q", "--upgrade", "pip")
    # uv, not pip, for the runtime itself (the user's own install below is pip's): pip resolves a runtime's
    # thirty pins with their nvidia-* dependencies in 5 to 10 minutes here, and the package index's files
    # come without caching headers, so pip would download the gigabytes again on every set-up.
    say(f"{name}: installing the runtime's pins ({pins.relative_to(HERE)}; the first time downloads gigabytes)")
    run_checked([uv(), "pip", "install", "--quiet", "--python", venv.python, "-r", str(pins), "-c", str(pins)],
                f"{name}: uv pip install of the runtime's pins")
    if header(pins, "pyspark", rest=True, default="") == "built in":
        build_in_pyspark(name, venv)
    (venv.path / "runtime-freeze.json").write_text(json.dumps(venv.freeze(), indent=1, sort_keys=True))
    stamp.write_text(want)
    return True


def build_in_pyspark(name: str, venv: Venv) -> None:
    """pyspark as a Databricks runtime has it: importable, but no distribution pip can see. The
    runtime keeps Spark's Python in a folder of its Spark on sys.path, with py4j beside it; here
    the pinned pyspark and py4j move to ``<venv>/databricks/spark/python``, lose their metadata,
    and a .pth file puts that folder on sys.path."""
    site = Path(venv.run("import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    built_in = venv.path / "databricks" / "spark" / "python"
    built_in.mkdir(parents=True)
    for package in ("pyspark", "py4j"):
        shutil.move(str(site / package), str(built_in / package))
        for metadata in site.glob(f"{package}-*.dist-info"):
            shutil.rmtree(metadata)
    (site / "databricks-spark.pth").write_text(f"{built_in}\n")
    seen = venv.run("import pyspark; print(pyspark.__file__)").stdout.strip()
    if not seen.startswith(str(built_in)) or "pyspark" in venv.freeze():
        raise ProfileFailed(f"{name}: pyspark is not built in as on the runtime (imported from {seen or 'nowhere'})")
    say(f"{name}: pyspark built in, as on the runtime: {built_in.relative_to(HERE)} on sys.path, no distribution")


def install_hvdmagic(name: str, venv: Venv, pins: Path) -> tuple[list[str], list[str]]:
    """The profile's ``# install:`` line, the one its docs give users, with ``hvdmagic`` standing for
    this repository and nothing pinned. Returns what it replaced, and what of hvdmagic's own
    requirements the environment then lacks (``pip check``)."""
    before = json.loads((venv.path / "runtime-freeze.json").read_text())
    line = header(pins, "install", rest=True)
    words = [word.strip("\"'") for word in line.split()]
    ours = [word for word in words if re.fullmatch(r"hvdmagic(\[[\w,]+\])?", word)]
    if words[:2] != ["pip", "install"] or len(ours) != 1:
        sys.exit(f"[profiles] {pins.name}: '# install:' must be a 'pip install ... hvdmagic ...' line, not {line!r}")
    say(f"{name}: {line}   (hvdmagic: this repository)")
    venv.pip("install", "-q", *[str(HERE) + word[len("hvdmagic"):] if word in ours else word for word in words[2:]])
    after = venv.freeze()
    replaced = [f"{pkg} {version} -> {after.get(pkg, 'removed')}" for pkg, version in sorted(before.items())
                if after.get(pkg) != version]
    unmet = [line for line in venv.pip("check", check=False).stdout.splitlines() if line.startswith("hvdmagic ")]
    return replaced, unmet


def bring_horovod(name: str, venv: Venv, frameworks: list[str]) -> str:
    """A horovod that imports for these frameworks: the runtime's own, or one built for it."""
    probe = "; ".join(f"import horovod.{'torch' if f == 'pytorch' else 'tensorflow'}" for f in frameworks)
    built = venv.path / ".hvdmagic-horovod-wheel"  # what an earlier run of this script installed
    if venv.run(probe).returncode == 0:
        return "built" if built.exists() else "the runtime's"
    venv.pip("install", "-q", "setuptools", "wheel", "cloudpickle", "psutil", "pyyaml", "packaging", "cffi",
             constraints=venv.path / "constraints.txt")
    say(f"{name}: building horovod for {', '.join(frameworks)} (python -m hvdmagic.build_horovod --no-gpu)")
    env = dict(os.environ, PATH=f"{venv.path / 'bin'}:{os.environ['PATH']}", PIP_CONSTRAINT="")
    result = subprocess.run([venv.python, "-m", "hvdmagic.build_horovod", "--no-gpu", "--frameworks",
                             ",".join(frameworks)], env=env, text=True, capture_output=True)
    (venv.path / "horovod-build.log").write_text(result.stderr)
    if result.returncode != 0:
        last = result.stderr.strip().splitlines()[-1:] or ["no output"]
        return f"build failed: {last[0]}"
    wheel = result.stdout.strip().splitlines()[-1]
    venv.pip("install", "-q", "--no-deps", "--force-reinstall", wheel)
    built.write_text(wheel)
    return "built" if venv.run(probe).returncode == 0 else "built, but does not import"


def install_test_tools(venv: Venv, ipywidgets: str) -> str | None:
    """pytest and the rest, beside the runtime; returns the Python that serves JupyterLab when it is not
    the profile's own (ipywidgets 7)."""
    if not ipywidgets.startswith("7."):
        venv.pip("install", "-q", *TEST_TOOLS, LAB_FOR_WIDGETS_8, constraints=venv.path / "constraints.txt")
        return None
    venv.pip("install", "-q", *TEST_TOOLS, constraints=venv.path / "constraints.txt")
    lab = Venv("lab3")
    stamp = LAB3 / ".hvdmagic-lab3"
    if not (stamp.exists() and stamp.read_text() == " ".join(LAB3_PINS)):
        say(f"a JupyterLab 3.6 front end for ipywidgets 7 in {LAB3.name}: {' '.join(LAB3_PINS)}")
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(LAB3)], check=True)
        (LAB3 / ".gitignore").write_text("*\n")
        lab.pip("install", "-q", *LAB3_PINS)
        stamp.write_text(" ".join(LAB3_PINS))
    return lab.python


def write_constraints(venv: Venv) -> dict[str, str]:
    """Everything installed, as pins: later installs may add packages, never move one. Returns them."""
    installed = venv.freeze()
    pins = [f"{pkg}=={version}" for pkg, version in sorted(installed.items()) if pkg not in ("pip", "hvdmagic")]
    (venv.path / "constraints.txt").write_text("\n".join(pins) + "\n")
    return installed


def run_tests(venv: Venv, report: Path, lab_python: str | None) -> dict[str, int]:
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PATH=f"{venv.path / 'bin'}:{os.environ['PATH']}")
    if lab_python:
        env["HVDMAGIC_LAB_PYTHON"] = lab_python
    env.pop("HVDMAGIC_FAIL_ON_SKIP", None)  # a profile may lack what a test needs: its skips are listed
    cmd = [venv.python, "-m", "pytest", "-p", "no:cacheprovider", "-ra", "--nbval-lax", "--junitxml", str(report),
           *PROFILE_TESTS]
    say(f"running {' '.join(cmd[2:])}")
    subprocess.run(cmd, cwd=HERE, env=env)
    return junit_counts(report)


def junit_counts(report: Path) -> dict[str, int]:
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    if not report.exists():
        return dict(counts, failed=1)
    text = report.read_text()
    match = re.search(r'<testsuite [^>]*errors="(\d+)" failures="(\d+)" skipped="(\d+)" tests="(\d+)"', text)
    if match:
        errors, failures, skipped, tests = map(int, match.groups())
        counts.update(failed=errors + failures, skipped=skipped, passed=tests - errors - failures - skipped)
    return counts


def run_profile(name: str, setup_only: bool = False) -> dict:
    pins = profile_file(name)
    venv = Venv(name)
    started = time.monotonic()
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=HERE, capture_output=True, text=True)
    result: dict = {"profile": name, "date": datetime.date.today().isoformat(), "commit": commit.stdout.strip(),
                    "python_wanted": header(pins, "python"), "spark": header(pins, "spark")}
    try:
        fresh = set_up_runtime(name, venv, pins)
        result["runtime_installed_now"] = fresh
        result["install"] = header(pins, "install", rest=True)
        result["replaced"], result["unmet"] = install_hvdmagic(name, venv, pins)
        if result["replaced"]:
            say(f"{name}: the install REPLACED runtime packages: {'; '.join(result['replaced'])}")
        if result["unmet"]:
            say(f"{name}: hvdmagic's requirements are not met: {'; '.join(result['unmet'])}")
        have = write_constraints(venv)
        frameworks = ["pytorch"] + (["tensorflow"] if "tensorflow" in have or "tensorflow-cpu" in have else [])
        result["horovod_source"] = bring_horovod(name, venv, frameworks)
        write_constraints(venv)
        lab_python = install_test_tools(venv, have.get("ipywidgets", ""))
        result["front_end"] = "JupyterLab 3.6 (.venv-lab3)" if lab_python else "JupyterLab 4 (its own)"
        result["setup_s"] = round(time.monotonic() - started, 1)
        versions = venv.freeze()
        result["python"] = venv.run("import platform; print(platform.python_version())").stdout.strip()
        result["versions"] = {pkg: versions.get(pkg) for pkg in SHOWN}
        if result["versions"]["pyspark"] is None:  # built in, as on Databricks: no distribution to list
            built_in = venv.run("import pyspark; print(pyspark.__version__)").stdout.strip()
            result["versions"]["pyspark"] = f"{built_in} (built in)" if built_in else None
        if setup_only:
            return result
        tests_started = time.monotonic()
        RESULTS.mkdir(parents=True, exist_ok=True)
        result["tests"] = run_tests(venv, RESULTS / f"{name}.junit.xml", lab_python)
        result["tests_s"] = round(time.monotonic() - tests_started, 1)
    except ProfileFailed as exc:
        result["error"] = str(exc)
        result.setdefault("setup_s", round(time.monotonic() - started, 1))
    result["green"] = (not result.get("error") and not result.get("replaced") and not result.get("unmet")
                       and result.get("tests", {}).get("failed", 1) == 0)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=1))
    return result


def table() -> str:
    header = ["profile", "Python", *SHOWN, "browser front end", "what the install line replaced (or left unmet)",
              "tests passed / failed / skipped", "set-up", "tests", "run on", "commit"]
    rows = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for path in sorted(RESULTS.glob("*.json")):
        r = json.loads(path.read_text())
        versions = r.get("versions", {})
        shown = [versions.get(pkg) or "–" for pkg in SHOWN]
        if r.get("horovod_source"):
            shown[SHOWN.index("horovod")] = f"{versions.get('horovod') or '–'} ({r['horovod_source']})"
        t = r.get("tests", {})
        counts = f"{t.get('passed', 0)} / {t.get('failed', 0)} / {t.get('skipped', 0)}" if t else r.get("error", "–")
        changed = "; ".join(r.get("replaced", []) + r.get("unmet", [])) or "none"
        cells = [r["profile"], r.get("python", r["python_wanted"]), *shown, r.get("front_end", "–"), changed, counts,
                 f"{r.get('setup_s', '–')} s", f"{r.get('tests_s', '–')} s", r["date"], r.get("commit", "–")]
        rows.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(rows)


def write_docs(text: str) -> None:
    page = RUNTIMES_DOC.read_text()
    begin, end = page.find(TABLE_BEGIN), page.find(TABLE_END)
    if begin < 0 or end < begin:
        sys.exit(f"[profiles] docs/runtimes.md has no {TABLE_BEGIN} ... {TABLE_END} block")
    RUNTIMES_DOC.write_text(page[:begin + len(TABLE_BEGIN)] + "\n" + text + "\n" + page[end:])


def main() -> None:
    parser = argparse.ArgumentParser(prog="scripts/profiles.py")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="set up and test profiles")
    run.add_argument("names", nargs="*", help="profiles (default: every file in requirements/profiles)")
    run.add_argument("--setup-only", action="store_true", help="stop before the tests (and write no result)")
    shown = sub.add_parser("table", help="print the table of the last results")
    shown.add_argument("--docs", action="store_true", help="also write it into docs/runtimes.md")
    args = parser.parse_args()
    if args.command == "run":
        names = args.names or sorted(p.stem for p in PROFILES.glob("*.txt"))
        results = [run_profile(name, args.setup_only) for name in names]
        if args.setup_only:
            sys.exit(0 if not any(r.get("error") for r in results) else 1)
        print(table())
        sys.exit(0 if all(r["green"] for r in results) else 1)
    text = table()
    print(text)
    if args.docs:
        write_docs(text)


if __name__ == "__main__":
    main()
