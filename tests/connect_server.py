"""A real Spark Connect server for the tests and benchmarks/bench_connect.py: pyspark's own server
class through its ``bin/spark-submit``, as ``sbin/start-connect-server.sh`` runs it (pyspark 4.0's
pip package has the server's jar but not that script), in a process group of its own, on 127.0.0.1.

Standard library only (and pyspark), so that the benchmark can import it without pytest.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ports import listening, reserve_port

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


def missing_server() -> str | None:
    """Why this pyspark cannot start a Connect server, or None. pyspark 3.5's pip package has the
    Connect client only: Spark 3.5 publishes the server on Maven (``--packages``), which these
    machines cannot reach; pyspark 4 ships its jar."""
    import pyspark

    if any((Path(pyspark.__file__).parent / "jars").glob("spark-connect_*.jar")):
        return None
    return (f"pyspark {pyspark.__version__}'s pip package ships no Spark Connect server (Spark 3.5 publishes it on "
            "Maven only); a Connect session needs a server from a Spark distribution or a cluster")


class ConnectServer:
    """``master``: the server's Spark master; ``conf``: more ``--conf`` settings."""

    def __init__(self, workdir: Path, master: str, conf: dict[str, str] | None = None):
        import pyspark

        from hvdmagic.launch import jvm_archive

        self.spark_home = Path(pyspark.__file__).parent
        self.port = reserve_port()
        self.url = f"sc://127.0.0.1:{self.port}"
        self.log = workdir / "connect-server.log"
        self.started = time.monotonic()
        # SPARK_CONNECT_MODE=0: the server itself is a classic Spark application (as the start script says).
        env = dict(os.environ, SPARK_HOME=str(self.spark_home), SPARK_LOCAL_IP="127.0.0.1", SPARK_CONNECT_MODE="0",
                   PYSPARK_PYTHON=sys.executable)  # the executors' Python: this venv, with hvdmagic
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(self.spark_home / "bin" / "spark-submit"), "--class", SERVER_CLASS,
                 "--name", "Spark Connect server", "--master", master,
                 "--conf", f"spark.connect.grpc.binding.port={self.port}",
                 "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
                 "--conf", "spark.driver.host=127.0.0.1", "--conf", "spark.ui.enabled=false",
                 "--conf", f"spark.driver.extraJavaOptions={jvm_archive.options()}",  # as the embedded JVM's start
                 *[arg for key, value in (conf or {}).items() for arg in ("--conf", f"{key}={value}")]],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_listening(self, timeout: float) -> float:
        """Seconds from the start until the port accepts connections. Stops the server and raises
        RuntimeError, with its log's end, if it exits first or ``timeout`` seconds pass."""
        while not listening(self.port):
            if self.proc.poll() is not None or time.monotonic() - self.started > timeout:
                self.stop()
                raise RuntimeError(f"the Spark Connect server did not listen on 127.0.0.1:{self.port} "
                                   f"(exit code {self.proc.poll()}); its log ends:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.25)
        return time.monotonic() - self.started

    def stop(self) -> None:
        """Until the whole process group is gone: spark-submit's shell may exit before its JVM does."""
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the script, whose zombie would keep the group alive
                try:
                    os.killpg(self.proc.pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.1)
