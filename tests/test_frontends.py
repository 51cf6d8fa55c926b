"""The dashboard in front ends that no Jupyter server started, and the snapshot a notebook keeps.

A kernel started straight through jupyter_client (as VS Code, Colab or Databricks start
one: no ``JPY_SESSION_NAME``) gets the widget dashboard once the run has gone on for a
moment; when the run ends its output becomes the static snapshot, whose text/plain keeps
the ranks' last output lines. A notebook executed by nbclient stores that snapshot, with
no widget view left in it. ``HVDMAGIC_NONINTERACTIVE`` is left unset throughout.
"""

from __future__ import annotations

import queue
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import execute, iopub_messages, shell_reply

from hvdmagic.kernel.ui.dashboard import ENDED_TEXT_BUNDLE

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

TRAIN = """%%horovod --np -2
import time, hvdmagic
steps = 40
for i in range(steps):
    time.sleep(0.05)
    hvdmagic.progress(i + 1, total=steps, desc="train")
    hvdmagic.log_metrics(step=i, loss=1.0 / (i + 1))
print("trained")
"""

FINAL_TEXT = """\
%%horovod np=2 (local): finished
[rank 0] trained
[rank 1] trained
rank 0: train 40/40 [finished]
rank 1: train 40/40 [finished]
rank 0 metrics at step 39: loss=0.025
"""


def _run(client, code: str, timeout: float, on_message=None) -> tuple[dict, list[dict]]:
    """Run code; return the execute_reply content and every iopub message of the cell, in order.

    Comm messages are kept too: ipywidgets sends them with the cell as parent, but a
    message from a subshell has the front end's request as its parent.
    """
    msg_id = client.execute(code)
    messages = []
    for msg in iopub_messages(client, msg_id, timeout, comms=True):
        messages.append(msg)
        if on_message:
            on_message(msg)
    return shell_reply(client, msg_id), messages


@pytest.mark.profile
def test_a_kernel_without_a_jupyter_server_shows_widgets_then_the_snapshot(kernel_factory):
    # Started through jupyter_client with neither JPY_SESSION_NAME nor HVDMAGIC_NONINTERACTIVE.
    _, client = kernel_factory(interactive=True)
    reply, texts = execute(client, "%load_ext hvdmagic", timeout=60)
    assert reply["status"] == "ok", texts
    subshells = _subshells(client)
    models: dict[str, dict] = {}  # comm id -> the widget's state as opened
    control: dict = {}

    def click_log_scale_once_charts_show(msg):
        """A user's click on "log" while the ranks train, as the front end sends it."""
        content = msg["content"]
        if msg["msg_type"] == "comm_open":
            models[content["comm_id"]] = content["data"]["state"]
        state = content.get("data", {}).get("state", {}) if msg["msg_type"] == "comm_msg" else {}
        if control or 'class="hvdmagic-chart"' not in str(state.get("value", "")):
            return
        toggle = next(cid for cid, m in models.items() if m.get("_model_name") == "ToggleButtonsModel")
        control["sent"] = time.monotonic()
        client.shell_channel.send(client.session.msg("comm_msg", {
            "comm_id": toggle, "data": {"method": "update", "state": {"index": 2}, "buffer_paths": []}}))

    reply, messages = _run(client, TRAIN, timeout=240, on_message=click_log_scale_once_charts_show)
    assert reply["status"] == "ok", reply
    streams = "".join(m["content"]["text"] for m in messages if m["msg_type"] == "stream")
    assert "[rank 0] trained" not in streams, "the text view ran in a Jupyter kernel"

    # The dashboard's widget models were opened and displayed, with a text/plain fallback.
    names = [state.get("_model_name") for state in models.values()]
    assert names.count("FloatProgressModel") == 3, names  # a bar per rank and the overall bar
    dashboard = next(cid for cid, state in models.items() if "hvdmagic-dashboard" in state.get("_dom_classes", []))
    shown, text = [m["content"] for m in messages if m["msg_type"] == "display_data"]
    assert shown["data"][WIDGET_VIEW]["model_id"] == dashboard
    assert "%%horovod np=2 (local)" in shown["data"]["text/plain"]
    display_id = shown["transient"]["display_id"]
    # Beside it, the live rows as text for a front end without widgets, with a hidden box as its widget view.
    assert models[text["data"][WIDGET_VIEW]["model_id"]].get("_model_name") == "BoxModel"
    assert "rank 0" in text["data"]["text/plain"] and "rank 1" in text["data"]["text/plain"]
    updates = [m["content"] for m in messages if m["msg_type"] == "update_display_data"]
    ours = [u for u in updates if u["transient"]["display_id"] == display_id]

    # While the ranks trained, the widgets were updated: the bars moved, the charts appeared.
    end = next(i for i, m in enumerate(messages)
               if m["msg_type"] == "update_display_data" and m["content"]["transient"]["display_id"] == display_id)
    live = [m["content"] for m in messages[:end] if m["msg_type"] == "comm_msg"]
    bars = {cid for cid, state in models.items() if state.get("_model_name") == "FloatProgressModel"}
    steps = {c["data"]["state"]["value"] for c in live if c["comm_id"] in bars and "value" in c["data"]["state"]}
    assert any(0 < value < 40 for value in steps), f"no bar moved while the ranks trained: {sorted(steps)}"
    charts = [str(c["data"]["state"].get("value", "")) for c in live]
    assert any('data-metric="loss"' in value for value in charts), "no chart was drawn during the run"

    # The click reached the kernel while the cell ran (a subshell), and the charts were redrawn log-scaled.
    if subshells:
        assert control, "the charts never showed, so the control was never clicked"
        assert any('data-scale="log"' in value for value in charts), \
            "a click on the log scale did not redraw the charts while the cell ran"

    # The run ended: one update of the same display, to the snapshot; the live text emptied; then the
    # widgets were closed.
    final = messages[end]["content"]
    assert final["data"]["text/plain"] == FINAL_TEXT
    assert 'class="hvdmagic-snapshot"' in final["data"]["text/html"]
    assert WIDGET_VIEW not in final["data"]
    assert len(ours) == 1, f"the dashboard's display was updated {len(ours)} times"
    assert updates[-1] == {"data": ENDED_TEXT_BUNDLE, "metadata": {},
                           "transient": {"display_id": text["transient"]["display_id"]}}, updates[-1]
    closed = {m["content"]["comm_id"] for m in messages[end:] if m["msg_type"] == "comm_close"}
    assert set(models) <= closed, f"{len(set(models) - closed)} widget(s) left open after the run"


