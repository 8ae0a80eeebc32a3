"""Start ``ff-reward-server`` in a subprocess and wait until it answers /health: for tests,
benchmarks and scripts that need a server for a while."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(reward: str, port: int, *args: str, wait: float = 60.0, env: dict | None = None) -> subprocess.Popen:
    """``ff-reward-server --reward reward --port port *args``; returns once /health answers."""
    cmd = [sys.executable, "-m", "flow_factory.reward_server.cli", "--reward", reward, "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"reward server exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise TimeoutError(f"reward server on port {port} did not come up within {wait:g} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)
    if proc.stdout:
        proc.stdout.close()
