"""tqdm's and Keras' own progress bars drive the ranks' rows, and their text is printed nowhere.

The unit tests run a plain Python process with a real event socket, as a rank has one
(``telemetry.open_events`` and ``framework_bars.install``, as ``rank.__main__`` calls them),
and read the events it wrote; the others run real ranks in local mode.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest
from conftest import run

import hvdmagic
from hvdmagic import metric_rows
from hvdmagic.kernel.ui import progress_text

# tqdm's text, as any of its bars draws it: "desc:  48%|████      | 29/60 [00:02<...".
TQDM_TEXT = re.compile(r"\d+%\||\d+it \[|\| *\d+/\d+ \[")
# Keras' text: "Epoch 1/2", "24/24 [====...] - 1s 8ms/step - loss: ..." or "24/24 - 1s - loss".
KERAS_TEXT = re.compile(r"Epoch \d+/\d+|\d+/\d+ \[=*[>.]*\]|\d+/\d+ - \d+s|ms/step")


def run_as_rank(code: str, before: str = "", timeout: float = 60, **env: str) -> tuple[str, str, list[dict]]:
    """Run ``code`` in a fresh interpreter set up as a rank sets itself up (after ``before``);
    return its stdout, its stderr and the events it wrote."""
    prologue = (f"{before}\nfrom hvdmagic.rank import framework_bars, telemetry\n"
                "telemetry.open_events()\nframework_bars.install()\n")
    epilogue = "\ntelemetry.flush()\n"
    read, write = os.pipe()
    process = subprocess.Popen(
        [sys.executable, "-c", prologue + textwrap.dedent(code) + epilogue],
        env={**os.environ, "HVDMAGIC_EVENT_FD": str(write), **env}, pass_fds=(write,),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(write)
    received: list[str] = []
    # Read on a thread while communicate() reads stdout and stderr: neither pipe may fill and block the process.
    reader = threading.Thread(target=lambda: received.append(os.fdopen(read).read()), daemon=True)
    reader.start()
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        process.kill()
    reader.join(timeout=10)  # EOF came when the process exited: its end of the pipe closed with it
    assert process.returncode == 0, f"the process failed ({process.returncode}):\n{err[-3000:]}"
    assert received, "the event socket was still open 10 s after the process ended"
    return out, err, [json.loads(line) for line in received[0].splitlines()]


def as_rank(code: str, before: str = "", timeout: float = 60, **env: str) -> tuple[str, str, dict, dict]:
    """``run_as_rank``, with each bar's ``[step, total]`` as reported, in order, and each metric's
    values, instead of the events."""
    out, err, events = run_as_rank(code, before, timeout, **env)
    bars, metrics = {}, {}
    for event in events:
        if event.get("type") != "report":
            continue
        for desc, state in event["progress"].items():
            bars.setdefault(desc, []).append(state[:2])
        if "metrics" in event:
            _, _, columns = metric_rows.decode(event["metrics"])
            for name, column in columns.items():
                metrics.setdefault(name, []).extend(v for v in column if v == v)  # NaN: no value in that row
    return out, err, bars, metrics


def last(reported: dict) -> dict:
    return {desc: states[-1] for desc, states in reported.items()}


@pytest.mark.unit
def test_a_bar_restarted_and_overtaken_between_two_flushes_still_reports_its_restart():
    # A Keras or tqdm epoch can be shorter than a flush (0.1 s): the kernel sees a restart only
    # as a step below the last one, so the restart must travel even when later steps overtook it.
    _, _, reported, _ = as_rank("""
        telemetry.progress(5, 12, "batch")
        telemetry.flush()
        for step in [*range(6, 13), *range(13)]:  # the epoch's end and the whole next one, between two flushes
            telemetry.progress(step, 12, "batch")
    """)
    steps = [step for step, _ in reported["batch"]]
    assert steps.count(0) == 1, f"the restart was not sent, once: {steps}"
    restart = steps.index(0)
    assert steps[restart - 1] == 12, f"the epoch's last step did not come before the restart: {steps}"
    assert steps[0] == 5 and steps[-1] == 12, steps


@pytest.mark.unit
def test_tqdm_bars_report_their_counts_and_draw_nothing():
    out, err, reported, _ = as_rank("""
        from tqdm import tqdm, trange
        for epoch in range(300):  # a bar per epoch, each with a name of its own (hvdmagic forgets closed ones)
            for step in tqdm(range(3), desc=f"pass {epoch}"):
                pass
        for epoch in trange(2):  # unnamed, like the bar inside it: each bar open at once gets a name
            for step in tqdm(range(30), leave=False):
                pass
        with tqdm(total=10, desc="manual") as bar:
            for step in range(10):
                bar.update(1)
                bar.set_description(f"loss {step}")  # a description per step keeps the one bar
        for step in tqdm(range(4), desc="off a terminal", disable=None):  # tqdm's "only on a TTY"
            pass
        for step in tqdm(range(3), desc="switched off", disable=True):
            pass
        for step in tqdm(range(3), desc="off on rank 1", disable=1):  # disable=hvd.rank() on rank 1
            pass
        tqdm.write("a line from tqdm.write")
        with open("/dev/null", "w") as elsewhere:  # a bar the user sends to a file of theirs is theirs
            for step in tqdm(range(5), desc="to a file", file=elsewhere):
                pass
    """)
    bars = last(reported)
    passes = {desc: bars.pop(desc) for desc in list(bars) if desc.startswith("pass ")}
    assert passes == {f"pass {epoch}": [3, 3] for epoch in range(300)}
    assert bars == {"": [2, 2], "bar 2": [30, 30], "manual": [10, 10], "off a terminal": [4, 4]}, bars
    assert out == "a line from tqdm.write\n"
    assert err == "", "tqdm drew on the rank's stderr"


@pytest.mark.unit
def test_tqdm_auto_and_notebook_are_plain_adopted_tqdm_without_ipython():
    out, err, reported, _ = as_rank("""
        import sys
        from tqdm.auto import tqdm
        from tqdm.notebook import tnrange, tqdm as notebook_tqdm
        for step in tqdm(range(7), desc="auto"):
            pass
        for step in notebook_tqdm(range(5), desc="notebook: "):
            pass
        for step in tnrange(3, desc="tnrange"):
            pass
        print(sorted(name for name in ("IPython", "ipywidgets") if name in sys.modules))
    """)
    bars = last(reported)
    assert bars == {"auto": [7, 7], "notebook": [5, 5], "tnrange": [3, 3]}, bars
    assert out == "[]\n", "a rank imported IPython or ipywidgets"
    assert err == ""


@pytest.mark.unit
def test_install_imports_no_framework():
    out, err, reported, _ = as_rank("""
        import sys
        print(sorted(name for name in ("tqdm", "tensorflow", "keras", "tf_keras") if name in sys.modules))
        framework_bars.install()  # a second install changes nothing
        print(sum(type(finder).__name__ == "_Finder" for finder in sys.meta_path))
        import tqdm
        for step in tqdm.tqdm(range(6), desc="imported after"):
            pass
    """)
    assert out == "[]\n1\n"
    assert last(reported) == {"imported after": [6, 6]}
    assert err == ""


@pytest.mark.unit
def test_a_frameworks_import_is_said_while_it_runs_the_outermost_only(tmp_path):
    # Issue 37: the rank says "importing tensorflow" from the import's start to its end, the kernel shows it.
    (tmp_path / "outer_fw.py").write_text("import inner_fw\n")
    (tmp_path / "inner_fw.py").write_text("VALUE = 1\n")
    (tmp_path / "broken_fw.py").write_text("raise ImportError('a missing library')\n")
    before = (f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
              "from hvdmagic.rank import framework_imports\n"
              "framework_imports.FRAMEWORKS |= {'outer_fw', 'inner_fw', 'broken_fw'}\n")
    out, err, events = run_as_rank("""
        import outer_fw, inner_fw
        print(type(outer_fw.__loader__).__name__, inner_fw.VALUE)  # the module keeps its own loader
        try:
            import broken_fw
        except ImportError:
            pass
        import torch
    """, before)
    assert out == "SourceFileLoader 1\n", err
    said = [(event["stage"], event["importing"]) for event in events if event["type"] == "stage"]
    assert said == [("importing", "outer_fw"), ("importing", ""), ("importing", "broken_fw"), ("importing", ""),
                    ("importing", "torch"), ("importing", "")], said


@pytest.mark.unit
def test_a_bar_module_imported_before_install_is_adopted_by_it():
    _, err, reported, _ = as_rank("""
        for step in tqdm.tqdm(range(4), desc="imported before"):
            pass
    """, before="import tqdm")
    bars = last(reported)
    assert bars == {"imported before": [4, 4]}
    assert err == ""


@pytest.mark.unit
def test_a_bar_hvdmagic_cannot_adopt_keeps_printing_and_says_so_once_per_run():
    # A framework version whose bar classes differ must not break the user's import.
    out, err, events = run_as_rank("""
        import json
        def unknown_version(module):
            raise AttributeError("type object 'Progbar' has no attribute 'update'")
        for _ in range(2):
            framework_bars._adopt(unknown_version, json)
        print(json.dumps({"imported": True}))
    """)
    notes = [(event["text"], event.get("once")) for event in events if event.get("type") == "note"]
    note = ("hvdmagic: json's progress bar prints as text in the ranks instead of driving their rows "
            "(AttributeError: type object 'Progbar' has no attribute 'update')")
    assert notes == [(note, "framework_bars json")] * 2, notes  # the kernel shows a note with a `once` key once
    assert out == '{"imported": true}\n' and err == ""


# -- real ranks ------------------------------------------------------------------------------


def test_a_tqdm_loop_drives_each_ranks_bar_and_its_text_reaches_no_log(ip, capfd):
    _, error = run(ip, """%%horovod --np -2
