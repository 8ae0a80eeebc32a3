"""DanceGRPO's SDE: the marginal-preserving reverse SDE with a constant diffusion ``a``.

    dx = [v - a^2 / 2 * score] dt + a dW,   score = -(x - (1 - sigma) x0_hat) / sigma^2,

with ``x0_hat = x - sigma v``. One Euler-Maruyama step:

    mean = x + v dt - a^2 / 2 * score * dt,   x' = mean + a sqrt(-dt) eps.

Since ``x - (1 - sigma) x0_hat = sigma (x + (1 - sigma) v)``, the score is
``-(x + (1 - sigma) v) / sigma``. We use that form: one division by sigma instead of
two, and no cancellation between ``x`` and ``(1 - sigma) x0_hat`` at small sigma,
where both are nearly the clean image and the reference's difference loses float32
digits before being blown up by ``1 / sigma^2``.

Edge steps. At sigma = 1 the score is ``-x`` (the marginal is N(0, I)) and nothing
is singular. At sigma = 0 the score is undefined; a step can only start there in a
schedule padded with a zero-length step (sigma = sigma_next = 0), where dt = 0 and the
step must leave x unchanged, so the correction is set to zero there instead of 0 * inf.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Dynamics, step_inputs


class DanceSDE(Dynamics):
    name = "Dance-SDE"

    def mean_and_std(self, x: Tensor, v: Tensor, sigma, sigma_next) -> tuple[Tensor, Tensor]:
        x, v, sigma, sigma_next = step_inputs(x, v, sigma, sigma_next)
        dt = sigma_next - sigma
        a2 = self.noise_level**2

        # where() with a safe denominator rather than a clamp: the unselected branch
        # must stay finite too, or its gradient turns into NaN.
        positive = sigma > 0
        safe_sigma = torch.where(positive, sigma, torch.ones_like(sigma))
        half_a2_over_sigma = torch.where(positive, a2 / (2 * safe_sigma), torch.zeros_like(sigma))

        x1_hat = x + (1 - sigma) * v  # predicted noise; score = -x1_hat / sigma
        mean = x + v * dt + half_a2_over_sigma * x1_hat * dt
        std = self.noise_level * torch.sqrt(-dt)
        return mean, std
