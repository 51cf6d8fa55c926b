"""Peer suites: horovod's own torch and TensorFlow tests under horovodrun and under hvdmagic.run.

Issue 38 (rank templates) is done when horovod's own suites, run through ``hvdmagic.run``,
still give horovodrun's outcomes. This script checks that. For each suite it:

1. extracts the suite and the helper modules it imports (``test/parallel``, ``test/utils``)
   from a horovod git directory at a tag (default v0.28.1, the installed horovod) into a
   temporary directory;
2. patches the copy that every launcher runs: the ``hvd.shutdown()`` in ``tearDown`` is
   dropped (docs/frameworks.md, "Workaround under horovodrun": horovod 0.28.1's rendezvous
   server loses re-initialising suites under horovodrun), and ``import mock`` becomes
   ``unittest.mock`` where the ``mock`` package is absent;
3. runs it three times, each rank writing its own junit file:
   - ``horovodrun -np N --gloo -H localhost:N python -m pytest ...``, its ranks given the
     variables hvdmagic adds to its own (TF_USE_LEGACY_KERAS=1 where TF would give Keras 3;
     ``--raw-horovodrun-env`` leaves them out),
   - ``hvdmagic.run(fn, np=-N)`` (local mode) with rank templates on (the default),
   - the same with ``HVDMAGIC_TEMPLATE=0`` in the calling process (ranks spawned);
4. compares every test's outcome per rank across the three, prints counts and every
   difference, and writes all of it to a JSON report.

Each launcher runs in its own process group under a deadline (``--deadline``), killed on expiry.

Run (from the repository root)::

    git clone https://github.com/horovod/horovod ../horovod                     # once
    nice -n 10 .venv/bin/python scripts/peer_suites.py --repo ../horovod           # torch and TF suites
    nice -n 10 .venv/bin/python scripts/peer_suites.py --repo ../horovod --suites test_torch.py -k allreduce

The exit status is 0 when every launcher ran to its end and all agree on every test, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

DEFAULT_REF = "v0.28.1"
DEFAULT_SUITES = ("test_torch.py", "test_tensorflow.py")
HELPER_DIRS = ("test/parallel", "test/utils")
LAUNCHERS = {"horovodrun": "horovodrun", "template": "hvdmagic template on", "spawn": "hvdmagic template off"}
OUTCOMES = ("passed", "failed", "error", "skipped", "missing")
# A worse outcome wins where one test has several junit entries (a failed call and a teardown error).
SEVERITY = {"passed": 0, "skipped": 1, "error": 2, "failed": 3}
# Assertions on wall time that a loaded 2-core machine breaks on any launcher.
KNOWN_TIMING = ("test_global_barrier_op",)

STREAM_ENV = "PEER_SUITES_STREAM_DIR"
# A pytest plugin that appends each result as it comes: pytest writes the junit file at the
# end of the session only, so a rank that aborts (the rendezvous race) leaves none, and this
# stream is then the only record of how far it got and where it died.
STREAM_PLUGIN = '''\
import json, os


def _write(record):
    directory = os.environ.get("PEER_SUITES_STREAM_DIR")
    if directory:
        rank = os.environ.get("HOROVOD_RANK", "x")
        with open(os.path.join(directory, f"rank{rank}.jsonl"), "a") as stream:
            stream.write(json.dumps(record) + "\\n")


def pytest_runtest_logstart(nodeid, location):
    _write({"start": nodeid})


def pytest_runtest_logreport(report):
    message = ""
    if report.failed:
        text = getattr(report, "longreprtext", "") or ""
        message = next((line for line in reversed(text.splitlines()) if line.startswith("E ")), "")
    elif report.skipped and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])
    _write({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "message": message[:300]})
'''


# ---------------------------------------------------------------------------------------------
# Extraction


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def imported_top_modules(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def drop_teardown_shutdown(source: str) -> tuple[str, int]:
    """Replace ``hvd.shutdown()`` statements inside any ``tearDown`` with ``pass``."""
    lines = source.splitlines(keepends=True)
    dropped = 0
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.FunctionDef) and node.name == "tearDown"):
            continue
        for statement in ast.walk(node):
            if (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
                    and isinstance(statement.value.func, ast.Attribute) and statement.value.func.attr == "shutdown"):
                index = statement.lineno - 1
                indent = re.match(r"\s*", lines[index]).group(0)
                lines[index] = f"{indent}pass  # peer_suites: tearDown shutdown dropped (horovodrun rendezvous race)\n"
                dropped += 1
    return "".join(lines), dropped


def extract(repo: str, ref: str, suite: str, dest: Path) -> dict:
    """Write the suite and the helpers it imports (transitively) under dest; returns what was patched."""
    listed = git(repo, "ls-tree", "-r", "--name-only", ref, *HELPER_DIRS).split()
    helpers = {Path(path).stem: path for path in listed if path.endswith(".py")}
    suite_path = suite if "/" in suite else f"test/parallel/{suite}"
    pending, sources = [suite_path], {}
    while pending:
        path = pending.pop()
        if path in sources:
            continue
        sources[path] = git(repo, "show", f"{ref}:{path}")
        pending.extend(helpers[name] for name in imported_top_modules(sources[path]) if name in helpers)
    patches = []
    for path, source in sources.items():
        source, dropped = drop_teardown_shutdown(source)
        if dropped:
            patches.append(f"{path}: {dropped} hvd.shutdown() in tearDown replaced by pass")
        if importlib.util.find_spec("mock") is None and re.search(r"^import mock$", source, re.M):
            # The mock backport is not in the venv; the stdlib module is the same API.
            source = re.sub(r"^import mock$", "from unittest import mock", source, flags=re.M)
            patches.append(f"{path}: 'import mock' -> 'from unittest import mock' (mock package absent)")
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(source)
    # An empty pytest.ini pins rootdir (hence the junit classnames) to the suite's directory for
    # every launcher, and keeps any project's pytest configuration above it out.
    (dest / suite_path).parent.joinpath("pytest.ini").write_text("[pytest]\n")
    (dest / "plugins").mkdir(exist_ok=True)
    (dest / "plugins" / "peer_stream.py").write_text(STREAM_PLUGIN)
    return {"suite_path": suite_path, "files": sorted(sources), "patches": patches}


# ---------------------------------------------------------------------------------------------
# Launchers


def pytest_args(suite_file: str, junit_file: str, extra: list[str]) -> list[str]:
    return ["-p", "no:cacheprovider", "-p", "peer_stream", "-q", f"--junitxml={junit_file}", *extra, suite_file]


def run_bounded(cmd: list[str], cwd: Path, env: dict, log: Path, deadline: float) -> dict:
    """Run cmd in its own process group, output to log; kill the group when the deadline passes."""
    started = time.monotonic()
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            rc = process.wait(timeout=deadline)
            expired = False
        except subprocess.TimeoutExpired:
            expired = True
            for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 20)):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = process.returncode
    return {"rc": rc, "expired": expired, "seconds": round(time.monotonic() - started, 1)}


def hvdmagic_rank_environment() -> dict[str, str]:
    """What hvdmagic adds to every rank's environment that horovodrun does not: TF_USE_LEGACY_KERAS=1
    where TensorFlow >= 2.16 would give Keras 3 and tf_keras is installed (docs/frameworks.md)."""
    from hvdmagic.task.environment import keras_environment

    return {key: value for key, value in keras_environment().items() if key == "TF_USE_LEGACY_KERAS"}


def run_horovodrun(workdir: Path, suite_file: str, out: Path, np_: int, extra: list[str], deadline: float,
                   added_env: dict[str, str]) -> dict:
    horovodrun = str(Path(sys.executable).parent / "horovodrun")
    # Each rank's junit file is named from HOROVOD_RANK, which horovodrun sets per rank: sh expands
    # it in the rank, so it alone stays unquoted. "$0" is the venv's python, given as sh's argument.
    marker = "@JUNIT@"
    args = " ".join(shlex.quote(arg) for arg in pytest_args(suite_file, marker, extra))
    args = args.replace(marker, shlex.quote(str(out / "junit")) + "/rank$HOROVOD_RANK.xml")
    cmd = [horovodrun, "-np", str(np_), "--gloo", "-H", f"localhost:{np_}",
           "sh", "-c", f'exec "$0" -m pytest {args}', sys.executable]
    env = dict(os.environ, PYTHONPATH=str(workdir.parent.parent / "plugins"), **{STREAM_ENV: str(out / "stream")},
               **added_env)
    result = run_bounded(cmd, workdir, env, out / "output.log", deadline)
    result["added_env"] = added_env
    result["command"] = (f"cd {workdir} && " + "".join(f"{k}={v} " for k, v in added_env.items())
                         + "PYTHONPATH=<plugins> " + " ".join(shlex.quote(arg) for arg in cmd))
    return result


def run_hvdmagic(workdir: Path, suite_file: str, out: Path, np_: int, extra: list[str], deadline: float,
                 template: bool, framework: str) -> dict:
    # A fresh calling process per run: HVDMAGIC_TEMPLATE is read on the kernel's side, and
    # nothing of one run's kernel state reaches the next.
    cmd = [sys.executable, os.path.abspath(__file__), "--_hvdmagic-child", json.dumps({
        "workdir": str(workdir), "suite_file": suite_file, "out": str(out), "np": np_, "extra": extra,
        "deadline": deadline, "template": template, "framework": framework})]
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1")
    env.pop("HVDMAGIC_TEMPLATE", None)
    if not template:
        env["HVDMAGIC_TEMPLATE"] = "0"
    # The child's own timeout (hvdmagic.run's) comes first; this one only catches a stuck kernel side.
    result = run_bounded(cmd, workdir, env, out / "output.log", deadline + 120)
    child = out / "child.json"
    if child.exists():
        result.update(json.loads(child.read_text()))
    result["command"] = (f"{'' if template else 'HVDMAGIC_TEMPLATE=0 '}hvdmagic.run(fn, np=-{np_}) with fn: "
                         f"pytest.main({pytest_args(suite_file, str(out / 'junit/rank{rank}.xml'), extra)})")
    return result


def _rank_pytest(workdir, plugin_dir, out, args):
    import os
    import sys

    import pytest

    os.chdir(workdir)
    sys.path.insert(0, plugin_dir)
    os.environ["PEER_SUITES_STREAM_DIR"] = os.path.join(out, "stream")
    rank = os.environ["HOROVOD_RANK"]
    args = [arg.replace("{rank}", rank) for arg in args]
    # pytest.main returns the exit code (1 when a test fails): a value, not a failed rank.
    return int(pytest.main(args))


# The framework imports stay in the function's own code: hvdmagic reads them from its bytecode
# to choose what the host's template imports ahead, as it would for a notebook cell.
def _rank_torch(workdir, plugin_dir, out, args):
    import horovod.torch  # noqa: F401
    import torch  # noqa: F401

    return _rank_pytest(workdir, plugin_dir, out, args)


def _rank_tensorflow(workdir, plugin_dir, out, args):
    import horovod.tensorflow  # noqa: F401
    import tensorflow  # noqa: F401

    return _rank_pytest(workdir, plugin_dir, out, args)


def _rank_other(workdir, plugin_dir, out, args):
    return _rank_pytest(workdir, plugin_dir, out, args)


def hvdmagic_child(spec: dict) -> int:
    """In the calling process of one hvdmagic run: run the suite on the ranks, record what happened."""
    import hvdmagic
    from hvdmagic.errors import JobFailed

    out = Path(spec["out"])
    fn = {"torch": _rank_torch, "tensorflow": _rank_tensorflow}.get(spec["framework"], _rank_other)
    args = pytest_args(spec["suite_file"], str(out / "junit" / "rank{rank}.xml"), spec["extra"])
    plugin_dir = str(Path(spec["workdir"]).parent.parent / "plugins")
    record: dict = {"template_env": os.environ.get("HVDMAGIC_TEMPLATE", "(unset: on)")}
    try:
        record["rank_results"] = hvdmagic.run(fn, -spec["np"], spec["workdir"], plugin_dir, str(out), args,
                                              timeout=spec["deadline"])
    except JobFailed as error:
        record["job_failed"] = f"{type(error).__name__}: {str(error).strip()[:2000]}"
        if type(error).__name__ == "JobTimeout":
            record["expired"] = True
    try:
        last = hvdmagic.last_run()
        record["stages"] = {k: round(v, 2) for k, v in (last.timings or {}).get("stages", {}).items()}
        record["notes"] = [str(note)[:500] for note in (last.notes or [])]
    except Exception as error:  # the record is a diagnostic; its absence must not hide the outcomes
        record["stages_error"] = repr(error)
    (out / "child.json").write_text(json.dumps(record, indent=1, default=str))
    return 0


# ---------------------------------------------------------------------------------------------
# Outcomes


def mangle(nodeid: str) -> str:
    """pytest's junit name for a node id (junitxml.mangle_test_address): 'classname::name'."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]) + "::" + names[-1]


