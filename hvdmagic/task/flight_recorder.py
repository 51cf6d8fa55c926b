"""A rank's NCCL flight recorder, as its supervisor sees it: where torch writes it, how to ask for it.

Each rank gets a directory of its own for torch's dumps, named in the variables torch reads
(newer names and older ones alike), unless the user's environment names its own:

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
import os
import pickle
import shutil
import socket
import tempfile
import time
from pathlib import Path

from hvdmagic import flight_records

PREFIX = "nccl_trace_rank_"
# Entries kept per process group. torch's own default (2000 since 2.5) is set explicitly, so that
# older torch records too; the buffer costs some memory per entry, nothing per collective.
BUFFER_ENTRIES = "2000"
SETTLE = 0.2  # seconds a dump's size must hold still before it is read: torch writes it from a thread
ASKED_WAIT = 6.0  # seconds torch gets to write a dump it was asked for through its pipe (see the docstring)


class FlightRecorder:
    """The flight-recorder directory of one rank process, from its start to its reaping."""

    def __init__(self, env: dict[str, str]):
        user_prefix = env.get("TORCH_FR_DUMP_TEMP_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
        self._own = user_prefix is None
        self.directory = Path(tempfile.mkdtemp(prefix="hvdmagic-flight-")) if self._own else None
        self.prefix = str(self.directory / PREFIX) if self._own else user_prefix
        self._pipe_prefix = (env.get("TORCH_FR_DEBUG_INFO_PIPE_FILE") or env.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
                             or (self.prefix if self._own else None))
        self._env = env

    def environment(self) -> dict[str, str]:
        """The variables to add to the rank's environment (none that the user set)."""
        if not self._own:
            return {}
        pipes = self._pipe_prefix
        wanted = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                  "TORCH_FR_DUMP_TEMP_FILE": self.prefix, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": self.prefix,
                  "TORCH_FR_DEBUG_INFO_PIPE_FILE": pipes, "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": pipes}
        if not (self._env.get("TORCH_FR_BUFFER_SIZE") or self._env.get("TORCH_NCCL_TRACE_BUFFER_SIZE")):
            wanted.update(TORCH_FR_BUFFER_SIZE=BUFFER_ENTRIES, TORCH_NCCL_TRACE_BUFFER_SIZE=BUFFER_ENTRIES)
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
