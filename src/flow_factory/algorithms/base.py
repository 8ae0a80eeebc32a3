"""What an algorithm is: what its rollout needs, and a loss over a training batch.

An algorithm never sees a model's packing or text encoders: it calls
``policy.velocity`` (the current weights, with grad) and ``policy.reference_velocity``
(the reference: the LoRA adapter disabled, or a frozen copy) on latents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from torch import Tensor

from ..dynamics import Dynamics
from ..models.base import Conditioning


class Policy(Protocol):
    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor: ...

    def reference_velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor: ...


@dataclass
class TrainBatch:
    """A micro-batch of rollout samples, all trained at the same step index ``step``."""

    latents: Tensor  # (B, T + 1, *latent)
    old_log_probs: Tensor  # (B, T)
    advantages: Tensor  # (B,)
    sigmas: Tensor  # (T + 1,)
    cond: Conditioning
    step: int  # which denoising step this loss is for
    # (B, T, *latent): each step's Gaussian mean as the rollout computed it; recorded
    # only for algorithms with ``records_step_means`` (GRPO-Guard), else None
    old_means: Tensor | None = None


class Algorithm:
    name: ClassVar[str]
    # coupled: trains the sampler's own SDE steps through their log-probs (needs SDE dynamics)
    coupled: ClassVar[bool] = True
    # the rollout must also record each step's mean (TrainBatch.old_means)
    records_step_means: ClassVar[bool] = False

    def __init__(self, train_cfg, dynamics: Dynamics):
        self.cfg = train_cfg
        self.dynamics = dynamics

    def loss(self, policy: Policy, batch: TrainBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """Scalar loss and detached metrics (each a 0-d tensor) for one micro-batch at one step."""
        raise NotImplementedError  # abstract

