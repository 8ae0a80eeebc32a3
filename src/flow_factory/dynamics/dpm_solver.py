"""DPM-Solver++(2M): a second-order multistep ODE solver for flow matching.

Reference: C. Lu et al., "DPM-Solver++: Fast Solver for Guided Sampling of Diffusion
Probabilistic Models", arXiv:2211.01095 (the multistep data-prediction solver, 2M).

In flow-matching terms ``x = alpha x0 + sigma eps`` with ``alpha = 1 - sigma``; the data
prediction is ``x0_hat = x - sigma v`` and ``lambda = log(alpha / sigma)`` (half the
log-SNR). With ``h = lambda_next - lambda`` one step is

    first order:   x' = (sigma_next / sigma) x - alpha_next (e^-h - 1) x0_hat
                      (this is exactly the Euler step x + v dt, see below),
    second order:  x' = first order - alpha_next (e^-h - 1) D1 / 2,
                   D1 = (x0_hat - x0_hat_prev) / r,  r = (lambda - lambda_prev) / h.

Since ``alpha = 1 - sigma``, ``(sigma_next / sigma) x - alpha_next (e^-h - 1) x0_hat``
equals ``(sigma_next / sigma) x + (1 - sigma_next / sigma) x0_hat = x + v dt``: the
first-order solver is the ODE's Euler step, and the correction is the only new term.

It needs the previous step's data prediction, so it is the one stateful dynamics:
``solver()`` returns a fresh copy with an empty history for each trajectory. The
first step (no history), a step from sigma = 1 (lambda = -inf, so r is infinite and
D1 vanishes in the limit) and the last step (sigma_next = 0, where the solver lands
on ``x0_hat``, as diffusers' ``lower_order_final``) are first order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Dynamics, StepResult, as_batch_column, step_inputs


def _half_log_snr(sigma: Tensor) -> Tensor:
    return torch.log1p(-sigma) - torch.log(sigma)


class DPMSolver2M(Dynamics):
    name = "DPM-Solver++2M"
    stochastic = False

    def __init__(self, noise_level: float = 0.0):
        super().__init__(noise_level)  # unused: a deterministic solver; kept for the registry's signature
        self._prev: tuple[Tensor, Tensor] | None = None  # (x0_hat, sigma) of the previous step

    def solver(self) -> "DPMSolver2M":
        return DPMSolver2M(self.noise_level)

    def mean_and_std(self, x: Tensor, v: Tensor, sigma, sigma_next,
                     prev: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        x, v, s, s_next = step_inputs(x, v, sigma, sigma_next)
        x0_hat = x - s * v
        euler = x + v * (s_next - s)
        zero = torch.zeros((), device=x.device)
        if prev is None:
            return euler, zero
        x0_prev, s_prev = prev[0], as_batch_column(prev[1], x)
        # second order only where every lambda is finite: 0 < sigma_next, sigma_prev < 1
        usable = (s_next > 0) & (s_prev < 1)
        safe = lambda t: torch.where(usable, t, torch.full_like(t, 0.5))  # noqa: E731  (keeps log finite)
        lam, lam_next, lam_prev = _half_log_snr(safe(s)), _half_log_snr(safe(s_next)), _half_log_snr(safe(s_prev))
        h = lam_next - lam
        r = (lam - lam_prev) / h
        d1 = (x0_hat - x0_prev) / r
        correction = -(1 - safe(s_next)) * torch.expm1(-h) * d1 / 2
        return euler + torch.where(usable, correction, torch.zeros_like(correction)), zero

    def step(self, x: Tensor, v: Tensor, sigma, sigma_next, generator=None, noise=None) -> StepResult:
        x, v = x.float(), v.float()
        mean, std = self.mean_and_std(x, v, sigma, sigma_next, self._prev)
        self._prev = (x - as_batch_column(sigma, x) * v, torch.as_tensor(sigma, dtype=torch.float32))
        return StepResult(mean, mean, std, None)
