"""DiffusionNFT: online RL on the forward process (K. Zheng et al., arXiv:2509.16117).

With the current velocity ``v`` and the sampling ("old") policy's ``v_old`` at the
same ``x_t``, NFT defines two implicit policies

    v+ = beta v + (1 - beta) v_old,        v- = (1 + beta) v_old - beta v,

and fits v+ to the good samples and v- to the bad ones. The advantage becomes an
optimality probability ``r = clip(A, +-c) / (2 c) + 1/2`` in [0, 1] (c =
``adv_clip_range``), and per sample

    L = c (r L(v+) + (1 - r) L(v-)) / beta,

where ``L(u)`` is a flow-matching error of the velocity ``u``. The factor ``c`` is the
reference implementation's: its learning rates carry over. Two errors are available:

- ``adaptive`` (the reference implementation's default): in x0 space,
  ``mean((x0_u - x0)^2) / w`` with ``x0_u = x_t - sigma u`` and the weight
  ``w = max(mean|x0_u - x0|, 1e-5)`` taken without gradient, so each sample's loss is
  normalised by its own error scale (roughly an L1 loss of constant scale);
- ``uniform``: the plain velocity error ``mean((u - (eps - x0))^2)``.

The old policy is the one the rollout sampled with: the EMA weights when
``off_policy: true``, otherwise the weights at rollout time (the trainer keeps a copy).
On-policy before any update, v = v_old and both implicit policies equal v.
Optional ``kl_beta``: ``mean((v - v_ref)^2)`` against the reference (v-based).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..dynamics.base import as_batch_column, mean_over_sample
from .decoupled import DecoupledAlgorithm, NoisedBatch
from .kl import v_based_kl

NFT_WEIGHTINGS = ("adaptive", "uniform")


def optimality_probability(advantages: Tensor, adv_clip_range: float) -> Tensor:
    """NFT's r: the clipped advantage mapped linearly from [-c, c] onto [0, 1]."""
    adv = advantages.float().clamp(-adv_clip_range, adv_clip_range)
    return (adv / adv_clip_range / 2 + 0.5).clamp(0, 1)


def flow_error(u: Tensor, x0: Tensor, noise: Tensor, sigma: Tensor, weighting: str) -> Tensor:
    """(B,) error of velocity ``u`` at ``x_t = (1 - sigma) x0 + sigma noise``."""
    u, x0, noise = u.float(), x0.float(), noise.float()
    if weighting == "uniform":
        return mean_over_sample((u - (noise - x0)) ** 2)
    if weighting != "adaptive":
        raise ValueError(f"train.nft_weighting: unknown {weighting!r}; valid: {list(NFT_WEIGHTINGS)}")
    s = as_batch_column(sigma, x0)
    x_t = (1 - s) * x0 + s * noise
    x0_u = x_t - s * u
    with torch.no_grad():
        w = mean_over_sample((x0_u - x0).abs()).clamp(min=1e-5)
    return mean_over_sample((x0_u - x0) ** 2) / w


def nft_loss(v: Tensor, v_old: Tensor, batch: NoisedBatch, beta: float, adv_clip_range: float,
             weighting: str = "adaptive") -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar NFT policy loss (batch mean) and detached metrics; ``batch`` gives x0, the noise, sigma and the
    advantages (its ``cond`` is not read); ``v`` and ``v_old`` are ``batch.part`` of the velocities."""
    x0, noise, sigma, advantages = batch.part(batch.x0), batch.part(batch.noise), batch.sigma, batch.advantages
    v_old = v_old.detach().float()
    v_pos = beta * v.float() + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v.float()
    pos = flow_error(v_pos, x0, noise, sigma, weighting)
    neg = flow_error(v_neg, x0, noise, sigma, weighting)
    r = optimality_probability(advantages, adv_clip_range)
    per_sample = adv_clip_range * (r * pos + (1 - r) * neg) / beta
    metrics = {"positive_loss": pos.detach().mean(), "negative_loss": neg.detach().mean(),
               "r_mean": r.mean(), "old_deviation": mean_over_sample((v.detach().float() - v_old) ** 2).mean()}
    return per_sample.mean(), metrics


class NFT(DecoupledAlgorithm):
    name = "nft"
    uses_sampling_policy = True

    def loss(self, policy, batch: NoisedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        x_t = batch.x_t
        v = batch.part(policy.velocity(x_t, batch.sigma, batch.cond))
        v_old = batch.part(policy.sampling_velocity(x_t, batch.sigma, batch.cond))
        loss, metrics = nft_loss(v, v_old, batch, self.cfg.nft_beta, self.cfg.adv_clip_range, self.cfg.nft_weighting)
        metrics.update(policy_loss=loss.detach(), **self.advantage_metrics(batch.advantages))
        if self.cfg.kl_beta > 0:
            kl = v_based_kl(v, batch.part(policy.reference_velocity(x_t, batch.sigma, batch.cond))).mean()
            loss = loss + self.cfg.kl_beta * kl
            metrics["kl"] = kl.detach()
        return loss, metrics
