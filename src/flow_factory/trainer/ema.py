"""EMA of the trained weights, its decay schedules, and weight swapping.

After epoch ``k`` (when ``(k + 1) % ema_update_interval == 0``) the EMA moves towards
the current weights: ``ema <- d(k) ema + (1 - d(k)) theta``. ``d(k)`` follows
``ema_decay_schedule``, with ``D = ema_decay`` the (maximum) decay and ``K`` =
``max_epochs``:

    constant          d = D
    power             d = min(D, 1 - (1 + k)^(-2/3))      (diffusers' EMAModel warmup, inv_gamma 1, power 2/3)
    linear            d = D min(1, k / K)
    piecewise_linear  d = 0 for k < flat_steps, then min(D, ramp_rate (k - flat_steps))   (DiffusionNFT)
    cosine            d = D (1 - cos(pi min(1, k / K))) / 2
    warmup_cosine     d = 0 for k < flat_steps, then the cosine over the remaining epochs

A decay of 0 copies the weights, so every ramp starts with the EMA following the policy.

``WeightCopy`` holds a copy of a list of parameters (on ``ema_device``: "cpu" keeps
accelerator memory free) and swaps it into the live parameters for a while
(``applied``): sampling with the EMA (``off_policy``), NFT's / AWM's old policy, the
EMA KL. The same class keeps the rollout-time weights for the on-policy old policy.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import torch

from ..sharding import gather_full, local, shard_of

EMA_SCHEDULES = ("constant", "power", "linear", "piecewise_linear", "cosine", "warmup_cosine")
EMA_FILE = "ema.pt"


def ema_decay_at(schedule: str, epoch: int, decay: float, total_epochs: int, flat_epochs: int = 0,
                 ramp_rate: float = 0.001) -> float:
    """The decay used by the EMA update after ``epoch`` (0-based) of ``total_epochs``; ``flat_epochs`` and
    ``ramp_rate`` (per epoch) are the config's ``flat_steps`` and ``ramp_rate``, which count epochs."""
    k, K = float(epoch), float(max(total_epochs, 1))
    if schedule == "constant":
        return decay
    if schedule == "power":
        return min(decay, 1.0 - (1.0 + k) ** (-2.0 / 3.0))
    if schedule == "linear":
        return decay * min(1.0, k / K)
    if schedule == "piecewise_linear":
        return 0.0 if k < flat_epochs else min(decay, ramp_rate * (k - flat_epochs))
    if schedule == "cosine":
        return decay * (1 - math.cos(math.pi * min(1.0, k / K))) / 2
    if schedule == "warmup_cosine":
        if k < flat_epochs:
            return 0.0
        span = max(K - flat_epochs, 1.0)
        return decay * (1 - math.cos(math.pi * min(1.0, (k - flat_epochs) / span))) / 2
    raise ValueError(f"train.ema_decay_schedule: unknown {schedule!r}; valid: {list(EMA_SCHEDULES)}")


class WeightCopy:
    """A float32 copy of ``params`` on ``device`` that can be blended in or swapped in.

    Of a sharded parameter (an FSDP2 DTensor, a ZeRO-3 partition) it copies this process's part;
    ``state_dict`` gathers the full tensors (every process calls it) and ``load_state_dict``
    keeps each process's part of them. ``before_swap`` runs before and after a swap: it frees
    the weights FSDP or ZeRO-3 gathered, so the next forward gathers the swapped parts."""

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device | str | None = None,
                 before_swap=None):
        self.params = list(params)
        self.device = torch.device(device) if device is not None else None
        self.before_swap = before_swap
        self.weights = [self._stored(p) for p in self.params]

    def _stored(self, p: torch.Tensor) -> torch.Tensor:
        p = local(p)
        return p.detach().to(self.device or p.device, dtype=torch.float32, copy=True)

    @torch.no_grad()
    def copy_from_params(self) -> None:
        for w, p in zip(self.weights, self.params):
            w.copy_(local(p).detach())

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """``w <- decay w + (1 - decay) p``."""
        for w, p in zip(self.weights, self.params):
            w.mul_(decay).add_(local(p).detach().to(w.device, torch.float32), alpha=1.0 - decay)

    @contextmanager
    def applied(self):
        """The live parameters hold these weights inside the block (no gradients through them)."""
        if self.before_swap is not None:
            with self._copied_in():
                yield
            return
        saved = [p.data for p in self.params]
        try:
            for p, w in zip(self.params, self.weights):
                p.data = w.to(p.device, p.dtype)
            yield
        finally:
            for p, data in zip(self.params, saved):
                p.data = data

    @contextmanager
    def _copied_in(self):
        # a shard is a view into the storage FSDP gathers from: swap values in place, not .data
        shards = [local(p).detach() for p in self.params]
        with torch.no_grad():
            saved = [s.clone() for s in shards]
            self.before_swap()
            for s, w in zip(shards, self.weights):
                s.copy_(w)
        try:
            yield
        finally:
            with torch.no_grad():
                self.before_swap()
                for s, old in zip(shards, saved):
                    s.copy_(old)

    def state_dict(self) -> dict:
        return {"weights": [gather_full(w, p).cpu() for w, p in zip(self.weights, self.params)]}

    def load_state_dict(self, state: dict) -> None:
        weights = state["weights"]
        if len(weights) != len(self.weights) or any(a.shape != p.shape for a, p in zip(weights, self.params)):
            raise ValueError(f"EMA state holds {len(weights)} tensors that do not match the "
                             f"{len(self.weights)} trainable parameters; was it saved with another "
                             "finetune_type, lora_rank or target_modules?")
        for w, saved, p in zip(self.weights, weights, self.params):
            w.copy_(shard_of(saved, p))


def load_ema(ema: WeightCopy, checkpoint_dir: Path, file_name: str = EMA_FILE) -> bool:
    """Restore the EMA (or another WeightCopy saved as ``file_name``) from a checkpoint folder;
    False when it holds none."""
    path = Path(checkpoint_dir) / file_name
    if not path.exists():
        return False
    ema.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return True