def first_line(text: str | None) -> str:
    return next((line.strip() for line in (text or "").splitlines() if line.strip()), "")[:300]


def merge(outcomes: dict, test: str, outcome: str, message: str) -> None:
    old = outcomes.get(test)
    if old is None or SEVERITY[outcome] > SEVERITY[old["outcome"]]:
        outcomes[test] = {"outcome": outcome, "message": message}


def read_junit(path: Path) -> dict:
    outcomes: dict = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        tags = {child.tag: child for child in case if child.tag in ("failure", "error", "skipped")}
        outcome = next((o for tag, o in (("failure", "failed"), ("error", "error"), ("skipped", "skipped"))
                        if tag in tags), "passed")
        element = tags.get({"failed": "failure"}.get(outcome, outcome))
        message = first_line(element.get("message") or element.text) if element is not None else ""
        merge(outcomes, test, outcome, message)
    return outcomes


def read_stream(path: Path) -> tuple[dict, str | None]:
    """Outcomes from the plugin's stream, with the test that started and never reported (an abort)."""
    outcomes: dict = {}
    started = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by the abort
            continue
        if "start" in record:
            started = record["start"]
            continue
        test, when, result = mangle(record["nodeid"]), record["when"], record["outcome"]
        if result == "failed":
            merge(outcomes, test, "failed" if when == "call" else "error", record["message"])
        elif result == "skipped":
            merge(outcomes, test, "skipped", record["message"])
        elif when == "call":
            merge(outcomes, test, "passed", "")
        if when == "teardown" and started == record["nodeid"]:
            started = None
    return outcomes, started


