"""hvdmagic's own Spark settings (``spark.hvdmagic.*``), read from the session a run uses.

They are Spark settings because they describe the cluster (how slowly it grows, how its
network fails), not one cell: set once with ``spark.conf.set`` or in the cluster's
configuration, they hold for every cell and session. Runs in the kernel.
"""

from __future__ import annotations

import math

from hvdmagic.errors import LaunchError

SLOT_WAIT = "spark.hvdmagic.slotWait"  # seconds the slot check waits for executors on their way (launch.slots)
RECONNECT_GRACE = "spark.hvdmagic.reconnectGrace"  # seconds a task may be out of contact (task.kernel_link)

_MEANING = {
    SLOT_WAIT: "how many seconds the slot check waits for executors on their way",
    RECONNECT_GRACE: "how many seconds a task whose connection to the kernel broke may take to come back",
}


def seconds(session, key: str, default: float) -> float:
    """The setting ``key`` of ``session`` in seconds ("120" or "120s"), ``default`` where it is not set;
    anything else is a LaunchError that says how to set it."""
    value = session.conf.get(key, None) if session is not None else None
    if value is None:
        return default
    try:
        number = float(str(value).strip().removesuffix("s"))
    except ValueError:
        number = math.nan
    if not number >= 0:
        raise LaunchError(f"{key} is {_MEANING[key]}, a number such as 120, not {value!r}: "
                          f"set it with spark.conf.set({key!r}, '120').")
    return number
