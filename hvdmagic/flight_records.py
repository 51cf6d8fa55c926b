"""torch's NCCL flight recorder, read for the user: each rank's last collectives.

torch keeps a ring buffer of every NCCL process group's collectives in each rank (its
"flight recorder") and writes it to a file when its watchdog times a collective out, or
when asked through a pipe. The task reads its own rank's file (``task.flight_recorder``)
and sends ``summarise``'s digest to the kernel (a FLIGHT_RECORD event); the kernel shows
``describe``'s lines under a failed run, and keeps the digests in ``last_run().flight_records``.
The whole dump stays on the rank's host, for ``torchfrtrace``.
"""

from __future__ import annotations

from typing import Any

from hvdmagic import rank_ranges

KEPT = 4  # entries per rank in a digest: the hang is at the end, and the ones before say how it got there


def _frame(entry: dict) -> str:
    """Where the user's code issued the collective: the innermost frame outside the libraries."""
    for frame in entry.get("frames") or []:
        filename = str(frame.get("filename", ""))
        if filename and "site-packages" not in filename and not filename.startswith("<frozen"):
            return f"{filename}, line {frame.get('line')}, in {frame.get('name')}"
    return ""


def summarise(dump: dict, path: str, host: str) -> dict[str, Any]:
    """The digest of one rank's dump: its last ``KEPT`` entries, and where the full dump is."""
    entries = [entry for entry in dump.get("entries") or [] if isinstance(entry, dict)]
    kept = []
    for entry in entries[-KEPT:]:
        kept.append({
            "seq": entry.get("collective_seq_id") if not entry.get("is_p2p") else entry.get("p2p_seq_id"),
            "op": str(entry.get("profiling_name", "")),
            "state": str(entry.get("state", "")),
            "sizes": entry.get("input_sizes"),
            "dtypes": entry.get("input_dtypes"),
            "group": str((entry.get("process_group") or ("", ""))[-1] or entry.get("pg_id", "")),
            "duration_ms": entry.get("duration_ms"),
            "where": _frame(entry),
        })
    return {"entries": kept, "count": len(entries), "path": path, "host": host}


def _entry_line(entry: dict) -> str:
    state = entry["state"]
    if state == "scheduled":
        state = "scheduled, never started"
    elif state == "started":
        state = "started, never completed"
    elif state == "completed" and isinstance(entry.get("duration_ms"), (int, float)):
        state = f"completed in {entry['duration_ms']:.3g} ms"
    sizes = f" {entry['sizes']}" if entry.get("sizes") else ""
    dtypes = f" {','.join(map(str, entry['dtypes']))}" if entry.get("dtypes") else ""
    group = f" (group {entry['group']})" if entry.get("group") not in ("", "default_pg", "0") else ""
    where = f"\n      at {entry['where']}" if entry.get("where") else ""
    return f"  #{entry['seq']} {entry['op']}{sizes}{dtypes}{group}: {state}{where}"


def describe(records: dict[int, dict]) -> list[str]:
    """Lines for a failed run's error: ranks whose last collectives match are shown once."""
    if not records:
        return []
    groups: dict[tuple[str, ...], list[int]] = {}
    for rank in sorted(records):
        lines = tuple(_entry_line(entry) for entry in records[rank].get("entries") or [])
        groups.setdefault(lines or ("  (no collective recorded)",), []).append(rank)
    out = ["", "--- torch.distributed's flight recorder: each rank's last collectives, oldest first ---"]
    for lines, ranks in groups.items():
        out.append(f"rank {rank_ranges.compress(ranks)}:" if len(ranks) == 1 else
                   f"ranks {rank_ranges.compress(ranks)}:")
        out.extend(lines)
    where = [f"rank {rank}: {record['path']} on {record['host']}" for rank, record in sorted(records.items())
             if record.get("path")]
    if where:
        shown = where[:3] + ([f"... and {len(where) - 3} more"] if len(where) > 3 else [])
        out.append("Full dumps, for torchfrtrace: " + "; ".join(shown))
    return out