def collect(out: Path, np_: int) -> dict:
    ranks = {}
    for rank in range(np_):
        junit, stream = out / "junit" / f"rank{rank}.xml", out / "stream" / f"rank{rank}.jsonl"
        entry: dict = {"source": None, "outcomes": {}, "died_in": None}
        if stream.exists():
            streamed, entry["died_in"] = read_stream(stream)
        if junit.exists():
            entry.update(source="junit", outcomes=read_junit(junit), died_in=None)
        elif stream.exists():
            entry.update(source="stream (no junit file: the rank did not finish)", outcomes=streamed)
        ranks[str(rank)] = entry
    return ranks


def per_rank(ranks: dict, test: str) -> list[str]:
    return [ranks[r]["outcomes"].get(test, {}).get("outcome", "missing") for r in sorted(ranks, key=int)]


def combined(outcomes: list[str]) -> str:
    if len(set(outcomes)) == 1:
        return outcomes[0]
    return "mixed(" + ", ".join(f"r{rank}={o}" for rank, o in enumerate(outcomes)) + ")"


def compare(launchers: dict) -> tuple[dict, list]:
    tests = sorted({test for run in launchers.values() for rank in run["ranks"].values() for test in rank["outcomes"]})
    counts = {}
    for name, run in launchers.items():
        tally = dict.fromkeys(OUTCOMES + ("mixed",), 0)
        for test in tests:
            outcome = combined(per_rank(run["ranks"], test))
            tally["mixed" if outcome.startswith("mixed") else outcome] += 1
        counts[name] = tally
    differences = []
    for test in tests:
        sides = {name: per_rank(run["ranks"], test) for name, run in launchers.items()}
        if len({tuple(v) for v in sides.values()}) == 1:
            continue
        entry = {"test": test, "known_timing_assertion": any(t in test for t in KNOWN_TIMING), "sides": {}}
        for name, outcomes in sides.items():
            ranks = launchers[name]["ranks"]
            messages = [ranks[r]["outcomes"].get(test, {}).get("message", "") for r in sorted(ranks, key=int)]
            entry["sides"][name] = {"outcome": combined(outcomes), "message": next((m for m in messages if m), "")}
        on, off, ref = (tuple(sides.get(k, ())) for k in ("template", "spawn", "horovodrun"))
        entry["template_on_differs_from_off"] = "template" in sides and "spawn" in sides and on != off
        # The template's own signature: it alone differs, the spawned ranks agree with horovodrun.
        entry["template_on_alone"] = bool(entry["template_on_differs_from_off"] and "horovodrun" in sides
                                          and off == ref)
        differences.append(entry)
    return counts, differences


