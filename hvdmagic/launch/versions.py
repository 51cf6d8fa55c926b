"""Before any rank starts: do the tasks' Python and packages match this kernel's?

The kernel pickles the cell with its own Python and cloudpickle, and the ranks unpickle it
with theirs; pickles of code are made for one Python version, and cloudpickle's releases
change what they write. So a different Python (major.minor) or cloudpickle on an executor
fails the run before launch, in one paragraph that names the hosts. Other differences
(torch, TensorFlow, horovod, pyarrow, hvdmagic, a Python patch release) may just work: each
is one notice line.
"""

from __future__ import annotations

from collections import defaultdict

from hvdmagic.task.versions import versions as kernel_versions

FATAL = "python", "cloudpickle"
_REPORTED: dict[str, dict] = {}  # by host: what its latest task reported, for %horovod env


def reported() -> dict[str, dict]:
    """By host, the versions the executors' tasks last reported to this driver (passed or not)."""
    return dict(_REPORTED)


def compare(tasks: dict[int, tuple[str, dict]], here: dict | None = None) -> tuple[str | None, list[str]]:
    """``tasks``: by task index, (its host's name, its ``task.versions.versions()``).

    Returns why the run cannot start (or None), and the notices for what differs otherwise;
    remembers what each host reported, for ``%horovod env`` (``reported``).
    """
    here = kernel_versions() if here is None else here
    _REPORTED.update((host, dict(theirs)) for host, theirs in tasks.values() if theirs)
    # (package, the task's version) -> host -> tasks
    differing: dict[tuple[str, str | None], dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for task, (host, theirs) in sorted(tasks.items()):
        if not theirs:
            continue  # a task from before versions were sent
        for package, mine in here.items():
            if theirs.get(package) != mine:
                differing[package, theirs.get(package)][host].append(task)
    fatal, notices = [], []
    for (package, theirs), hosts in differing.items():
        where = "; ".join(f"on {host} (task{'s' if len(ts) > 1 else ''} {', '.join(map(str, ts))})"
                          for host, ts in hosts.items())
        said = f"{package} {theirs or 'is not installed'} {where}, {here[package] or 'none'} in this kernel"
        if package in FATAL and not _same_minor(package, theirs, here[package]):
            fatal.append(said)
        else:
            notices.append(f"hvdmagic: the executors differ from this kernel: {said}")
    if not fatal:
        return None, notices
    return (f"the executors cannot unpickle what this kernel sends: {'; '.join(fatal)}. Pickled code is "
            "made for one Python version and one cloudpickle, so the ranks would fail or misbehave. Install "
            "the kernel's versions on the cluster (requirements/lock.txt pins them), or run the notebook with "
            "the cluster's Python; local mode (--np -N) uses this kernel's."), notices


def _same_minor(package: str, theirs: str | None, mine: str | None) -> bool:
    """A Python patch release pickles the same code as its minor release; any other difference counts."""
    if package != "python" or theirs is None or mine is None:
        return False
    return theirs.split(".")[:2] == mine.split(".")[:2]