import time
from tqdm import tqdm
print("before the loop")
for epoch in tqdm(range(2), desc="epochs"):
    for step in tqdm(range(30), desc="tqdm loop", leave=False):
        time.sleep(0.002)
print("after the loop")
""")
    assert error is None, error
    record = hvdmagic.last_run()
    out = capfd.readouterr().out
    for rank in record.ranks:
        bars = {desc: (bar.step, bar.total) for desc, bar in rank.bars.items()}
        assert bars == {"epochs": (2, 2), "tqdm loop": (30, 30)}, f"rank {rank.rank}: {bars}"
        assert progress_text.progress_summary(rank) == "epochs 2/2 · tqdm loop 30/30"
        logs = record.logs[rank.rank]
        assert logs == "before the loop\nafter the loop\n", f"rank {rank.rank} logged {logs!r}"
    assert not TQDM_TEXT.search(out), f"tqdm's text reached the cell's output:\n{out[-2000:]}"


def test_tqdm_bars_drive_the_rows_of_every_cell_on_warm_ranks(ip):
    # A session's ranks adopt tqdm once, when the first cell imports it; the later cells' bars are adopted too.
    ip.run_line_magic("horovod", "start --np -2")
    try:
        for cell in range(2):
            _, error = run(ip, f"%%horovod\nfrom tqdm import trange\nfor _ in trange({20 + cell}, desc='cell {cell}'):"
                               "\n    pass\nprint('printed')")
            assert error is None, error
            record = hvdmagic.last_run()
            for rank in record.ranks:
                bars = {desc: (bar.step, bar.total) for desc, bar in rank.bars.items()}
                assert bars == {f"cell {cell}": (20 + cell, 20 + cell)}, f"cell {cell}, rank {rank.rank}: {bars}"
                assert record.logs[rank.rank] == "printed\n", record.logs[rank.rank]
    finally:
        ip.run_line_magic("horovod", "stop")


KERAS_CELL = """%%horovod --np -2 --out keras_module
import numpy as np
from tensorflow import keras
from hvdmagic.callbacks.keras import HvdmagicCallback

