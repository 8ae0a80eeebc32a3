"""Coefficients-preserving sampling (FlowCPS): a DDIM-style step for flow matching.

The next sample is rebuilt from the two predictions with exactly the coefficients
the schedule prescribes at ``sigma_next``, so its noise level is right by construction:

    x0_hat = x - sigma v,   x1_hat = x + (1 - sigma) v,   s = sigma_next sin(a pi / 2),
    mean   = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - s^2) x1_hat,
    x'     = mean + s eps,

so that ``x'`` carries ``sigma_next`` worth of noise in total (predicted plus fresh).
``a`` in [0, 1] moves the noise from re-used (a = 0: the ODE) to fresh (a = 1).

Since ``(1 - sigma_next) x0_hat + sigma_next x1_hat = x + v dt`` and
``sqrt(sigma_next^2 - s^2) = sigma_next cos(a pi / 2)``, we evaluate
``mean = x + v dt - sigma_next (1 - cos(a pi / 2)) x1_hat``: the same number, without
a square root of a difference that float32 can round below zero, and exactly the
ODE step when a = 0.
"""

from __future__ import annotations

import math

from torch import Tensor

from .base import Dynamics, mean_over_sample, step_inputs


class CPS(Dynamics):
    name = "CPS"

    def __init__(self, noise_level: float = 0.0):
        # sin(a pi / 2) is symmetric about a = 1, so a in (1, 2] would silently mean 2 - a
        if not (math.isfinite(noise_level) and 0 <= noise_level <= 1):
            raise ValueError(f"CPS: noise_level must be in [0, 1], got {noise_level!r}")
        super().__init__(noise_level)

    def mean_and_std(self, x: Tensor, v: Tensor, sigma, sigma_next) -> tuple[Tensor, Tensor]:
        x, v, sigma, sigma_next = step_inputs(x, v, sigma, sigma_next)
        dt = sigma_next - sigma
        angle = self.noise_level * math.pi / 2

        x1_hat = x + (1 - sigma) * v
        mean = x + v * dt - sigma_next * (1 - math.cos(angle)) * x1_hat
        std = sigma_next * math.sin(angle)
        return mean, std

    def log_prob(self, sample: Tensor, mean: Tensor, std: Tensor) -> Tensor:
        """FlowCPS' surrogate ``-mean((x' - mean)^2)``, not a normalised density.

        The Gaussian's ``-log s - log(2 pi) / 2`` depends only on the schedule, not on
        the weights, so it cancels in the ratio ``exp(logp_new - logp_old)``. The
        ``1 / (2 s^2)`` factor is dropped as well: it would only rescale the log-ratio
        per step, and at the last step (sigma_next = 0, so s = 0) it is infinite. The
        result behaves as a Gaussian of one fixed variance at every step, which is what
        flow_cps trains with, so clip ranges tuned there carry over.
        """
        return -mean_over_sample((sample.float() - mean.float()) ** 2)
