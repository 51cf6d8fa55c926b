"""A rank's NCCL flight recorder, as its supervisor sees it: where torch writes it, how to ask for it.

Each rank gets a directory of its own for torch's dumps, named in the variables the installed torch
reads (``recorder_names``: torch 2.8 renamed two of them and warns, on every rank, about the old names),
unless the user's environment names its own:

- the dump file's prefix: torch writes ``<prefix><rank>`` when its watchdog times a
  collective out (``TORCH_NCCL_DUMP_ON_TIMEOUT``, set here, so it does);
- the pipe's prefix: torch reads ``<prefix><rank>.pipe`` and dumps on any write, so when
  hvdmagic's own watchdog (``--timeout``, ``--stall-timeout``) or Stop asks where the ranks
  are, the supervisor asks for the dump too, before the ranks are stopped.

Only NCCL process groups record (Gloo's do not dump), and only where torch has CUDA: on
other ranks the variables are unread and the directory stays empty, and is removed.
The dump is a pickle that the rank wrote into the supervisor's own private directory, on
this host: reading it trusts nothing that came from the network.
"""

from __future__ import annotations

import errno
import functools
import os
import pickle
import shutil
import socket
import tempfile
import time
from importlib import metadata
from pathlib import Path

from hvdmagic import flight_records

PREFIX = "nccl_trace_rank_"
# Entries kept per process group. torch's own default (2000 since 2.5) is set explicitly, so that
# older torch records too; the buffer costs some memory per entry, nothing per collective.
BUFFER_ENTRIES = "2000"
SETTLE = 0.2  # seconds a dump's size must hold still before it is read: torch writes it from a thread
ASKED_WAIT = 6.0  # seconds torch gets to write a dump it was asked for through its pipe (see the docstring)


# The variables torch reads, by its version: torch >= 2.8 reads TORCH_FR_* first, and each rank prints
# "Environment variable TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated" where the old name is set (read off
# the strings of libtorch 2.7 to 2.13). The pipe and the dump-on-timeout switch kept their names.
OLD_NAMES = {"buffer": "TORCH_NCCL_TRACE_BUFFER_SIZE", "dump": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
NEW_NAMES = {"buffer": "TORCH_FR_BUFFER_SIZE", "dump": "TORCH_FR_DUMP_TEMP_FILE"}
PIPE_NAME = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"


def recorder_names(torch_version: str | None) -> dict[str, str]:
    """The names of the buffer-size and dump-file variables that this torch reads (its metadata's version;
    None, as without torch, gives the new names, which an old torch ignores harmlessly)."""
    if torch_version is None:
        return NEW_NAMES
    try:
        major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    except ValueError:
        return NEW_NAMES
    return NEW_NAMES if (major, minor) >= (2, 8) else OLD_NAMES


@functools.cache
def installed_torch_version() -> str | None:
    """From the metadata, without importing torch (seconds) in the supervisor."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


class FlightRecorder:
    """The flight-recorder directory of one rank process, from its start to its reaping."""

    def __init__(self, env: dict[str, str], torch_version: str | None = None):
        user_prefix = env.get(NEW_NAMES["dump"]) or env.get(OLD_NAMES["dump"])
        self._own = user_prefix is None
        self.directory = Path(tempfile.mkdtemp(prefix="hvdmagic-flight-")) if self._own else None
        self.prefix = str(self.directory / PREFIX) if self._own else user_prefix
        self._pipe_prefix = env.get(PIPE_NAME) or (self.prefix if self._own else None)
        self._env = env
        self._names = recorder_names(torch_version or installed_torch_version())

    def environment(self) -> dict[str, str]:
        """The variables to add to the rank's environment, in the names this torch reads (none that the
        user set)."""
        if not self._own:
            return {}
        wanted = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", self._names["dump"]: self.prefix, PIPE_NAME: self._pipe_prefix}
        if not (self._env.get(NEW_NAMES["buffer"]) or self._env.get(OLD_NAMES["buffer"])):
            wanted[self._names["buffer"]] = BUFFER_ENTRIES
        return {name: value for name, value in wanted.items() if name not in self._env}

    def _pipes(self) -> list[Path]:
        if not self._pipe_prefix:
            return []
        stem = Path(self._pipe_prefix)
        return sorted(stem.parent.glob(f"{stem.name}*.pipe"))

    def _dumps(self) -> list[Path]:
        stem = Path(self.prefix)
        try:
            return sorted(p for p in stem.parent.glob(f"{stem.name}*") if p.suffix != ".pipe" and p.is_file())
        except OSError:
            return []

    def ask(self) -> bool:
        """Ask torch for a dump now, through its pipe; False where no process group made one."""
        asked = False
        for pipe in self._pipes():
            try:
                # Non-blocking: a pipe whose reader is gone (the rank ended) must not hang the supervisor.
                fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno not in (errno.ENXIO, errno.ENOENT):
                    raise
                continue
            try:
                os.write(fd, b"1")
                asked = True
            except OSError:
                pass
            finally:
                os.close(fd)
        return asked

    def read(self, wait: float = 0.0, newer_than: float = 0.0) -> dict | None:
        """The digest of the rank's dump (``flight_records.summarise``), or None when it wrote none.

        ``wait``: seconds to wait for a dump modified after ``newer_than`` (a wall-clock time) to
        appear and stop growing; 0 reads what is there."""
        deadline = time.monotonic() + wait
        while True:
            fresh = [p for p in self._dumps() if _mtime(p) > newer_than]
            if fresh and _settled(fresh[-1]):
                return self._digest(fresh[-1])
            if time.monotonic() >= deadline:
                return self._digest(fresh[-1]) if fresh else None
            time.sleep(0.05)  # torch writes the file from its own thread: there is nothing to wait on

    def _digest(self, path: Path) -> dict | None:
        try:
            with open(path, "rb") as file:
                dump = pickle.load(file)  # written by this supervisor's own rank, into its private directory
        except Exception:  # cut short (the rank died while writing), or a format this torch does not use
            return None
        return flight_records.summarise(dump if isinstance(dump, dict) else {}, str(path), socket.gethostname())

    def close(self) -> None:
        """Remove the directory, unless it holds a dump the user may want for torchfrtrace."""
        if self.directory is not None and not self._dumps():
            shutil.rmtree(self.directory, ignore_errors=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _settled(path: Path) -> bool:
    try:
        size = path.stat().st_size
        time.sleep(SETTLE)
        return size > 0 and path.stat().st_size == size
    except OSError:
        return False