def test_the_kernel_reads_busy_while_a_run_answers_other_requests(kernel_factory):
    """JupyterLab asks for a subshell (on the control channel) when the dashboard's first widget
    appears, and a click on a control is answered on a subshell: each answer ends with an idle
    status, which the status bar, VS Code and idle cullers take for the kernel's. A busy on the
    cell's behalf must follow it, so the last status before the cell's own idle says busy."""
    _, client = kernel_factory(interactive=True)
    reply, texts = execute(client, "%load_ext hvdmagic", timeout=60)
    assert reply["status"] == "ok", texts
    if not _subshells(client):
        # ipykernel 6 answers nothing while a cell runs: there is no idle to follow.
        return
    asked: dict = {}

    def ask_for_a_subshell_once_the_dashboard_shows(msg):
        if msg["msg_type"] == "display_data" and not asked:
            request = client.session.msg("create_subshell_request", {})
            asked["id"] = request["header"]["msg_id"]
            client.control_channel.send(request)

    statuses = []
    msg_id = client.execute("%%horovod --np -2\nimport time\ntime.sleep(3)\n")
    deadline = time.monotonic() + 240
    while not (statuses and statuses[-1] == (msg_id, "idle")):
        assert time.monotonic() < deadline, f"the cell did not end in 240 s; statuses so far: {statuses}"
        try:
            msg = client.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        ask_for_a_subshell_once_the_dashboard_shows(msg)
        if msg["msg_type"] == "status":
            statuses.append((msg["parent_header"].get("msg_id"), msg["content"]["execution_state"]))
    assert shell_reply(client, msg_id)["status"] == "ok"
    assert asked, "the dashboard never showed, so no subshell was asked for"
    answered = statuses.index((asked["id"], "idle"))
    assert (msg_id, "busy") in statuses[answered:-1], (
        f"after answering the subshell request the kernel said idle and never busy again: {statuses}")
    assert statuses[-2] == (msg_id, "busy"), f"the last status before the cell's end was not busy: {statuses}"


def _subshells(client) -> bool:
    """Whether the kernel can route messages to subshells (ipykernel 7), as the controls need."""
    return "kernel subshells" in shell_reply(client, client.kernel_info()).get("supported_features", [])


