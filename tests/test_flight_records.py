"""torch's flight recorder, on this CPU machine: where each rank's dump goes, how the task asks for
it and reads it, and what a failed run shows. The NCCL dumps themselves (a watchdog timeout, one
asked for by --timeout) need a GPU: tests/test_gpu.py."""

from __future__ import annotations

import os
import pickle
import tempfile
import threading
from pathlib import Path

import pytest

import hvdmagic
from hvdmagic import flight_records
from hvdmagic.errors import JobFailed
from hvdmagic.task.flight_recorder import FlightRecorder


def _entry(seq: int, op: str, state: str, line: int) -> dict:
    """An entry as torch 2.11 and 2.13 write it (read off real dumps, NCCL and Gloo)."""
    return {"record_id": seq - 1, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": op, "input_sizes": [[1024]], "input_dtypes": ["Float"],
            "state": state, "duration_ms": 0.25 if state == "completed" else None, "is_p2p": False,
            "frames": [{"name": "all_reduce", "filename": "/venv/lib/python3.12/site-packages/torch/distributed/"
                        "distributed_c10d.py", "line": 3068},
                       {"name": "train_step", "filename": "Cell In[4]", "line": line},
                       {"name": "<module>", "filename": "Cell In[5]", "line": 2}]}


@pytest.mark.unit
def test_a_digest_keeps_the_last_entries_and_names_the_users_frame():
    dump = {"version": "2.10", "entries": [_entry(i, "nccl:all_reduce", "completed", 12) for i in range(1, 9)]
            + [_entry(9, "nccl:all_reduce", "scheduled", 14)]}
    digest = flight_records.summarise(dump, "/tmp/x/nccl_trace_rank_1", "host-a")
    assert digest["count"] == 9 and [e["seq"] for e in digest["entries"]] == [6, 7, 8, 9]
    assert digest["entries"][-1]["where"] == "Cell In[4], line 14, in train_step"
    assert digest["entries"][-1]["group"] == "default_pg"


@pytest.mark.unit
def test_ranks_whose_last_collectives_match_are_shown_once():
    done = [_entry(1, "nccl:all_reduce", "completed", 12)]
    same = {"entries": done + [_entry(2, "nccl:all_reduce", "started", 14)]}
    behind = {"entries": done}
    records = {rank: flight_records.summarise(same if rank != 2 else behind, f"/d/nccl_trace_rank_{rank}", "h")
               for rank in range(4)}
    lines = flight_records.describe(records)
    text = "\n".join(lines)
    assert lines[1] == "--- torch.distributed's flight recorder: each rank's last collectives, oldest first ---"
    assert "ranks 0, 1, 3:\n  #1 nccl:all_reduce [[1024]] Float: completed in 0.25 ms" in text, text
    started = ("  #2 nccl:all_reduce [[1024]] Float: started, never completed\n"
               "      at Cell In[4], line 14, in train_step")
    assert started in text, text
    assert "rank 2:\n  #1 nccl:all_reduce" in text and text.count("#2 ") == 1, text
    assert lines[-1] == ("Full dumps, for torchfrtrace: rank 0: /d/nccl_trace_rank_0 on h; "
                         "rank 1: /d/nccl_trace_rank_1 on h; rank 2: /d/nccl_trace_rank_2 on h; "
                         "... and 1 more"), lines[-1]
    assert flight_records.describe({}) == []


