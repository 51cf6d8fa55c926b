"""Reading a Horovod Timeline: where the file is, and the time spent per tensor.

Horovod's rank 0 writes a Chrome trace (``HOROVOD_TIMELINE``): one "process" per
tensor, with nested begin/end spans for negotiation and the collective. The file
may lack its closing bracket when a rank died, so it is parsed leniently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

OPEN_HINT = "open it in chrome://tracing or https://ui.perfetto.dev"
COST_NOTE = "recording costs throughput (up to ~40% on large models): use it to diagnose, not by default"


@dataclass
class TensorTime:
    name: str
    count: int = 0
    collective_ms: float = 0.0  # the top-level op spans (ALLREDUCE, ...)
    negotiate_ms: float = 0.0  # waiting for every rank to be ready for the tensor


def load_events(path: str | Path) -> list[dict]:
    text = Path(path).read_text().strip()
    if not text.endswith("]"):
        text = text.rstrip(",") + "]"
    return json.loads(text)


def summarize(path: str | Path) -> list[TensorTime]:
    """Per tensor, the time in its collectives, most expensive first."""
    names: dict[int, str] = {}
    stacks: dict[int, list[tuple[str, float]]] = {}
    tensors: dict[int, TensorTime] = {}
    for event in load_events(path):
        pid, phase = event.get("pid"), event.get("ph")
        if phase == "M" and event.get("name") == "process_name" and "name" in event.get("args", {}):
            names[pid] = event["args"]["name"]
        elif phase == "B":
            stacks.setdefault(pid, []).append((event.get("name", ""), event["ts"]))
        elif phase == "E" and stacks.get(pid):
            name, start = stacks[pid].pop()
            if stacks[pid]:
                continue  # a nested span: counted in its parent
            tensor = tensors.setdefault(pid, TensorTime(names.get(pid, f"tensor {pid}")))
            elapsed = (event["ts"] - start) / 1000
            if name.startswith("NEGOTIATE"):
                tensor.negotiate_ms += elapsed
            else:
                tensor.count += 1
                tensor.collective_ms += elapsed
    return sorted(tensors.values(), key=lambda t: -t.collective_ms)


def describe(path: str | Path, top: int = 8) -> str:
    """What the dashboard and the text twin say after a run with --timeline."""
    lines = [f"Horovod Timeline: {path} ({OPEN_HINT}); {COST_NOTE}."]
    if not Path(path).exists():
        lines.append("The file is not on this machine: rank 0 writes it on its own host.")
        return "\n".join(lines)
    try:
        tensors = summarize(path)
    except (OSError, ValueError) as exc:
        lines.append(f"Could not read it: {exc}")
        return "\n".join(lines)
    if tensors:
        lines.append(f"{'tensor':<40} {'ops':>5} {'collective ms':>14} {'negotiate ms':>13}")
        for t in tensors[:top]:
            lines.append(f"{t.name[:40]:<40} {t.count:>5} {t.collective_ms:>14.1f} {t.negotiate_ms:>13.1f}")
        if len(tensors) > top:
            lines.append(f"... and {len(tensors) - top} more tensors")
    return "\n".join(lines)