@pytest.mark.profile
def test_nbclient_stores_the_snapshot_not_the_widgets(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.delenv("HVDMAGIC_NONINTERACTIVE", raising=False)
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext hvdmagic"),
        nbformat.v4.new_code_cell(
            "%%horovod --np -2\n"
            "import time, hvdmagic\n"
            "for i in hvdmagic.track(range(30), desc='train'):\n"
            "    hvdmagic.log_metrics(step=i, loss=1.0 / (i + 1))\n"
            "    time.sleep(0.05)  # past the dashboard's delay: the widgets are shown, then replaced\n"
            "print('trained')\n"
        ),
    ]
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    path = tmp_path / "executed.ipynb"
    nbformat.write(nb, path)
    outputs = nbformat.read(path, as_version=4).cells[1].outputs
    assert not any(WIDGET_VIEW in o.get("data", {}) for o in outputs), "a widget view was left in the saved output"
    displays = [o for o in outputs if o.output_type == "display_data"]
    # The snapshot, and the live text for front ends without widgets, emptied when the run ended.
    assert len(displays) == 2 and displays[1].data == ENDED_TEXT_BUNDLE, outputs
    data = displays[0].data
    assert data["text/plain"] == ("%%horovod np=2 (local): finished\n"
                                  "[rank 0] trained\n"
                                  "[rank 1] trained\n"
                                  "rank 0: train 30/30 [finished]\n"
                                  "rank 1: train 30/30 [finished]\n"
                                  "rank 0 metrics at step 29: loss=0.03333\n")
    page = data["text/html"]
    assert 'class="hvdmagic-snapshot" data-state="finished"' in page
    assert 'data-metric="loss"' in page and "<script" not in page
    assert re.search(r'class="hvdmagic-log" data-rank="1".*?<pre[^>]*>trained</pre>', page), \
        "the snapshot should show the ranks' last lines"
    assert not any("[rank 0] trained" in o.get("text", "") for o in outputs), "text view used in a Jupyter kernel"


# -- nbconvert's text exports ---------------------------------------------------------------------------
EPOCHS = """%%horovod --np -2
import time, hvdmagic
print("epoch 1")
print()
for i in hvdmagic.track(range(30), desc='train'):
    hvdmagic.log_metrics(step=i, loss=1.0 / (i + 1))
    time.sleep(0.05)  # past the dashboard's delay: the live text's display is made, then emptied
print("epoch 2")
"""


@pytest.fixture(scope="module")
def executed_notebook(tmp_path_factory):
    """A notebook as nbclient executes and saves it: a run that showed its widgets, whose ranks
    printed an empty line between two others."""
    import nbformat
    from nbclient import NotebookClient

    folder = tmp_path_factory.mktemp("exports")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("%load_ext hvdmagic"), nbformat.v4.new_code_cell(EPOCHS)]
    with pytest.MonkeyPatch.context() as env:
        env.delenv("HVDMAGIC_NONINTERACTIVE", raising=False)
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(folder)}}).execute()
    path = folder / "run.ipynb"
    nbformat.write(nb, path)
    return path


def _empty_directives(rst: str) -> list[str]:
    """The reST directives with no content below them (docutils: "Content block expected")."""
    lines = rst.splitlines()
    empty = []
    for i, line in enumerate(lines):
        if re.match(r"\.\. [\w-]+::\s*$", line):
            body = next((later for later in lines[i + 1:] if later.strip()), "")
            if not body[:1].isspace():
                empty.append(line)
    return empty


@pytest.mark.parametrize("export", ["markdown", "rst", "asciidoc", "script"])
def test_nbconverts_text_exports_keep_the_ranks_output_lines(executed_notebook, export):
    """Markdown and AsciiDoc take the snapshot's HTML over its text/plain, and reST takes it as raw
    HTML: the ranks' lines are in the HTML for them, and the emptied live text leaves no block."""
    if export == "asciidoc" and shutil.which("pandoc") is None:
        pytest.skip("nbconvert's AsciiDoc export converts HTML with pandoc, which is not installed "
                    "(scripts/setup.sh installs it)")
    jupyter = Path(sys.executable).with_name("jupyter")
    done = subprocess.run([str(jupyter), "nbconvert", "--to", export, "--stdout", str(executed_notebook)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "not able to be represented" not in done.stderr, done.stderr
    converted = done.stdout
    if export == "script":  # nbconvert's script export writes the code alone, as the docs say
        assert "run_cell_magic('horovod', '--np -2'" in converted and "[rank" not in converted, converted
        return
    for rank in (0, 1):
        for line in ("epoch 1", "", "epoch 2"):
            assert f"[rank {rank}] {line}\n" in converted, (rank, line, converted[:3000])
    if export == "markdown":
        # The snapshot is one block of HTML: Markdown would end it at a blank line, and read the rest as Markdown.
        start = converted.index('<div class="hvdmagic-snapshot"')
        block = re.split(r"\n[ \t]*\n", converted[start:])[0]
        assert block.count("<div") == block.count("</div>") and block.endswith("</div>"), block[-500:]
        # The emptied live text: an empty text/plain was an indented empty line, an empty code block.
        assert not re.search(r"^[ \t]+$", converted, re.MULTILINE), converted[-2000:]
    if export == "rst":
        assert not _empty_directives(converted), converted[-2000:]
