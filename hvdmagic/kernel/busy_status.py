"""The kernel reads Busy, not Idle, for as long as a run holds its cell.

A front end learns the kernel's state from the ``status`` messages the kernel sends for each
request it handles. A run keeps the kernel busy with its cell, but ipykernel 7 also answers
requests meanwhile on other threads: the control channel (JupyterLab sends a
``create_subshell_request`` when the dashboard's first widget appears) and the subshells that
carry the dashboard's controls. Each such answer ends with an ``idle`` status, and JupyterLab's
status bar, VS Code and JupyterHub's idle culler take the latest status for the kernel's: they
would say Idle for the rest of the run. So while a run holds its cell, every such ``idle`` is
followed by a ``busy`` on behalf of the cell's own request, which is what the kernel is. The
request's own ``idle``, when the cell ends, is ipykernel's and comes after this is undone.
"""

from __future__ import annotations

import contextlib
import threading


@contextlib.contextmanager
def kernel_stays_busy():
    """While the body runs, say Busy again after each idle the kernel sends for another request.

    Does nothing outside a Jupyter kernel, off the thread that runs the cell (``hvdmagic.run``
    from a thread of the user's has no cell to speak for), or inside another run's.
    """
    kernel = _kernel()
    if kernel is None or threading.current_thread() is not threading.main_thread() \
            or "_publish_status" in vars(kernel):
        yield
        return
    cell = kernel.get_parent("shell")
    cell_id = (cell or {}).get("header", {}).get("msg_id")
    if not cell_id:
        yield
        return
    publish = kernel._publish_status
    # Held while saying busy: once the body has ended, no busy can follow the cell's own idle.
    running, lock = [True], threading.Lock()

    def publish_then_busy_again(status, channel, parent=None):
        publish(status, channel, parent)
        answered = parent or kernel.get_parent(channel)
        if status == "idle" and (answered or {}).get("header", {}).get("msg_id") != cell_id:
            with lock:
                if running[0]:
                    publish("busy", "shell", cell)

    kernel._publish_status = publish_then_busy_again
    try:
        yield
    finally:
        with lock:
            running[0] = False
        del kernel._publish_status  # the class's method again


def _kernel():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    kernel = getattr(get_ipython(), "kernel", None)
    return kernel if hasattr(kernel, "_publish_status") and hasattr(kernel, "get_parent") else None
