"""%%horovod on real local Spark with real Horovod over Gloo."""

from __future__ import annotations

import numpy as np

from conftest import run
from hvdmagic.errors import JobFailed, JobTimeout


def test_two_rank_allreduce_and_streamed_output(ip, capfd):
    result, error = run(ip, """%%horovod --np 2
import torch, horovod.torch as hvd
hvd.init()
print(f"ready {hvd.rank()}/{hvd.size()}")
hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
""")
    assert error is None
    assert result == 3.0
    out = capfd.readouterr().out
    assert "[rank 0] ready 0/2" in out
    assert "[rank 1] ready 1/2" in out


def test_rank0_result_is_returned_and_stored_with_out(ip):
    result, error = run(ip, """%%horovod --np 2 --out answer
import horovod.torch as hvd
hvd.init()
{"rank": hvd.rank(), "size": hvd.size()}
""")
    assert error is None
    assert result == {"rank": 0, "size": 2}
    assert ip.user_ns["answer"] == {"rank": 0, "size": 2}


def test_notebook_function_class_and_array_are_captured(ip, capfd):
    ip.run_cell("""
import numpy as np
weights = np.arange(6, dtype=np.float64).reshape(2, 3)
def scale(x):
    return x * factor
factor = 10
class Accumulator:
    def __init__(self):
        self.total = 0.0
    def add(self, value):
        self.total += value
        return self
""")
    result, error = run(ip, """%%horovod --np 2
import horovod.torch as hvd
hvd.init()
acc = Accumulator().add(scale(weights).sum())
(acc.total, type(acc).__name__)
""")
    assert error is None
    assert result == (150.0, "Accumulator")
    summary = capfd.readouterr().out
    # `factor` is read only by `scale`, so it travels inside the pickled function.
    assert "captured 3 global(s)" in summary
    for name in ("weights (numpy.ndarray", "scale (function", "Accumulator (type"):
        assert name in summary


def test_var_expansion_on_magic_line(ip):
    ip.user_ns["n"] = 2
    result, error = run(ip, "%%horovod --np {n}\nimport horovod.torch as hvd\nhvd.init()\nhvd.size()")
    assert error is None and result == 2


def test_rank_raising_while_other_waits_in_allreduce(ip):
    ip.user_ns["answer"] = "untouched"
    _, error = run(ip, """%%horovod --np 2 --out answer
import torch, horovod.torch as hvd
hvd.init()
if hvd.rank() == 1:
    raise ValueError("rank one is broken")
hvd.allreduce(torch.ones(1))
""")
    assert isinstance(error, JobFailed)
    assert [f.rank for f in error.failures][:1] == [1]
    rendered = "\n".join(error._render_traceback_())
    assert "rank 1" in rendered and "ValueError: rank one is broken" in rendered
    assert 'File "<horovod-cell>", line 5' in rendered
    assert 'raise ValueError("rank one is broken")' in rendered
    assert "hvdmagic/rank.py" not in rendered  # no launcher frames
    assert ip.user_ns["answer"] == "untouched"

    # The next cell works.
    result, error = run(ip, "%%horovod --np 2\nimport horovod.torch as hvd\nhvd.init()\nhvd.rank()")
    assert error is None and result == 0


def test_nonzero_exit_names_rank_and_code(ip):
    _, error = run(ip, """%%horovod --np 2
import os
import horovod.torch as hvd
hvd.init()
if hvd.rank() == 0:
    os._exit(3)
""")
    assert isinstance(error, JobFailed)
    assert error.failures[0].rank == 0
    assert "exited with code 3" in str(error)


def test_timeout_stops_every_rank(ip):
    _, error = run(ip, "%%horovod --np 2 --timeout 4\nimport time\ntime.sleep(600)")
    assert isinstance(error, JobTimeout)
    assert "--timeout 4" in str(error)
    assert sorted(error.stopped) == [0, 1]
