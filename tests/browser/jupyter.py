"""Start an isolated JupyterLab server and a headless Debian Chromium for browser tests.

Everything Jupyter reads or writes (config, data, runtime, lab settings, workspaces)
lives in a temp dir, so the user's own Jupyter set-up cannot change what the test sees.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
from helpers import wait_until
from ports import reserve_port

CHROMIUM = os.environ.get("HVDMAGIC_CHROMIUM", "/usr/bin/chromium")
# The Python that serves JupyterLab; the kernel is always this one (sys.executable). A runtime profile
# with ipywidgets 7 names a JupyterLab 3.6 of its own here (scripts/profiles.py): ipywidgets 7's front
# end, jupyterlab_widgets 1, is a JupyterLab 3 extension.
LAB_PYTHON = os.environ.get("HVDMAGIC_LAB_PYTHON") or sys.executable
# Background traffic must stay off: the test machines have no internet.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def _prepare_home(home: Path) -> dict[str, str]:
    """Write the kernelspec and lab settings; return the server's environment."""
    data = home / "data"
    # The kernel must be this interpreter (the venv's), not whatever `python` is on PATH.
    spec = data / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (hvdmagic venv)", "language": "python",
    }))
    # The news/update toast would cover the notebook and makes a network request.
    settings = home / "lab-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"checkForUpdates": False, "fetchNews": "false"}))
    env = dict(os.environ)
    env.update(
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTER_DATA_DIR=str(data),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(home / "lab-settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
        IPYTHONDIR=str(home / "ipython"),
        PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
        SPARK_LOCAL_IP="127.0.0.1",
        # Force the widget dashboard, whatever hvdmagic guesses about the front end.
        HVDMAGIC_NONINTERACTIVE="0",
        PYTHONUNBUFFERED="1",
        # In a venv jupyter_core searches the env before JUPYTER_DATA_DIR; our kernelspec must win.
        JUPYTER_PREFER_ENV_PATH="0",
    )
    return env


class JupyterLab:
    """A JupyterLab server on 127.0.0.1 serving ``root``; use as a context manager."""

    def __init__(self, root: Path, home: Path, log: Path):
        self.root, self.home, self.log = root, home, log
        self.port = reserve_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> JupyterLab:
        env = _prepare_home(self.home)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            # Own process group, so teardown can stop the server and anything it forked.
            self.proc = subprocess.Popen(
                [LAB_PYTHON, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
                 f"--port={self.port}", "--ServerApp.port_retries=0",
                 "--ServerApp.token=", "--ServerApp.password=", "--allow-root",
                 f"--ServerApp.root_dir={self.root}"],
                env=env, cwd=self.root, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready(timeout=60)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self, timeout: float) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status", timeout=2) as r:
                    return r.status == 200
            except (urllib.error.URLError, OSError):
                return False

        wait_until(ready, timeout, lambda: f"jupyter lab not ready:\n{self.log_tail()}", interval=0.2)

    def log_tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return "(no server log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # Kernels run in their own sessions (jupyter_client uses start_new_session), and
        # they start Spark's JVM and the rank processes: remember them all before the
        # server goes, and stop whatever the server's own shutdown leaves behind.
        descendants = []
        with contextlib.suppress(psutil.Error):
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)  # jupyter shuts its kernels down on SIGTERM
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for p in descendants:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(descendants, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()


def missing_chromium() -> str | None:
    if os.access(CHROMIUM, os.X_OK):
        return None
    return (f"Chromium not found at {CHROMIUM}. Run scripts/install_browser.sh (as root it "
            "apt-get installs Debian's chromium), or set HVDMAGIC_CHROMIUM to a Chromium binary.")


def launch_chromium(playwright):
    """Debian's Chromium, headless: Playwright's own browser download needs the internet."""
    if problem := missing_chromium():
        raise FileNotFoundError(problem)
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
