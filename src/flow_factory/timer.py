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

    @contextmanager
    def phase_within(self, name: str, outer: str):
        """``name`` timed while phase ``outer`` runs: counted in ``name`` and taken out of ``outer``, so that the
        phases still add up to the epoch (the optimise loop waiting for a reward: reward time, not training)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self.seconds[name] += spent
            self.seconds[outer] -= spent

    def reset(self) -> None:
        self.seconds.clear()
