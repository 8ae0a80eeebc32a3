"""GRPO-Guard: regulated clipping for Flow-GRPO.

Reference: J. Wang et al., "GRPO-Guard: Mitigating Implicit Over-Optimization in
Flow Matching via Regulated Clipping", arXiv:2510.22319 (Flow-Factory's trainer
``grpo-guard``).

Why plain GRPO's ratio is biased. A Flow-SDE step is Gaussian with a scale ``s``
fixed by the schedule: the rollout drew ``x' = mu_old + s eps``. Under the current
weights the mean is ``mu = mu_old + d``, and the log-ratio (log-probs are means over
the N latent dimensions) is

    log r = mean(eps d) / s - mean(d^2) / (2 s^2).

Its expectation over ``eps`` is ``-mean(d^2) / (2 s^2) < 0``: the ratio sits below 1,
so positive-advantage samples seldom reach ``1 + clip_range`` and their updates are
not clipped. Its spread, ``sqrt(mean(d^2) / N) / s``, grows as ``s`` shrinks, so one
clip range is loose at some steps and tight at others.

RatioNorm (ratio normalisation). Scale the log-ratio by ``s`` and add the bias back:

    log r_guard = s * log r + mean((mu - mu_old)^2) / (2 s)   (= mean(eps d))

which has mean 0 and spread ``sqrt(mean(d^2) / N)`` at every step. On-policy
``d = 0`` and ``log r = 0``, so ``r_guard = 1`` exactly. ``mu_old`` is the step's mean
as the rollout computed it, so the rollout records it (``records_step_means``).

Gradient reweighting. ``d log r_guard / d mu = eps / N``: every step pushes its
mean with unit-scale noise. The mean moves with the velocity as
``d mu / d v = (1 + g^2 (1 - sigma) / (2 sigma)) dt = (1 + a^2 / 2) dt`` for Flow-SDE
(``g^2 = a^2 sigma / (1 - sigma)``), so the policy loss of a step is divided by
``-dt = sigma - sigma_next``; the on-policy gradient with respect to ``v`` is then
``A eps (1 + a^2 / 2) / (B N)``, the same at every noise level.

Both derivations use Flow-SDE's mean and scale, hence Flow-SDE only. Because
``log r_guard`` is of order ``|dt| |delta v| / sqrt(N)``, clip ranges are much
smaller than plain GRPO's (around 1e-6).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..dynamics import FlowSDE, PartlyStochastic
from ..dynamics.base import mean_over_sample
from .base import TrainBatch
from .grpo import GRPO


def normalized_log_ratio(
    log_prob: Tensor, old_log_prob: Tensor, mean: Tensor, old_mean: Tensor, std: Tensor | float
) -> Tensor:
    """(B,) RatioNorm: ``s (logp - logp_old) + mean((mean - old_mean)^2) / (2 s)``.

    ``std`` is the step's scale ``s``, one number per sample: a scalar or a tensor
    broadcastable to ``mean`` that is constant over the non-batch dimensions.
    """
    std = torch.as_tensor(std, dtype=torch.float32, device=mean.device)
    s = std.expand_as(mean).reshape(mean.shape[0], -1)[:, 0]
    drift = mean_over_sample((mean.float() - old_mean.float()) ** 2)
    return s * (log_prob - old_log_prob.to(log_prob.dtype)) + drift / (2 * s)


class GRPOGuard(GRPO):
    name = "grpo-guard"
    records_step_means = True

    def __init__(self, train_cfg, dynamics):
        if not isinstance(dynamics.inner if isinstance(dynamics, PartlyStochastic) else dynamics, FlowSDE):
            raise ValueError(
                f"grpo-guard's ratio normalisation and step weights are derived for Flow-SDE, "
                f"got dynamics {dynamics.name!r}; set scheduler.dynamics_type: Flow-SDE"
            )
        super().__init__(train_cfg, dynamics)

    def log_ratio(self, log_prob: Tensor, mean: Tensor, std: Tensor, batch: TrainBatch) -> Tensor:
        if batch.old_mean is None:
            raise ValueError(
                "grpo-guard needs the rollout's step means (TrainBatch.old_mean); the rollout "
                "records them for algorithms with records_step_means = True"
            )
        part = self.dynamics.stochastic_part  # the log-prob's elements: the drift must average over the same
        return normalized_log_ratio(log_prob, batch.old_log_prob, part(mean), part(batch.old_mean), part(std))

    def policy_loss_weight(self, sigma: Tensor, sigma_next: Tensor) -> Tensor:
        return 1.0 / (sigma - sigma_next).float()