# ---------------------------------------------------------------------------------------------


def framework_of(suite: str) -> str:
    name = Path(suite).stem
    if "torch" in name:
        return "torch"
    if "tensorflow" in name or "keras" in name:
        return "tensorflow"
    return "other"


def run_suite(suite: str, options, root: Path) -> dict:
    workroot = root / Path(suite).stem
    extracted = extract(options.repo, options.ref, suite, workroot / "src")
    workdir = (workroot / "src" / extracted["suite_path"]).parent
    suite_file = Path(extracted["suite_path"]).name
    report = {"suite": suite, "ref": options.ref, "extracted": extracted, "workdir": str(workdir), "launchers": {}}
    for launcher in options.launchers:
        out = workroot / launcher
        for sub in ("junit", "stream"):
            (out / sub).mkdir(parents=True, exist_ok=True)
        print(f"[{suite}] {LAUNCHERS[launcher]}: running (deadline {options.deadline:.0f} s, log {out / 'output.log'})",
              flush=True)
        if launcher == "horovodrun":
            result = run_horovodrun(workdir, suite_file, out, options.np, options.pytest_extra, options.deadline,
                                    options.horovodrun_env)
        else:
            result = run_hvdmagic(workdir, suite_file, out, options.np, options.pytest_extra, options.deadline,
                                  template=launcher == "template", framework=framework_of(suite))
        result["ranks"] = collect(out, options.np)
        result["log"] = str(out / "output.log")
        if result.get("expired"):
            print(f"[{suite}] {LAUNCHERS[launcher]}: DEADLINE of {options.deadline:.0f} s PASSED, killed; "
                  f"outcomes below are the tests that reported before it", flush=True)
        died = {r: e["died_in"] for r, e in result["ranks"].items() if e["died_in"]}
        note = f"; rank(s) stopped in a test: {died}" if died else ""
        partial = [r for r, e in result["ranks"].items() if e["source"] != "junit"]
        if partial:
            note += f"; no junit file from rank(s) {', '.join(partial)} (outcomes from the stream, if any)"
        print(f"[{suite}] {LAUNCHERS[launcher]}: rc {result['rc']} after {result['seconds']} s"
              f"{'; ' + result['job_failed'].splitlines()[0] if result.get('job_failed') else ''}{note}", flush=True)
        report["launchers"][launcher] = result
    report["counts"], report["differences"] = compare(report["launchers"])
    return report


