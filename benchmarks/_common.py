"""What the benchmarks share (scripts/soak.py uses it too), each written once.

- statistics: ``percentile``, ``describe``, ``paired_ratios``, ``ratio_of_totals``, ``bootstrap_median_ci``,
  ``paired``, ``num``, and ``rotated`` (each round's order of the systems that take turns);
- the machine and the code under test: ``machine``, ``versions``, ``code_under_test``, ``environment``;
- /proc and processes: ``proc_start_time``, ``thread_cpu``, ``process_tree``, ``process_role``,
  ``GcPauses`` for this process's garbage collections, and ``LoadMonitor`` for the other work
  on the machine;
- the command line: ``add_counts`` and ``counts`` (options with a full-run and a ``--quick`` default);
- output: ``Log`` (progress lines on stderr), ``captured``, ``write_json``, ``command_line``;
- hvdmagic: ``start_spark``, ``ipython_shell``, ``run_cell`` (one cell, its output kept out of the
  terminal) and ``checked_cell`` (the same, raising when the cell fails).

Importing this module needs the standard library only: bench_data.py also runs under a
separate Petastorm interpreter. ``proc_start_time``, ``thread_cpu`` and ``GcPauses`` run
inside rank processes too, shipped as source text (workloads.py) or by value with
cloudpickle (bench_report.py), so they import what they need themselves.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------

def percentile(values, q: float) -> float:
    """The q-th percentile (linear interpolation, like numpy's default); nan for no values."""
    data = sorted(values)
    if not data:
        return float("nan")
    pos = (len(data) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def describe(values, **percentiles: float) -> dict:
    """n, median, min and max of the values that are not None, and each named percentile.

    ``describe(v, q1=25, q3=75)`` adds the quartiles as "q1" and "q3"; ``describe(v, p99=99)``
    the 99th percentile. With no values: ``{"n": 0}``.
    """
    data = sorted(v for v in values if v is not None)
    if not data:
        return {"n": 0}
    out = {"n": len(data), "median": statistics.median(data), "min": data[0], "max": data[-1]}
    out.update((name, percentile(data, q)) for name, q in percentiles.items())
    return out


def paired_ratios(a: list, b: list) -> list:
    """a[i]/b[i] for the pairs where both exist (a pair = the same round, adjacent in time)."""
    return [x / y for x, y in zip(a, b) if x is not None and y]


def ratio_of_totals(a: list, b: list) -> float | None:
    """sum(a) / sum(b) over the pairs where both exist; None when there are none.

    Beside the median of ``paired_ratios``: this weighs each round by its size (a slow round
    counts more), the median weighs each round equally and ignores outliers. Two summaries
    that disagree say the rounds were uneven.
    """
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    total = sum(y for _, y in pairs)
    return sum(x for x, _ in pairs) / total if pairs and total else None


def bootstrap_median_ci(values: list, resamples: int = 4000, seed: int = 1) -> tuple[float, float]:
    """The 95 % interval of the median, by bootstrap (seeded, so a rerun gives the same interval)."""
    draw = random.Random(seed)
    medians = sorted(statistics.median(draw.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def paired(a: list, b: list, totals: bool = False, **percentiles: float) -> dict:
    """a[i]/b[i] per round: ``describe`` of the ratios (with ``percentiles``), the ratio of the
    totals if ``totals``, and the 95 % bootstrap interval of their median from 3 rounds on."""
    ratios = paired_ratios(a, b)
    out = describe(ratios, **percentiles)
    if totals:
        out["ratio_of_totals"] = ratio_of_totals(a, b)
    if len(ratios) >= 3:
        out["median_ci95"] = list(bootstrap_median_ci(ratios))
    return out


def rotated(items: list, r: int) -> list:
    """Round r's order: ``items`` starting r places in, so that none always runs first (or after
    the same one) on a machine whose load changes."""
    k = r % len(items) if items else 0
    return items[k:] + items[:k]


def num(value) -> str:
    """A figure for a table: two decimals, "-" for None."""
    return "-" if value is None else f"{value:.2f}"


# ---------------------------------------------------------------------------
# The machine and the code under test
# ---------------------------------------------------------------------------

def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" where there is none)."""
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return ""


def machine() -> dict:
    """Python, OS, cores, CPU model and memory of this machine."""
    import psutil

    return {"python": platform.python_version(), "platform": platform.platform(), "cores": os.cpu_count() or 1,
            "cpu_model": cpu_model(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)}


def versions(*modules: str) -> dict:
    """{module: its __version__} for each module named (imported here)."""
    import importlib

    return {name: getattr(importlib.import_module(name), "__version__", None) for name in modules}


def code_under_test() -> dict:
    """Which hvdmagic this process imports, and its git state when that is a checkout."""
    import hvdmagic

    where = Path(hvdmagic.__file__).resolve().parent.parent
    info: dict = {"path": str(where)}

    def git(*args: str) -> str:  # --no-optional-locks: reading the state never rewrites the index
        return subprocess.run(["git", "--no-optional-locks", *args], cwd=where, capture_output=True, text=True,
                              check=True).stdout

    try:
        info["git_head"] = git("rev-parse", "HEAD").strip()
        info["uncommitted_changes_in_hvdmagic"] = bool(git("status", "--porcelain", "hvdmagic").strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def environment(*modules: str, **extra) -> dict:
    """What a benchmark's JSON records of the machine, the ``modules``' versions and the code, with ``extra``."""
    return {**machine(), **versions(*modules), "code": code_under_test(), "load_at_start": os.getloadavg(), **extra}


# ---------------------------------------------------------------------------
# /proc and processes
# ---------------------------------------------------------------------------

def proc_start_time() -> float:
    """When this process was created, on the wall clock (from /proc/self/stat: clock-tick resolution).

    Self-contained (its imports inside, no psutil): workloads.py runs its source in the ranks.
    """
    import os
    import time

    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def thread_cpu(tid: int | None) -> float | None:
    """CPU seconds (user + system) of thread ``tid`` (a ``native_id``) of this process, from
    /proc (clock-tick resolution); None when it cannot be read.

    Self-contained (its imports inside): it runs in the ranks (workloads.py, bench_report.py).
    """
    import os

    if tid is None:
        return None
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def process_tree(proc=None) -> list:
    """``proc`` (this process by default) and every process below it; ``[proc]`` when they cannot be listed."""
    import psutil

    proc = proc or psutil.Process()
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return [proc]


def process_role(cmdline: str, name: str = "") -> str:
    """What a process is to a run, from its command line (and name): "rank", "jvm" (Spark's),
    "spark_python" (Spark's Python daemon and workers, which host the supervisors) or "other"."""
    if "hvdmagic.rank" in cmdline:
        return "rank"
    if "java" in name or "SparkSubmit" in cmdline:
        return "jvm"
    if "pyspark" in cmdline:
        return "spark_python"
    return "other"


class GcPauses:
    """This process's garbage collections while active: ``pauses``, a list of
    (wall time at the end, seconds, generation).

    ``with GcPauses() as pauses:`` or ``start()``/``stop()``. Runs in ranks too (by value).
    """

    def __init__(self):
        self.pauses: list[tuple[float, float, int]] = []
        self._began = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses.append((time.time(), time.perf_counter() - self._began, info["generation"]))

    def start(self) -> GcPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def stop(self) -> None:
        gc.callbacks.remove(self._on_gc)

    __enter__ = start

    def __exit__(self, *exc) -> None:
        self.stop()

    def within(self, start: float | None = None, end: float | None = None) -> list[tuple[float, float, int]]:
        """The pauses that ended between wall times start and end."""
        return [p for p in self.pauses if (start is None or p[0] >= start) and (end is None or p[0] <= end)]

    def summary(self, start: float | None = None, end: float | None = None) -> dict:
        """Collections per generation (0, 1, 2), total and longest pause in ms, between start and end."""
        pauses = self.within(start, end)
        return {"collections": [sum(g == gen for _, _, g in pauses) for gen in range(3)],
                "total_ms": sum(d for _, d, _ in pauses) * 1e3,
                "max_pause_ms": max((d for _, d, _ in pauses), default=0.0) * 1e3}

    def ms_by_generation(self) -> list[float]:
        """Milliseconds spent collecting, per generation (0, 1, 2)."""
        return [sum(d for _, d, g in self.pauses if g == gen) * 1e3 for gen in range(3)]


class LoadMonitor:
    """The CPU that other processes use while a benchmark runs, in cores: the machine's busy
    time minus this process tree's (reaped children included, so that short-lived ranks count
    as ours and short-lived other processes as others'), and load1.

    ``sample()`` gives the figures since the previous sample (bench_session takes one per
    block). ``with LoadMonitor() as monitor:`` also samples every ``interval`` s in a thread,
    into ``samples``, with the other commands that used the most CPU, and ``summary(start, end)``
    adds a stretch of those samples up (bench_launch).
    """

    def __init__(self, interval: float = 2.0):
        self.interval = interval
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-load", daemon=True)
        self._cpu_by_pid: dict[int, float] = {}
        self._last = self._read()

    @staticmethod
    def _read(tree=None) -> tuple[float, float, float]:
        """(monotonic time, the machine's busy CPU seconds, this process tree's CPU seconds)."""
        import psutil

        t = psutil.cpu_times()
        busy = t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "steal", 0)
        ours = 0.0
        for proc in tree or process_tree():
            try:
                c = proc.cpu_times()
                ours += c.user + c.system + c.children_user + c.children_system
            except psutil.Error:
                pass
        return time.monotonic(), busy, ours

    def _since_last(self, tree=None) -> tuple[float, float, float]:
        """(seconds, other processes' CPU seconds, ours) since the previous call."""
        (t0, busy0, ours0), self._last = self._last, self._read(tree)
        t1, busy1, ours1 = self._last
        ours = ours1 - ours0
        return max(t1 - t0, 1e-6), max(busy1 - busy0 - ours, 0.0), ours

    def sample(self) -> dict:
        """Since the previous sample: cores used by others and by us, and the 1-minute load average."""
        span, others, ours = self._since_last()
        return {"seconds": span, "others_cores": others / span, "ours_cores": ours / span,
                "load1": os.getloadavg()[0]}

    def _others_by_command(self, tree) -> dict[str, float]:
        """CPU seconds per command line of the other processes since the previous call (none for a
        process seen for the first time)."""
        import psutil

        ours = {proc.pid for proc in tree}
        current, by_command = {}, {}
        for proc in psutil.process_iter(["name", "cmdline", "cpu_times"]):
            t = proc.info["cpu_times"]
            if t is None or proc.pid in ours:
                continue
            current[proc.pid] = cpu = t.user + t.system
            delta = cpu - self._cpu_by_pid.get(proc.pid, cpu)
            if delta > 0:
                command = " ".join((proc.info["cmdline"] or [proc.info["name"] or "?"])[:3])[:80]
                by_command[command] = by_command.get(command, 0.0) + delta
        self._cpu_by_pid = current
        return by_command

    def __enter__(self) -> LoadMonitor:
        tree = process_tree()
        self._others_by_command(tree)
        self._last = self._read(tree)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                now, tree = time.time(), process_tree()
                _, others, ours = self._since_last(tree)
                self.samples.append({"time": now, "ours_cpu_s": ours, "others_cpu_s": others,
                                     "load1": os.getloadavg()[0], "others_top": self._others_by_command(tree)})
            except Exception:  # a process vanishing mid-scan; the next sample catches up
                pass

    def summary(self, start: float | None = None, end: float | None = None) -> dict:
        """The thread's samples between wall times start and end: cores used by us and by others,
        load1, and the six other commands that used the most CPU (seconds); {} for fewer than 2."""
        rows = [s for s in self.samples if (start is None or s["time"] >= start) and (end is None or s["time"] <= end)]
        if len(rows) < 2:
            return {}
        span = rows[-1]["time"] - rows[0]["time"] + self.interval
        top: dict[str, float] = {}
        for s in rows:
            for command, cpu in s["others_top"].items():
                top[command] = top.get(command, 0.0) + cpu
        return {"seconds": span, "ours_cores": sum(s["ours_cpu_s"] for s in rows) / span,
                "others_cores": sum(s["others_cpu_s"] for s in rows) / span,
                "load1": describe([s["load1"] for s in rows], q1=25, q3=75),
                "others_top": dict(sorted(top.items(), key=lambda kv: -kv[1])[:6])}


# ---------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------

def add_counts(parser, options: dict) -> None:
    """One integer option per ``name: (full-run default, --quick default, help)``; ``{}`` in the help
    says where its defaults go. Not given, it is None: ``counts`` fills the default in."""
    for name, (full, quick, text) in options.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                            help=text.format(f"(default {full}, quick {quick})"))


def counts(args, options: dict) -> dict:
    """Each of ``add_counts``' options: the value given, or its default for this run (``args.quick``)."""
    return {name: (quick if args.quick else full) if getattr(args, name) is None else getattr(args, name)
            for name, (full, quick, _) in options.items()}


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------

class Log:
    """Progress lines on stderr: ``[name HH:MM:SS] message``, or, with no name,
    ``[  12.3 s] message`` (seconds since the Log was made)."""

    def __init__(self, name: str | None = None):
        self.name = name
        self._t0 = time.perf_counter()

    def __call__(self, message: str) -> None:
        stamp = f"{self.name} {time.strftime('%H:%M:%S')}" if self.name else f"{time.perf_counter() - self._t0:6.1f} s"
        print(f"[{stamp}] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def captured(stderr: bool = True):
    """What the block prints (stdout, and stderr unless ``stderr=False``) goes to the StringIO it yields."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), (contextlib.redirect_stderr(buffer) if stderr
                                              else contextlib.nullcontext()):
        yield buffer


def write_json(path: str | Path, data, indent: int = 1) -> Path:
    """Write the artifact (its folder created if need be); a value JSON lacks is written as its str()."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=str))
    return path


def command_line() -> str:
    """This run's command, to rerun it: the interpreter (relative to the working folder) and the arguments."""
    return " ".join([os.path.relpath(sys.executable), *sys.argv])


# ---------------------------------------------------------------------------
# hvdmagic: Spark and IPython
# ---------------------------------------------------------------------------

def start_spark(slots: int = 4):
    """The warm session every Spark-based system shares: hvdmagic's own embedded one, which
    hvdmagic then treats as the user's session (it is not resized)."""
    from hvdmagic.launch.spark_session import start_embedded

    return start_embedded(slots)


def ipython_shell():
    """A real IPython shell (IPython's own test shell, as tests/conftest.py uses) with hvdmagic loaded."""
    from IPython.testing.globalipapp import start_ipython

    ip = start_ipython()
    ip.run_line_magic("load_ext", "hvdmagic")
    return ip


def run_cell(ip, source: str):
    """Run one cell with its output captured: (IPython's ExecutionResult, output, started, ended), wall clock."""
    with captured() as buffer:
        started = time.time()
        outcome = ip.run_cell(source)
        ended = time.time()
    return outcome, buffer.getvalue(), started, ended


def checked_cell(ip, source: str):
    """``run_cell``, raising RuntimeError with the end of the output when the cell fails:
    (the cell's value, started, ended)."""
    outcome, output, started, ended = run_cell(ip, source)
    if not outcome.success:
        raise RuntimeError(f"{source.splitlines()[0]} failed: {outcome.error_in_exec or outcome.error_before_exec!r}\n"
                           f"{output[-3000:]}")
    return outcome.result, started, ended


class Kernel:
    """A python3 Jupyter kernel of this virtualenv (jupyter_client), as a front end runs one: the benchmarks
    that time what a user waits for use it. ``env`` goes over this process's environment (None removes a
    variable; widgets are on unless it sets HVDMAGIC_NONINTERACTIVE), with Spark on loopback."""

    def __init__(self, env: dict[str, str | None] | None = None, cwd: Path = ROOT, name: str = "kernel"):
        from jupyter_client.manager import start_new_kernel

        merged = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1"}
        for key, value in {"JPY_SESSION_NAME": None, **(env or {})}.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = value
        self.name = name
        self.manager, self.client = start_new_kernel(kernel_name="python3", env=merged, cwd=str(cwd))

    def execute(self, code: str, timeout: float = 300, on_message=None, must_fail: bool = False):
        """Run a cell: (seconds from the execute request to the kernel's idle, the reply's content, what
        it printed). Raises RuntimeError when the cell failed, or with ``must_fail`` when it did not.
        ``on_message`` sees every iopub message of the cell."""
        printed: list[str] = []

        def hook(message: dict) -> None:
            if message["msg_type"] == "stream":
                printed.append(message["content"]["text"])
            if on_message is not None:
                on_message(message)

        started = time.perf_counter()
        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=hook)
        seconds = time.perf_counter() - started
        content = reply["content"]
        if (content["status"] == "ok") == must_fail:
            said = "did not fail" if must_fail else f"failed: {content.get('ename')}: {content.get('evalue')}"
            raise RuntimeError(f"{self.name}: {code.splitlines()[0]!r} {said}\n{''.join(printed)[-3000:]}")
        return seconds, content, "".join(printed)

    def stop(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)