@pytest.mark.unit
def test_the_rank_gets_a_private_directory_and_the_users_own_settings_win():
    recorder = FlightRecorder({}, torch_version="2.13.0+cpu")
    env = recorder.environment()
    prefix = str(recorder.directory / "nccl_trace_rank_")
    # Only the names torch 2.13 reads: the old ones make every rank print a deprecation warning.
    assert env == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_FR_DUMP_TEMP_FILE": prefix,
                   "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": prefix, "TORCH_FR_BUFFER_SIZE": "2000"}
    assert recorder.directory.stat().st_mode & 0o777 == 0o700, "a dump is read by unpickling: nobody else writes here"
    recorder.close()
    assert not recorder.directory.exists(), "an empty directory is not left behind"

    older = FlightRecorder({}, torch_version="2.7.0")  # Databricks 17.3's torch knows only the old names
    prefix = str(older.directory / "nccl_trace_rank_")
    assert older.environment() == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
                                   "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": prefix, "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}
    older.close()

    mine = FlightRecorder({"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/shared/fr/rank_", "TORCH_FR_BUFFER_SIZE": "50"})
    assert mine.environment() == {} and mine.directory is None and mine.prefix == "/shared/fr/rank_"
    sized = FlightRecorder({"TORCH_NCCL_TRACE_BUFFER_SIZE": "10"})
    assert "TORCH_FR_BUFFER_SIZE" not in sized.environment()
    sized.close()


@pytest.mark.unit
def test_asking_writes_to_torchs_pipe_and_a_pipe_nobody_reads_never_blocks(tmp_path):
    recorder = FlightRecorder({})
    try:
        pipe = Path(recorder.prefix + "0.pipe")
        os.mkfifo(pipe)
        assert recorder.ask() is False, "no reader: torch's monitor is gone, and the supervisor must not hang"
        got = []
        reader = threading.Thread(target=lambda: got.append(pipe.read_bytes()))
        reader.start()
        try:
            # The reader opens the pipe on its own schedule: ask until it is there (at most 5 s).
            asked = any(recorder.ask() or reader.join(0.05) for _ in range(100))
        finally:
            if reader.is_alive():
                fd = os.open(pipe, os.O_WRONLY)  # lets a reader that never got a write finish
                os.close(fd)
            reader.join(5)
        assert asked and got == [b"1"], got
        pipe.unlink()
        dump = {"entries": [_entry(1, "nccl:all_reduce", "scheduled", 3)]}
        Path(recorder.prefix + "0").write_bytes(pickle.dumps(dump))
        digest = recorder.read()
        assert digest["entries"][0]["state"] == "scheduled" and digest["path"] == recorder.prefix + "0"
    finally:
        recorder.close()
    assert recorder.directory.exists(), "a directory holding a dump stays, for torchfrtrace"
    for path in recorder.directory.iterdir():
        path.unlink()
    recorder.directory.rmdir()


def _dump_then_crash():
    """A rank whose Gloo collectives torch's recorder saw, which writes torch's own dump where
    hvdmagic told torch to, then dies: Gloo does not dump on a timeout, NCCL does (test_gpu.py)."""
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(8)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    if dist.get_rank() == 1:
        dump = torch._C._distributed_c10d._dump_fr_trace()
        Path(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + "1").write_bytes(dump)
        os._exit(3)
    dist.barrier()


def test_a_failed_rank_shows_its_last_collectives_and_ranks_without_a_dump_leave_nothing(monkeypatch):
    # In local mode the ranks inherit the kernel's environment: this one has the recorder on for Gloo too.
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    before = set(Path(tempfile.gettempdir()).glob("hvdmagic-flight-*"))
    with pytest.raises(JobFailed) as caught:
        hvdmagic.run(_dump_then_crash, -2, backend="torch", timeout=120)
    text = "\n".join(caught.value._render_traceback_())
    assert "rank 1:\n  #1 gloo:all_reduce [[8]] Float" in text, text
    assert "  #2 gloo:broadcast [[8]] Float" in text and "in _dump_then_crash" in text, text
    digest = hvdmagic.last_run().flight_records[1]
    assert [e["op"] for e in digest["entries"]] == ["gloo:all_reduce", "gloo:broadcast"], digest
    assert 0 not in hvdmagic.last_run().flight_records, "rank 0 wrote no dump"
    left = set(Path(tempfile.gettempdir()).glob("hvdmagic-flight-*")) - before
    assert left == {Path(digest["path"]).parent}, f"only the dump's directory stays: {left}"
    for path in left:
        for file in path.iterdir():
            file.unlink()
        path.rmdir()
