"""The contract every sampling dynamics follows.

Conventions (DESIGN.md): ``sigma`` in [0, 1] is the noise level, 1 = pure noise;
``x_t = (1 - sigma) x0 + sigma eps``; the network predicts ``v = eps - x0``;
sampling runs from sigma = 1 down, so ``dt = sigma_next - sigma < 0``.

A step is Gaussian: ``x_next = mean + std * noise``. ``mean_and_std`` is the whole
of a dynamics' maths; sampling and training both go through it, so the log-prob
recomputed in training is the one recorded in the rollout (invariant 1).
All arithmetic is float32 whatever the model dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class StepResult:
    sample: Tensor  # x_next
    mean: Tensor  # mean of the step's Gaussian
    std: Tensor  # its scale, broadcastable to sample (zero for ODE)
    log_prob: Tensor | None  # (B,), mean over non-batch dims; None for ODE


def as_batch_column(sigma: Tensor | float, like: Tensor) -> Tensor:
    """A scalar or (B,) sigma reshaped to broadcast against ``like`` (B, ...), float32."""
    s = torch.as_tensor(sigma, dtype=torch.float32, device=like.device)
    if s.ndim == 0:
        return s
    return s.reshape(-1, *([1] * (like.ndim - 1)))


def step_inputs(x: Tensor, v: Tensor, sigma, sigma_next) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What every ``mean_and_std`` starts from: ``x`` and ``v`` in float32 (step arithmetic is
    float32 whatever the model dtype), ``sigma`` and ``sigma_next`` as columns broadcasting against them."""
    x = x.float()
    return x, v.float(), as_batch_column(sigma, x), as_batch_column(sigma_next, x)


def mean_over_sample(t: Tensor) -> Tensor:
    """Mean over every dim but the batch one: (B, ...) -> (B,)."""
    return t.reshape(t.shape[0], -1).mean(dim=1)


class Dynamics:
    """One step of a sampler. Subclasses implement ``mean_and_std``."""

    name: str = ""
    stochastic: bool = True

    def __init__(self, noise_level: float = 0.0):
        if not (math.isfinite(noise_level) and noise_level >= 0):
            raise ValueError(f"{self.name}: noise_level must be a finite number >= 0, got {noise_level!r}")
        self.noise_level = float(noise_level)

    def mean_and_std(self, x: Tensor, v: Tensor, sigma, sigma_next) -> tuple[Tensor, Tensor]:
        raise NotImplementedError  # abstract: each dynamics file defines its maths

    def solver(self) -> "Dynamics":
        """The object that integrates one trajectory. Single-step dynamics keep no state and
        return themselves; a multistep solver (DPM-Solver++2M) returns a fresh copy with an
        empty history, so trajectories never share state."""
        return self

    def stochastic_part(self, t: Tensor) -> Tensor:
        """The elements of a step's sample, mean or scale (full shape) that the noise acts on: all of them,
        but for a dynamics that leaves part of the latent to the ODE (``partial.PartlyStochastic``)."""
        return t

    def log_prob(self, sample: Tensor, mean: Tensor, std: Tensor) -> Tensor:
        """Gaussian log-density of ``sample``, averaged over non-batch dims (flow_grpo's scale)."""
        std = torch.as_tensor(std, dtype=torch.float32, device=sample.device)
        std = std.expand_as(sample) if std.ndim == 0 else std
        lp = (
            -((sample.float() - mean.float()) ** 2) / (2 * std**2)
            - torch.log(std)
            - 0.5 * math.log(2 * math.pi)
        )
        return mean_over_sample(lp)

    def step(
        self,
        x: Tensor,
        v: Tensor,
        sigma,
        sigma_next,
        generator: torch.Generator | None = None,
        noise: Tensor | None = None,
    ) -> StepResult:
        x, v = x.float(), v.float()
        mean, std = self.mean_and_std(x, v, sigma, sigma_next)
        if not self.stochastic:
            return StepResult(mean, mean, torch.zeros((), device=x.device), None)
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        sample = mean + std * noise
        return StepResult(sample, mean, std, self.log_prob(sample, mean, std))
