"""Talking to pdb in a real Jupyter kernel, as a front end does: its prompts answered on the stdin channel.
Shared by the tests of a session rank's pdb and of a fresh cell's held rank."""

from __future__ import annotations

import contextlib
import queue
import time

from helpers import WaitTimeout, shell_reply


def converse(client, code: str, on_prompt, timeout: float, on_output=None) -> tuple[dict, str, list[str]]:
    """Run ``code`` in a Jupyter kernel with stdin allowed, as a notebook does; answer each input_request
    with ``on_prompt(prompt)`` (None: no answer, the caller stopped the kernel instead). Return the
    execute reply, the cell's output (streams and errors, in order) and the prompts asked."""
    msg_id = client.execute(code, allow_stdin=True)
    out: list[str] = []
    prompts: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        if time.monotonic() > deadline:
            raise WaitTimeout(f"{code!r} did not end within {timeout:g} s; its output so far:\n{''.join(out)}")
        with contextlib.suppress(queue.Empty):
            request = client.get_stdin_msg(timeout=0.02)
            if request["msg_type"] == "input_request":
                prompts.append(request["content"]["prompt"])
                if (line := on_prompt(prompts[-1])) is not None:
                    client.input(line)
        try:
            msg = client.get_iopub_msg(timeout=0.02)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
            if on_output is not None:
                on_output("".join(out))
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]) + "\n")
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return shell_reply(client, msg_id), "".join(out), prompts


def typed_lines(*lines: str):
    """``on_prompt`` that types ``lines`` in order, and fails the test if pdb asks for more."""
    queued = list(lines)

    def answer(prompt: str) -> str:
        assert queued, f"pdb asked once more ({prompt!r}) than the test had lines for"
        return queued.pop(0)

    return answer
