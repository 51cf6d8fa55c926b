"""Chatter that would fill a cell: TensorFlow's start-up notices on a CPU machine, and the like.

Such lines stay in the rank's full log (``last_run().logs``), leave the live views,
and come back in the error output when that rank fails, where they may explain why.
"""

from __future__ import annotations

import re

_NOISE = re.compile("|".join([
    # TensorFlow's C++ logging, in absl's format and in its older one.
    r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+\.(cc|h):\d+\]",
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWE] (tensorflow|external|xla)/",
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$",
    r"oneDNN custom operations are on",
    r"This TensorFlow binary is optimized to use available CPU instructions",
    r"^To enable the following instructions: .* rebuild TensorFlow",
    r"Could not find cuda drivers on your machine",
    r"Unable to register cu(DNN|FFT|BLAS) factory",
    r"TF-TRT Warning: Could not find TensorRT",
    r"failed call to cuInit",
    # Keras, when a callback (hvdmagic's dashboard one included) takes longer than a tiny batch.
    r"Callback method `on_\w+` is slow compared to the batch time",
    # torch (2.11, Colab's, here) on the flight recorder's old variable names, which hvdmagic sets beside
    # the new ones for older torch (task/flight_recorder.py): the user set neither.
    r"Warning: Environment variable TORCH_NCCL_\w+ is deprecated; use TORCH_FR_\w+ instead",
    # Horovod's echo, in every other rank, of a rank that died: the run names the lost rank itself.
    r"Horovod background loop uncaught exception: .*(Connection reset by peer|Connection closed by peer)",
]))


def is_startup_noise(line: str) -> bool:
    return _NOISE.search(line) is not None
