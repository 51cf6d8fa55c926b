"""The messages and the payload framing of ``hvdmagic.protocol``: one definition each."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from hvdmagic import protocol
from hvdmagic.launch.placement import Elastic, Placement, PlacementError, Where
from hvdmagic.protocol import Blob, Boot, Event, Framework, Payload, Slot

pytestmark = pytest.mark.unit

PACKAGE = Path(protocol.__file__).parent


def test_no_module_builds_a_message_by_hand():
    """Every message comes from its builder in protocol.py, so a field added there reaches every mode."""
    by_hand = re.compile(r"""["']type["']\s*:""")
    found = [f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py")) if path.name != "protocol.py"
             for number, line in enumerate(path.read_text().splitlines(), start=1) if by_hand.search(line)]
    assert found == [], "messages built outside hvdmagic/protocol.py:\n" + "\n".join(found)


def test_go_carries_every_field_to_every_mode():
    slot = Slot(rank=1, size=2, local_rank=0, local_size=1, cross_rank=1, cross_size=2, host="10.0.0.2")
    go = protocol.go(slot, ["0", 0])
    assert go == {"type": Event.GO, "slot": slot.to_dict(), "devices": ["0", 0], "rows_per_rank": None}
    assert protocol.slot_of(go) == slot


def test_one_framing_carries_one_shot_and_session_payloads():
    stream = io.BytesIO()
    protocol.write_boot(stream, Boot(3, "rank0", session=True))
    protocol.write_payload(stream, Payload(b"one-shot"))
    big = Payload(b"\x00" * 70_000, buffers=("a" * 64, "b" * 64), blobs=(Blob("a" * 64, 5, "X"),))
    protocol.write_payload(stream, big, cell_id=7)
    protocol.write_payload(stream, Payload(b"", head_blob="c" * 64), cell_id=8)
    stream.write(b"\x00\x00\x00")  # a frame cut short: the supervisor died mid-write
    stream.seek(0)
    assert protocol.read_boot(stream) == Boot(3, "rank0", session=True)
    assert protocol.read_payload(stream) == (None, Payload(b"one-shot"))
    # The blobs stay with the supervisor, which fetched them: the rank needs only their order.
    assert protocol.read_payload(stream) == (7, Payload(big.head, big.buffers))
    assert protocol.read_payload(stream) == (8, Payload(b"", head_blob="c" * 64))
    assert protocol.read_payload(stream) is None


def test_a_session_rank_reads_its_cells_ranks_and_its_debuggers_lines_from_one_stream():
    stream = io.BytesIO()
    protocol.write_payload(stream, Payload(b"on some"), cell_id=3, ranks=[0, 2])
    protocol.write_control(stream, protocol.debug_input(1, "p x"))
    protocol.write_payload(stream, Payload(b"on all"), cell_id=4)
    stream.seek(0)
    assert protocol.read_request(stream) == protocol.CellRequest(3, Payload(b"on some"), (0, 2))
    assert protocol.read_request(stream) == {"type": "debug_input", "rank": 1, "line": "p x"}
    assert protocol.read_request(stream) == protocol.CellRequest(4, Payload(b"on all"), None)
    assert protocol.read_request(stream) is None


def test_a_cell_message_carries_the_payload_as_it_came():
    payload = Payload(b"\xff\x00payload", ("d" * 64,), (Blob("d" * 64, 1 << 30, "X (numpy.ndarray)"),), "e" * 64)
    message = protocol.cell(4, payload)
    assert protocol.cell_payload(json.loads(json.dumps(message))) == payload


@pytest.mark.parametrize("np, where, ranks", [(3, Where.SPARK, 3), (-2, Where.LOCAL, 2)])
def test_the_sign_of_np_is_decoded_once(np, where, ranks):
    placement = Placement.of(np)
    assert (placement.where, placement.np, placement.tasks, placement.signed_np) == (where, ranks, ranks, np)


@pytest.mark.parametrize("arguments, message", [
    (dict(np=0), "--np must be a positive number of Spark ranks, or negative for local mode"),
    (dict(np=2.5), "--np must be a whole number of ranks, not 2.5"),
    (dict(np=True), "--np must be a whole number of ranks, not True"),
    (dict(np=2, controller="ssh"), "controller must be one of gloo, mpi, not 'ssh'"),
    (dict(np=2, controller="mpi", framework=Framework.TORCH), "controller 'mpi' is for Horovod"),
    (dict(np=2, elastic=Elastic(3, 4)), "elastic training needs 1 <= --min-np <= --np <= --max-np"),
    (dict(np=2, elastic=Elastic(1, 2), framework=Framework.TORCH), "elastic training is Horovod's"),
    (dict(np=2, elastic=Elastic(1, 2, reset_limit=-1)), "--reset-limit must be 0 or more"),
])
def test_a_placement_that_cannot_run_is_refused_in_one_sentence(arguments, message):
    with pytest.raises(PlacementError, match=re.escape(message)) as caught:
        Placement.of(**arguments)
    assert isinstance(caught.value, ValueError)  # HorovodRunner(np=0) raised ValueError, and still does


def test_an_elastic_placement_runs_max_np_tasks():
    placement = Placement.of(-2, elastic=Elastic(1, 4))
    assert (placement.np, placement.tasks, placement.local) == (2, 4, True)
    with pytest.raises(PlacementError, match="--stall-timeout is not applied to elastic runs"):
        placement.check_options(stall_timeout=5)
    Placement.of(2).check_options(data=object(), stall_timeout=5)  # a fixed-size run takes both
