"""Wall-clock seconds per phase of an epoch (sampling, decode, reward, training, ...)."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class PhaseTimer:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def reset(self) -> None:
        self.seconds.clear()
