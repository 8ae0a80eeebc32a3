"""A dynamics whose noise reaches part of the latent only: the wrapped dynamics' step where a
mask says, the ODE's step everywhere else.

LTX-2 denoises a video and its audio in one latent; Flow-Factory explores with the SDE on the
video alone and integrates the audio with the ODE, so a step's action, and its log-probability,
are the video's. The adapter says which elements are stochastic (``FlowAdapter.sampling_dynamics``
wraps the configured dynamics in this class); the rollout and the GRPO family then go through
``mean_and_std`` and ``log_prob`` as for any dynamics, and what reads a step's mean or scale
directly (the x-based KL, GRPO-Guard's ratio) restricts it with ``stochastic_part``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .base import Dynamics
from .ode import ODE


class PartlyStochastic(Dynamics):
    def __init__(self, inner: Dynamics, stochastic_mask: Callable[[Tensor], Tensor]):
        """``stochastic_mask(x)``: a bool tensor of one sample's shape, ``x.shape[1:]``, True where the noise acts."""
        self.inner, self.stochastic_mask = inner, stochastic_mask
        self.name, self.stochastic, self.noise_level = inner.name, inner.stochastic, inner.noise_level

    def solver(self) -> Dynamics:
        solver = self.inner.solver()
        return self if solver is self.inner else PartlyStochastic(solver, self.stochastic_mask)

    def mean_and_std(self, x: Tensor, v: Tensor, sigma, sigma_next) -> tuple[Tensor, Tensor]:
        mean, std = self.inner.mean_and_std(x, v, sigma, sigma_next)
        ode_mean, _ = ODE().mean_and_std(x, v, sigma, sigma_next)
        mask = self.stochastic_mask(x).to(mean.device)
        # a scale of exactly 0 off the mask: Dynamics.step adds 0 x noise there, the ODE step to the bit
        std = torch.where(mask, torch.as_tensor(std, device=mean.device), 0.0).expand_as(mean)
        return torch.where(mask, mean, ode_mean), std

    def stochastic_part(self, t: Tensor) -> Tensor:
        return t[:, self.stochastic_mask(t).to(t.device)]

    def log_prob(self, sample: Tensor, mean: Tensor, std: Tensor) -> Tensor:
        part = self.stochastic_part
        return self.inner.log_prob(part(sample), part(mean), part(std.expand_as(sample)))
