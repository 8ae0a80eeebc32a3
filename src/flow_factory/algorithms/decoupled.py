"""The decoupled family (DiffusionNFT, AWM, Diffusion-DPO): train on the forward process.

The rollout only has to deliver each sample's final latent ``x0``; any dynamics can
produce it (ODE, an SDE, DPM-Solver++2M). For each micro-batch the algorithm draws
its own noise levels (``timesteps.py``) and fresh noise, and trains the velocity at
``x_t = (1 - sigma) x0 + sigma eps`` against the flow-matching target ``eps - x0``.
Noise and timesteps come from a generator the trainer seeds by (seed, epoch, inner
epoch, rank, micro-batch), so a resumed run trains on the same draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterator

import torch
from torch import Tensor

from ..dynamics.base import as_batch_column
from ..models.conditioning import Conditioning, index_cond
from .base import Algorithm, RolloutsLike
from .timesteps import draw_training_sigmas, num_train_timesteps


@dataclass
class NoisedBatch:
    """Clean latents, the noise and noise level they are mixed with, and advantages."""

    x0: Tensor  # (B, *latent) float32: the rollouts' final latents
    noise: Tensor  # (B, *latent)
    sigma: Tensor  # (B,)
    advantages: Tensor  # (B,)
    cond: Conditioning
    parts: int = 1  # per-timestep batches this one joins (``base.merge_batches``)
    # (B, *latent) bool: the elements the model generates, which the losses average over (``Rollouts.generated``);
    # None: all of them
    generated: Tensor | None = None

    @property
    def x_t(self) -> Tensor:
        s = as_batch_column(self.sigma, self.x0)
        return (1 - s) * self.x0 + s * self.noise

    @property
    def target(self) -> Tensor:
        """The flow-matching velocity target ``eps - x0``."""
        return self.noise - self.x0

    def part(self, t: Tensor) -> Tensor:
        """(B, n): ``t``'s elements that the model generates, which are what a loss compares (all of ``t``,
        flattened, without ``generated``)."""
        return t.flatten(1) if self.generated is None else t[self.generated].reshape(len(t), -1)


def generated_rows(rollouts: RolloutsLike, x0: Tensor) -> Tensor | None:
    """``rollouts.generated`` for each row of ``x0`` (None when the model generates every element)."""
    return None if rollouts.generated is None else rollouts.generated.to(x0.device).expand_as(x0)


def reference_guidance(cfg) -> dict:
    """``policy.reference_velocity``'s keyword for ``kl_cfg`` (dgpo, crd): above 1 the frozen reference
    is called with CFG at that scale (Flow-Factory's guided teacher), otherwise at the policy's own."""
    return {"guidance_scale": cfg.kl_cfg} if cfg.kl_cfg > 1 else {}


class DecoupledAlgorithm(Algorithm):
    coupled = False
    # the shared noise of a pair (DPO) is drawn once per unit and repeated over its k samples
    noise_shared_within_unit: ClassVar[bool] = False

    def __init__(self, train_cfg, dynamics):
        super().__init__(train_cfg, dynamics)
        self.num_timesteps = num_train_timesteps(train_cfg)

    def kept_states(self, num_steps: int, sde_steps: list[int] | None) -> list[int]:
        return [num_steps]  # only the final latent: training draws its own noise levels

    def micro_batches(self, rollouts: RolloutsLike, advantages: Tensor, units: Tensor,
                      generator: torch.Generator) -> Iterator[NoisedBatch]:
        # units (b, k) -> samples ordered column by column: [all first members, all second members, ...]
        idx = units.t().reshape(-1)
        x0 = rollouts.latents_at(idx, len(rollouts.sigmas) - 1).float()
        cond = index_cond(rollouts.cond, idx)
        sigmas = draw_training_sigmas(self.cfg.time_sampling_strategy, self.num_timesteps, rollouts.sigmas.cpu(),
                                      self.cfg.timestep_range, self.cfg.time_shift, generator)
        b, k = units.shape
        for sigma in sigmas:
            shape = (b, *x0.shape[1:]) if self.noise_shared_within_unit else x0.shape
            noise = torch.randn(shape, generator=generator, dtype=torch.float32)
            if self.noise_shared_within_unit:
                noise = noise.repeat(k, *([1] * (noise.ndim - 1)))
            yield NoisedBatch(x0=x0, noise=noise.to(x0.device), sigma=sigma.expand(len(idx)).to(x0.device),
                              advantages=advantages[idx], cond=cond, generated=generated_rows(rollouts, x0))

    @staticmethod
    def advantage_metrics(advantages: Tensor) -> dict[str, Tensor]:
        adv = advantages.detach().float()
        return {"advantage_mean": adv.mean(), "advantage_min": adv.min(), "advantage_max": adv.max()}
