"""Where a rank's ``breakpoint()`` asks the user: the notebook's input box, as ``%debug`` does.

The job's loop (``launch.breakpoint_prompts``) runs on the kernel's main thread, so ``input()``
there is ipykernel's input_request: the front end's stdin box (JupyterLab, Notebook 7, VS Code). In
a terminal (IPython, or a script run by a person), it is the terminal. Where nothing can answer (a
script whose stdin is not a terminal, a front end that does not allow stdin), the run goes on past
the breakpoint with one note (``launch.breakpoint_prompts.NEEDS_A_NOTEBOOK``).
"""

from __future__ import annotations

import sys

from hvdmagic.kernel.noise import is_startup_noise
from hvdmagic.launch.breakpoint_prompts import CannotAsk, Console


def console() -> Console | None:
    """The console for a run started now; None where nothing can answer pdb's prompt."""
    if not _can_prompt():
        return None
    return Console(ask=_ask, show=show, on_start=_header)


def _can_prompt() -> bool:
    shell = _ipython()
    if shell is not None and getattr(shell, "kernel", None) is not None:
        return True  # ipykernel: whether this request allows stdin shows only when asked (CannotAsk)
    stdin = sys.stdin
    try:
        return stdin is not None and stdin.isatty()
    except (AttributeError, ValueError):
        return False  # closed, or replaced by something that is not a file


def _ipython():
    """The running IPython shell, if this process has one (without importing IPython into a script)."""
    module = sys.modules.get("IPython")
    return module.get_ipython() if module is not None else None


def _ask(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None  # Ctrl-D at a terminal: pdb quits, as it does there
    except Exception as exc:  # ipykernel's StdinNotImplementedError: the front end did not allow stdin
        if type(exc).__name__ != "StdinNotImplementedError":
            raise
        raise CannotAsk from None


def show(text: str) -> None:
    """pdb's text, and what the rank's own streams print meanwhile, in the cell's output. Those pass the
    live views' filter: a held rank's Horovod echoes, whenever its thread notices, the other ranks' exit."""
    text = "".join(line for line in text.splitlines(keepends=True) if not is_startup_noise(line))
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def _header(rank: int, _event: dict) -> None:
    print(f"hvdmagic: rank {rank} stopped at breakpoint(); the other ranks wait in their next collective, and "
          "--timeout and --stall-timeout wait too. c continues, q ends the cell, Stop ends it too.", flush=True)
