"""Reward servers for the tests and benches: two small ``RewardServer`` subclasses, and
``ff-reward-server`` started in a subprocess.

A child process finds the servers here by name (``--reward reward_servers.MeanPixelServer``)
because ``start_server`` and ``child_env`` put this folder on its ``PYTHONPATH``. The
servers are torch-free, like any server that does not need a model.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
from PIL import ImageStat

from flow_factory.reward_server import RewardServer

HERE = Path(__file__).resolve().parent


class MeanPixelServer(RewardServer):
    """Reward = the image's mean pixel value in [0, 1] plus a number read from the prompt
    (``"<k> ..."`` adds k), so a client can check that every answer is its own and in order.
    ``delay``: seconds each ``compute_reward`` call sleeps (a slow model)."""

    def __init__(self, delay: float = 0.0):
        self.delay = float(delay)
        self.calls = 0

    def compute_reward(self, prompts, images, videos, **kwargs):
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)
        if images is None:
            raise ValueError("MeanPixelServer needs images")
        offset = [float(p.split()[0]) if p.split() and _is_number(p.split()[0]) else 0.0 for p in prompts]
        # ImageStat sums a histogram: no float copy of the image (the memory tests count on that)
        return [float(np.mean(ImageStat.Stat(im).mean) / 255) + k for im, k in zip(images, offset)]


class LatencyServer(RewardServer):
    """Every request costs ``latency`` seconds and is computed alone (like a remote API with a
    fixed latency per call; concurrent requests are merged into one call); reward = mean pixel value."""

    def __init__(self, latency: float = 0.2):
        self.latency = float(latency)

    def compute_reward(self, prompts, images, videos, **kwargs):
        time.sleep(self.latency)
        return [float(np.asarray(im, dtype=np.float64).mean() / 255) for im in images]


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def child_env(env: dict | None = None) -> dict:
    """``os.environ`` updated with ``env``, and this folder first on ``PYTHONPATH``."""
    out = {**os.environ, **(env or {})}
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), out.get("PYTHONPATH")) if p)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(reward: str, port: int, *args: str, wait: float = 60.0, env: dict | None = None) -> subprocess.Popen:
    """``ff-reward-server --reward reward --port port *args``; returns once /health answers."""
    cmd = [sys.executable, "-m", "flow_factory.reward_server.cli", "--reward", reward, "--port", str(port), *args]
    return start_process(cmd, port, wait=wait, env=env)


def start_process(cmd: list[str], port: int, wait: float = 60.0, env: dict | None = None, log=subprocess.PIPE):
    """Any server started by ``cmd`` on 127.0.0.1:``port``; returns once its /health answers.
    ``log``: where its output goes (a file for a server that logs every request: a pipe nobody
    reads would fill and stop it)."""
    proc = subprocess.Popen(cmd, env=child_env(env), stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            said = proc.stdout.read() if proc.stdout else f"(its output went to {getattr(log, 'name', log)})"
            raise RuntimeError(f"reward server exited with {proc.returncode}: {said}")
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
