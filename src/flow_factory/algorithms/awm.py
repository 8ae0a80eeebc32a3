"""Advantage Weighted Matching (AWM; arXiv:2509.25050): RL as advantage-weighted
flow matching, with PPO's clipping on the matching likelihood.

The log-likelihood of a sample under a velocity field is taken to be its negative
flow-matching error at ``x_t``: with ``e = mean((v - (eps - x0))^2)`` and ``t = sigma``,

    Uniform: -e     t: -t e     t**2: -t^2 e
    huber:   -t (sqrt(e + eps) - sqrt(eps))
    ghuber:  -t ((e + eps)^p - eps^p) / p          (p = ghuber_power, eps = 1e-10)

The ratio ``exp(logp - logp_old)`` against the sampling policy's ``logp_old`` (the
same ``x_t``, target and weighting) goes through GRPO's clipped surrogate with
``clip_range`` and ``adv_clip_range``; on-policy the ratio is exactly 1 and the
gradient is the advantage-weighted matching gradient ``-A d logp``. Penalties, both
v-based: ``kl_beta * mean((v - v_ref)^2)`` (reference) and
``ema_kl_beta * mean((v - v_ema)^2)`` (the EMA policy).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..dynamics.base import mean_over_sample
from .decoupled import DecoupledAlgorithm, NoisedBatch
from .grpo import clipped_surrogate
from .kl import v_based_kl

AWM_WEIGHTINGS = ("Uniform", "t", "t**2", "huber", "ghuber")
_EPS = 1e-10


def awm_log_prob(v: Tensor, target: Tensor, sigma: Tensor, weighting: str, ghuber_power: float = 0.25) -> Tensor:
    """(B,) weighted matching log-likelihood; computed in float64, returned float32."""
    err = mean_over_sample((v.double() - target.double()) ** 2)
    t = torch.as_tensor(sigma, device=err.device).double().reshape(-1)
    if weighting == "Uniform":
        out = -err
    elif weighting == "t":
        out = -err * t
    elif weighting == "t**2":
        out = -err * t**2
    elif weighting == "huber":
        out = -(torch.sqrt(err + _EPS) - _EPS**0.5) * t
    elif weighting == "ghuber":
        out = -((err + _EPS) ** ghuber_power - _EPS**ghuber_power) * t / ghuber_power
    else:
        raise ValueError(f"train.awm_weighting: unknown {weighting!r}; valid: {list(AWM_WEIGHTINGS)}")
    return out.float()


class AWM(DecoupledAlgorithm):
    name = "awm"
    uses_sampling_policy = True

    def loss(self, policy, batch: NoisedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        cfg = self.cfg
        x_t, target = batch.x_t, batch.part(batch.target)
        v = batch.part(policy.velocity(x_t, batch.sigma, batch.cond))
        with torch.no_grad():
            v_old = batch.part(policy.sampling_velocity(x_t, batch.sigma, batch.cond))
            old_log_prob = awm_log_prob(v_old, target, batch.sigma, cfg.awm_weighting, cfg.ghuber_power)
        log_prob = awm_log_prob(v, target, batch.sigma, cfg.awm_weighting, cfg.ghuber_power)
        loss, metrics = clipped_surrogate(log_prob - old_log_prob, batch.advantages, cfg.clip_range,
                                          cfg.adv_clip_range)
        metrics.update(policy_loss=loss.detach(), **self.advantage_metrics(batch.advantages))
        if cfg.kl_beta > 0:
            kl = v_based_kl(v, batch.part(policy.reference_velocity(x_t, batch.sigma, batch.cond))).mean()
            loss = loss + cfg.kl_beta * kl
            metrics["kl"] = kl.detach()
        if cfg.ema_kl_beta > 0:
            ema_kl = v_based_kl(v, batch.part(policy.ema_velocity(x_t, batch.sigma, batch.cond))).mean()
            loss = loss + cfg.ema_kl_beta * ema_kl
            metrics["ema_kl"] = ema_kl.detach()
        return loss, metrics
