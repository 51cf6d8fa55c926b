"""``tests/ports.py``, which keeps test processes out of each other's ports: a second ``make test``'s too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ports import reserve_port

pytestmark = pytest.mark.unit

# A test process of another `make test`: its own TMPDIR, this directory's modules importable.
_ANOTHER_TEST_PROCESS = """
import sys
import ports
try:
    with ports.holding(int(sys.argv[1]), within=0.5):
        print("it got the port")
except RuntimeError as exc:
    print(exc)
"""


def test_a_port_this_process_holds_is_held_for_a_second_make_tests_processes(tmp_path):
    """A second ``make test`` beside this one runs test processes with TMPDIRs of their own (conftest gives
    every test process one, and pytest-xdist's workers inherit their controller's): the ports' locks must
    still be the same files for both, or the two suites take the same ports. They did, on 2026-12-07: the
    two suites' in-kernel Connect servers met on 15002, which each held by its own lock directory."""
    port = reserve_port()
    other = subprocess.run([sys.executable, "-c", _ANOTHER_TEST_PROCESS, str(port)], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "TMPDIR": str(tmp_path),
                                            "PYTHONPATH": str(Path(__file__).parent)})
    assert other.stdout.strip() == f"port {port} on 0.0.0.0 was held or bound by another process for 0.5 s", other
