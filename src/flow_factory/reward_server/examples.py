"""Small ``RewardServer`` subclasses: how to write one, and what the tests and the async
benchmark serve. Torch-free, like any server that does not need a model."""

from __future__ import annotations

import time

import numpy as np
from PIL import ImageStat

from .base import RewardServer


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
