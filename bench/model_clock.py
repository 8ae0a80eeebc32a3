"""Time spent inside model calls, for the benches: hooks that add each call's wall time (and count)
under a name. The epoch's time minus these totals is the framework's own cost."""

from __future__ import annotations

import time
from collections import defaultdict


class ModelClock:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def _add(self, key: str, start: float) -> None:
        self.seconds[key] += time.perf_counter() - start
        self.calls[key] += 1

    def forward(self, module, key: str) -> None:
        """Time every forward of ``module`` (torch hooks)."""
        starts = []
        module.register_forward_pre_hook(lambda *_: starts.append(time.perf_counter()))
        module.register_forward_hook(lambda *_: self._add(key, starts.pop()))

    def method(self, obj, name: str, key: str) -> None:
        """Time every call of ``obj.name`` (replaced by a timed wrapper)."""
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._add(key, start)
        setattr(obj, name, timed)

    def watch_trainer(self, trainer) -> None:
        """The model work of a Trainer's epoch: transformer and text-encoder forwards, VAE decode,
        backward and optimizer step."""
        pipe = trainer.adapter.pipeline
        # Wan2.2 A14B: both experts; a --baseline revision older than multi-expert adapters has one
        transformers = getattr(trainer.adapter, "transformers", {"transformer": pipe.transformer})
        for transformer in transformers.values():
            self.forward(transformer, "transformer forward")
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
            if getattr(pipe, name, None) is not None:  # freed by the prompt cache: nothing to time
                self.forward(getattr(pipe, name), "text encoder forwards")
        self.method(pipe.vae, "decode", "vae decode")
        self.method(trainer.accelerator, "backward", "backward")
        self.method(trainer.optimizer, "step", "optimizer step")

    def total(self) -> float:
        return sum(self.seconds.values())

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()