def print_summary(report: dict) -> None:
    print(f"\n== {report['suite']} ({report['ref']}); patches applied to every launcher's copy:")
    for patch in report["extracted"]["patches"]:
        print(f"   {patch}")
    added = report["launchers"].get("horovodrun", {}).get("added_env")
    if added:
        print(f"   horovodrun's ranks got what hvdmagic's get: {' '.join(f'{k}={v}' for k, v in added.items())}")
    print(f"   {'launcher':<22}" + "".join(f"{o:>9}" for o in OUTCOMES + ("mixed",)) + "  seconds  exit")
    for name, tally in report["counts"].items():
        run = report["launchers"][name]
        # horovodrun's exit status; for hvdmagic, what pytest.main returned on each rank.
        exit_ = f"pytest {run['rank_results']}" if "rank_results" in run else f"rc {run['rc']}"
        print(f"   {LAUNCHERS[name]:<22}" + "".join(f"{tally[o]:>9}" for o in OUTCOMES + ("mixed",))
              + f"  {run['seconds']:>7}  {exit_}" + ("  EXPIRED" if run.get("expired") else "")
              + ("  JOB FAILED" if run.get("job_failed") else ""))
    print(f"   {len(report['differences'])} test(s) whose outcome differs between launchers:")
    for diff in report["differences"]:
        flags = [f for f, on in (("known timing assertion", diff["known_timing_assertion"]),
                                 ("TEMPLATE ON ALONE", diff["template_on_alone"])) if on]
        print(f"   - {diff['test']}" + (f"  [{', '.join(flags)}]" if flags else ""))
        for name, side in diff["sides"].items():
            print(f"       {LAUNCHERS[name]:<22} {side['outcome']:<10} {side['message'][:150]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", required=True,
                        help="horovod's git directory: a clone of https://github.com/horovod/horovod (its tags)")
    parser.add_argument("--ref", default=DEFAULT_REF, help="tag or commit to extract (default: %(default)s)")
    parser.add_argument("--suites", default=",".join(DEFAULT_SUITES),
                        help="comma-separated suites under test/parallel (default: %(default)s)")
    parser.add_argument("--np", type=int, default=2, help="ranks (default: %(default)s)")
    parser.add_argument("--launchers", default=",".join(LAUNCHERS),
                        help="comma-separated, from horovodrun,template,spawn (default: all three)")
    parser.add_argument("--deadline", type=float, default=1500.0,
                        help="seconds per suite and launcher before its processes are killed (default: %(default)s)")
    parser.add_argument("--out", default="artifacts/peer_suites.json", help="JSON report (default: %(default)s)")
    parser.add_argument("--workdir", help="where to extract and keep logs/junit files (default: a new temp dir)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, passed to every launcher")
    parser.add_argument("--maxfail", type=int, help="pytest --maxfail, passed to every launcher")
    parser.add_argument("--raw-horovodrun-env", action="store_true",
                        help="do not give horovodrun's ranks the variables hvdmagic adds to its ranks' environment "
                             "(TF_USE_LEGACY_KERAS=1 on TF >= 2.16 with tf_keras); by default they get them, so "
                             "that a difference is the launcher's, not Keras 2 versus Keras 3")
    parser.add_argument("--_hvdmagic-child", dest="child", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child:
        return hvdmagic_child(json.loads(options.child))

    options.launchers = [name.strip() for name in options.launchers.split(",") if name.strip()]
    unknown = set(options.launchers) - set(LAUNCHERS)
    if unknown:
        parser.error(f"unknown launcher(s) {sorted(unknown)}; choose from {list(LAUNCHERS)}")
    options.pytest_extra = (["-k", options.keyword] if options.keyword else []) + (
        [f"--maxfail={options.maxfail}"] if options.maxfail else [])
    # Not in os.environ: hvdmagic's own runs must still decide it themselves, as in a notebook.
    options.horovodrun_env = {} if options.raw_horovodrun_env else hvdmagic_rank_environment()
    root = Path(options.workdir or tempfile.mkdtemp(prefix="peer_suites-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    print(f"work directory (extracted suites, logs, junit files): {root}", flush=True)

    reports = [run_suite(suite.strip(), options, root) for suite in options.suites.split(",") if suite.strip()]
    for report in reports:
        print_summary(report)
    document = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv, "np": options.np,
                "pytest_extra": options.pytest_extra, "workdir": str(root),
                "horovodrun_added_env": options.horovodrun_env,
                "same_code_note": "every launcher ran the identical extracted copy, with the patches listed",
                "suites": reports}
    out = Path(options.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1, default=str))
    print(f"\nreport: {out}")
    clean = all(not r["differences"] and all(not run.get("expired") and not run.get("job_failed")
                                             and all(e["source"] == "junit" for e in run["ranks"].values())
                                             for run in r["launchers"].values()) for r in reports)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
