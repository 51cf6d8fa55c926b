"""Keeps a rank that a crash signal kills alive for a few seconds, so that its supervisor can read
its native frames (py-spy) before it dies: a dead process cannot be read.

Installed before ``faulthandler.enable()``, so that the fault handler's "previous handler" is
this one. On SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL, the fault handler writes the Python
stacks, puts this handler back and raises the signal again; this handler is libc's ``sleep``
itself, which the kernel calls with the signal's number, so the crashing thread waits that many
seconds (4 for SIGILL to 11 for SIGSEGV) and runs no Python meanwhile. ``SA_RESETHAND`` has put
the signal's default action back on delivery, so the supervisor ends the wait by sending the same
signal (``task.native_stacks.CrashWatch``): the rank dies of its own signal, as it would have.
Without a supervisor the wait ends by itself: the fault recurs, or ``abort()`` raises again,
and the default action ends the process; no Python has to run for that (the thread that
crashed may hold the GIL).

A ``sigaction`` through ctypes, with glibc's layout of ``struct sigaction`` on x86_64 and
aarch64; elsewhere nothing is installed and the rank dies at once, as without py-spy.
"""

from __future__ import annotations

import os
import signal

SIGNALS = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL)
# <signal.h> on Linux, the same on x86_64 and aarch64. NODEFER: the supervisor's signal is not
# blocked in the waiting thread, so it ends the process at once. ONSTACK: a stack overflow's
# SIGSEGV waits on the fault handler's own stack.
_SA_ONSTACK, _SA_NODEFER, _SA_RESETHAND = 0x08000000, 0x40000000, 0x80000000
_SIGSET_BYTES = 128  # glibc's sigset_t: 1024 bits


def supported() -> bool:
    """Linux on x86_64 or aarch64 with glibc: where ``struct sigaction``'s layout is the one below."""
    if os.uname().machine not in ("x86_64", "aarch64"):
        return False
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc ")
    except (ValueError, OSError):  # not Linux, or not glibc
        return False


def install() -> bool:
    """Make every crash signal wait in ``sleep`` (see above); False where it is not supported."""
    if not supported():
        return False
    import ctypes

    class Sigaction(ctypes.Structure):
        _fields_ = [("handler", ctypes.c_void_p),
                    ("mask", ctypes.c_ubyte * _SIGSET_BYTES),  # all zero: no signal blocked while it waits
                    ("flags", ctypes.c_int),
                    ("restorer", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    action = Sigaction(handler=ctypes.cast(libc.sleep, ctypes.c_void_p).value,
                       flags=_SA_ONSTACK | _SA_NODEFER | _SA_RESETHAND)
    for sig in SIGNALS:
        if libc.sigaction(int(sig), ctypes.byref(action), None) != 0:
            raise OSError(ctypes.get_errno(), f"sigaction({sig.name}) failed")
    # A forked child (a DataLoader worker) would wait too, with no supervisor watching it.
    os.register_at_fork(after_in_child=_release_in_child)
    return True


def _release_in_child() -> None:
    """In a forked child: the default actions under the fault handler again, as without the hold."""
    import faulthandler

    enabled = faulthandler.is_enabled()
    faulthandler.disable()  # puts this module's handler back, to be replaced
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    if enabled:
        faulthandler.enable(all_threads=True)
