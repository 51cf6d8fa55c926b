"""What code inside a rank uses to talk to the notebook.

The rank process opens the event pipe once (``open_events``); everything else
goes through ``emit``, which is a harmless no-op outside a ``%%horovod`` run so
the same training code still runs on a single node.
"""

from __future__ import annotations

import json
import os
import threading

_lock = threading.Lock()
_events = None


def open_events() -> None:
    global _events
    fd = os.environ.get("HVDMAGIC_EVENT_FD")
    if fd is not None and _events is None:
        _events = os.fdopen(int(fd), "w", encoding="utf-8")


def emit(event: dict) -> None:
    """Send one event to this rank's supervisor (thread-safe)."""
    if _events is None:
        return
    line = json.dumps(event, separators=(",", ":")) + "\n"
    with _lock:
        _events.write(line)
        _events.flush()
