"""qbatch-worker's own start-up errors: one line and a non-zero exit, no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys


def test_a_metrics_port_in_use_is_one_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "worker", "--engine", "echo", "--metrics-host", "127.0.0.1",
             "--metrics-port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.strip()]
    assert line.startswith(f"qbatch-worker: cannot serve metrics on 127.0.0.1:{port}")


def test_bad_settings_exit_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "worker", "--engine", "echo", "--no-redis-sink"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "no reply sink" in proc.stderr
