"""Which of the files a template imported may have changed on disk, without a stat of each per fork.

A template must not fork a rank from modules that changed since it imported them (an edited
``.py``, a reinstalled package): the rank would run the old code. Stating every file of torch
before each fork costs 3 to 8 ms warm, about 100 ms cold. So the template watches the files'
directories with inotify and, when asked, reads the events that came since without blocking:
only the files they name are stated again. Where inotify cannot watch them (not Linux, out of
watches, an event queue that overflowed, a watched directory removed), the answer is "any of
them", and the caller states them all, as before.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Iterable

_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
# A file written, its attributes changed (a touch), or a name replaced, made or removed in the directory.
_MASK = 0x2 | 0x4 | 0x8 | 0x40 | 0x80 | 0x100 | 0x200
_IN_Q_OVERFLOW = 0x4000
_IN_IGNORED = 0x8000  # the watch went: its directory was removed, or its file system unmounted
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name, NUL-padded


class FileWatch:
    def __init__(self, paths: Iterable[str]):
        self._paths = set(paths)
        self._fd: int | None = None
        self._dirs: dict[int, str] = {}  # watch descriptor -> directory
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
            if fd < 0:
                return
            self._fd = fd
            for directory in sorted({os.path.dirname(path) for path in self._paths}):
                wd = libc.inotify_add_watch(fd, os.fsencode(directory), _MASK)
                if wd < 0:
                    raise OSError(ctypes.get_errno(), f"cannot watch {directory}")
                self._dirs[wd] = directory
        except (OSError, AttributeError):  # no inotify here, or out of watches (fs.inotify.max_user_watches)
            self.close()

    def changed(self) -> set[str] | None:
        """The watched files that events named since the last call; None for "any of them"."""
        if self._fd is None:
            return None
        named: set[str] = set()
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return named
            except OSError:
                self.close()
                return None
            offset = 0
            while offset < len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size
                name = data[offset:offset + length].rstrip(b"\0")
                offset += length
                if mask & (_IN_Q_OVERFLOW | _IN_IGNORED):
                    self.close()  # events were lost, or a directory is no longer watched: check them all from now on
                    return None
                path = os.path.join(self._dirs.get(wd, ""), os.fsdecode(name))
                if path in self._paths:
                    named.add(path)

    def close(self) -> None:
        """Stop watching (a forked rank closes the template's watch); ``changed`` then says "any"."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
