"""Flow-GRPO's SDE: the reverse-time SDE with the same marginals as the flow ODE.

With diffusion ``g(sigma) = a * sqrt(sigma / (1 - sigma))`` (``a`` = ``noise_level``),
the SDE that keeps the marginals of ``x_t = (1 - sigma) x0 + sigma eps`` is

    dx = [v - g^2 / 2 * score] dt + g dW,   score = -(x + (1 - sigma) v) / sigma,

(the score follows from ``x0_hat = x - sigma v``). One Euler-Maruyama step gives
flow_grpo's update

    mean = x (1 + g^2 dt / (2 sigma)) + v (1 + g^2 (1 - sigma) / (2 sigma)) dt
         = x + v dt + g^2 / (2 sigma) * (x + (1 - sigma) v) * dt,
    x'   = mean + g sqrt(-dt) eps.

We evaluate the second form with ``g^2 / (2 sigma) = a^2 / (2 (1 - sigma))``: the
division by sigma cancels analytically, so nothing divides by zero at sigma = 0, and
at ``a = 0`` the correction is an exact zero and the step is bit-for-bit the ODE's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Dynamics, step_inputs


class FlowSDE(Dynamics):
    name = "Flow-SDE"

    def mean_and_std(self, x: Tensor, v: Tensor, sigma, sigma_next) -> tuple[Tensor, Tensor]:
        x, v, sigma, sigma_next = step_inputs(x, v, sigma, sigma_next)
        dt = sigma_next - sigma
        a2 = self.noise_level**2

        # g^2 = a^2 sigma / (1 - sigma) is infinite at sigma = 1 (the first step of
        # every schedule). flow_grpo puts the next sigma in the denominator there,
        # which keeps the first step finite; the numerator keeps sigma = 1.
        sigma_in_root = torch.where(sigma >= 1, sigma_next, sigma)
        one_minus = 1 - sigma_in_root
        diffusion_sq = a2 * sigma / one_minus  # g^2
        half_g2_over_sigma = a2 / (2 * one_minus)  # g^2 / (2 sigma), sigma cancelled

        x1_hat = x + (1 - sigma) * v  # predicted noise; the score is -x1_hat / sigma
        mean = x + v * dt + half_g2_over_sigma * x1_hat * dt
        std = torch.sqrt(diffusion_sq * (-dt))
        return mean, std