keras.utils.set_random_seed(0)
x = np.random.rand(96, 4).astype("float32")
y = x.sum(axis=1, keepdims=True)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
model.compile("sgd", "mse")
# With the dashboard's callback as well, the bar only stays silent: nothing is logged twice.
model.fit(x, y, batch_size=8, epochs=1, verbose=1, callbacks=[HvdmagicCallback()])
model.fit(x, y, batch_size=8, epochs=2, verbose=1, validation_data=(x, y))
type(model).__module__
"""


def test_keras_fit_verbose_1_drives_the_epoch_and_batch_bars_and_logs_its_metrics(ip, capfd):
    pytest.importorskip("tensorflow", reason="the README's set-up installs TensorFlow (HVDMAGIC_TENSORFLOW=none skips)")
    _, error = run(ip, KERAS_CELL)
    assert error is None, error
    assert ip.user_ns["keras_module"].startswith("tf_keras."), "the ranks' tf.keras is Keras 2 (tf_keras)"
    record = hvdmagic.last_run()
    out = capfd.readouterr().out
    batches = 96 // 8
    metrics = record.metrics
    for rank in record.ranks:
        bars = {desc: (bar.step, bar.total) for desc, bar in rank.bars.items()}
        assert bars == {"epoch": (2, 2), "batch": (batches, batches)}, f"rank {rank.rank}: {bars}"
        assert progress_text.progress_summary(rank) == f"epoch 2/2 · batch {batches}/{batches}"
        logs = record.logs[rank.rank]
        assert not KERAS_TEXT.search(logs), f"Keras' bar text reached rank {rank.rank}'s log:\n{logs[-2000:]}"
        rows = metrics[metrics["rank"] == rank.rank]
        # A row per batch and one per epoch, from the callback's fit (1 epoch) and the bar's (2 epochs).
        assert rows["loss"].notna().sum() == 3 * batches, rows["loss"].notna().sum()
        assert rows["epoch_loss"].notna().sum() == 3
        assert rows["val_loss"].notna().sum() == 2
    assert not KERAS_TEXT.search(out), f"Keras' text reached the cell's output:\n{out[-2000:]}"
    assert re.search(r"^rank 0 · epoch 2/2 · ", out, re.M), f"no epoch line in the text view:\n{out[-2000:]}"


def test_keras_3_fit_evaluate_predict_and_a_progbar_of_its_own():
    pytest.importorskip("keras", reason="Keras 3 comes with TensorFlow in the README's set-up")
    out, err, reported, metrics = as_rank("""
        import numpy as np
        import keras
        x = np.random.rand(96, 4).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
        model.fit(x, y, batch_size=8, epochs=3, verbose=1, validation_data=(x, y))
        model.evaluate(x, y, batch_size=32, verbose=1)
        model.predict(x, batch_size=48, verbose=1)
        bar = keras.utils.Progbar(5)  # a custom loop's own bar: unnamed
        for step in range(5):
            bar.update(step + 1, values=[("loss", 1.0)])
        print(keras.__version__.split(".")[0], type(model).__module__)
    """, timeout=300, TF_CPP_MIN_LOG_LEVEL="2")
    bars = last(reported)
    assert out == "3 keras.src.models.sequential\n", f"not Keras 3, or Keras printed: {out[-2000:]}"
    assert not KERAS_TEXT.search(err), err[-2000:]
    assert bars == {"epoch": [3, 3], "batch": [12, 12], "evaluate": [3, 3], "predict": [2, 2], "": [5, 5]}, bars
    assert len(metrics["loss"]) == 3 * 12 and len(metrics["epoch_loss"]) == 3 and len(metrics["val_loss"]) == 3
