"""A real Jupyter kernel, started as a front end starts one, and cells run on it."""

from __future__ import annotations

import os
import queue
import time

from jupyter_client.manager import start_new_kernel


def start_kernel(**env: str):
    """A python3 kernel started through jupyter_client, as VS Code starts one: no JPY_SESSION_NAME."""
    kernel_env = {k: v for k, v in os.environ.items() if k != "JPY_SESSION_NAME"}
    kernel_env.update(env)
    return start_new_kernel(kernel_name="python3", env=kernel_env)


def execute(client, code: str, timeout: float, on_output=None) -> tuple[dict, list[str]]:
    """Run code; return (execute_reply content, output texts), calling on_output as text arrives."""
    return wait_for_reply(client, client.execute(code), timeout, on_output)


def wait_for_reply(client, msg_id: str, timeout: float, on_output=None) -> tuple[dict, list[str]]:
    """The reply to an execute request already sent, and the texts it output on the way."""
    texts = []
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no reply within {timeout} s; output so far: {texts}"
        try:
            msg = client.get_iopub_msg(timeout=remaining)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        content = msg["content"]
        if msg["msg_type"] == "stream":
            texts.append(content["text"])
            if on_output:
                on_output(content["text"])
        elif msg["msg_type"] == "error":
            texts.append("\n".join(content["traceback"]))
        elif msg["msg_type"] == "status" and content["execution_state"] == "idle":
            while True:  # skip replies to other requests (start_new_kernel's kernel_info)
                reply = client.get_shell_msg(timeout=10)
                if reply["parent_header"].get("msg_id") == msg_id:
                    return reply["content"], texts
