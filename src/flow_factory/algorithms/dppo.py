"""Flow-DPPO: GRPO with a trust region on the step's KL instead of the ratio clip.

Reference: Flow-DPPO (Divergence Proximal Policy Optimization, arXiv:2606.11025; Flow-Factory's
trainer ``dppo``). The single-sample ratio ``r = exp(logp - logp_old)`` is a noisy estimate of how far
the policy moved, so clipping it constrains some steps too much and others too little. A trained step
is Gaussian, so the divergence of the step under the current weights from the step the rollout took
is exact and cheap (per dimension, like the log-probs):

    x-based:  KL = mean((mu - mu_old)^2) / (2 s^2)     (s the step's scale, as in kl.py; where s is 0,
                                                         CPS's last step, 0 if the means agree, else inf)
    v-based:  KL = mean((v - v_old)^2)

The loss is the unclipped surrogate, a sample's term dropped (no gradient) when it is outside the
trust region and pushes further out:

    A <- clip(A, -adv_clip_range, adv_clip_range),
    drop = (KL >= kl_mask_threshold) & ((r > 1 & A > 0) | (r < 1 & A < 0)),
    L = mean_b(-A r [not drop]),

plus ``kl_beta * KL`` to the reference as in GRPO (its reference called at ``kl_guidance_scale`` when
set). A step that pulls back toward the rollout's policy is always kept. On-policy ``r == 1`` and
``KL == 0``: nothing is dropped.

The rollout records each step's mean in float32 (``records_step_means``). The v-based distance needs
the rollout's velocity: a step's mean is affine in the velocity, ``mu = a + b v`` with ``b`` the same
for the old and the current weights (same latent, same sigmas), so ``v - v_old = (mu - mu_old) / b``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..dynamics.base import mean_over_sample
from .base import TrainBatch
from .grpo import GRPO


def step_kl(mean: Tensor, old_mean: Tensor, std: Tensor) -> Tensor:
    """(B,) ``mean((mu - mu_old)^2 / (2 s^2))``; where ``s`` is 0 (CPS's last step is deterministic) its
    limit: 0 where the means agree, infinite where they differ (any move leaves the region)."""
    squared = (mean.float() - old_mean.float()) ** 2
    std = torch.as_tensor(std, dtype=torch.float32, device=mean.device).expand_as(squared)
    return mean_over_sample(torch.where(squared == 0, 0.0, squared / (2 * std**2)))


def trust_region_loss(log_ratio: Tensor, advantages: Tensor, kl: Tensor, threshold: float,
                      adv_clip_range: float) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO's masked surrogate on (B,) log-ratios, advantages and KL(current || old)."""
    if log_ratio.shape != advantages.shape or kl.shape != log_ratio.shape:
        raise ValueError(f"log-ratio {tuple(log_ratio.shape)}, advantages {tuple(advantages.shape)} and KL "
                         f"{tuple(kl.shape)} must be one value per sample")
    adv = advantages.to(log_ratio.dtype).clamp(-adv_clip_range, adv_clip_range)
    ratio = torch.exp(log_ratio)
    r = ratio.detach()
    outward = ((r > 1) & (adv > 0)) | ((r < 1) & (adv < 0))
    keep = ~((kl.detach() >= threshold) & outward)
    loss = (-adv * ratio * keep.to(ratio.dtype)).mean()
    finite = kl.detach().float()[torch.isfinite(kl)]  # a deterministic step's infinite KL counts as masked only
    metrics = {"ratio_mean": r.mean(), "ratio_min": r.min(), "ratio_max": r.max(),
               "kl_to_rollout": finite.mean() if len(finite) else kl.new_zeros(()),
               "masked_frac": (~keep).float().mean()}
    return loss, metrics


class DPPO(GRPO):
    """Reads ``kl_mask_type``, ``kl_mask_threshold`` and ``kl_guidance_scale`` besides GRPO's keys
    (not ``clip_range``)."""

    name = "dppo"
    records_step_means = True

    def policy_loss(self, log_ratio: Tensor, batch: TrainBatch, v: Tensor, mean: Tensor,
                    std: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        if batch.old_mean is None:
            raise ValueError("dppo needs the rollout's step means (TrainBatch.old_mean); the rollout records "
                             "them for algorithms with records_step_means = True")
        kl = self.kl_to_rollout(batch, v, mean, std)
        return trust_region_loss(log_ratio, batch.advantages, kl, self.cfg.kl_mask_threshold,
                                 self.cfg.adv_clip_range)

    def kl_to_rollout(self, batch: TrainBatch, v: Tensor, mean: Tensor, std: Tensor) -> Tensor:
        """(B,) KL(current || rollout) of the step in ``kl_mask_type``'s space; no gradient (it only masks)."""
        with torch.no_grad():
            old_mean = batch.old_mean.to(mean.dtype)
            if self.cfg.kl_mask_type == "x-based":
                part = self.dynamics.stochastic_part
                return step_kl(part(mean), part(old_mean), part(torch.as_tensor(std, device=mean.device)))
            # b = d mu / d v, elementwise: the mean's change for a velocity one higher
            x, v = batch.x.float(), v.float()
            slope = (self.dynamics.mean_and_std(x, v + 1, batch.sigma, batch.sigma_next)[0]
                     - self.dynamics.mean_and_std(x, v, batch.sigma, batch.sigma_next)[0])
            return mean_over_sample(((mean.float() - old_mean.float()) / slope.float()) ** 2)

    def reference_guidance(self) -> dict:
        scale = self.cfg.kl_guidance_scale
        return {} if scale is None else {"guidance_scale": scale}
