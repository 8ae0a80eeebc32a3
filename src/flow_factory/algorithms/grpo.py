"""GRPO for flow matching (Flow-GRPO, arXiv:2505.05470; DanceGRPO, arXiv:2505.07818).

Each trained denoising step is one Gaussian action of the sampler's SDE. With the
log-prob of the recorded next latent under the current weights, ``logp``, and the
one the rollout recorded, ``logp_old``:

    r = exp(logp - logp_old),   A <- clip(A, -adv_clip_range, adv_clip_range),
    L = mean_b max(-A r, -A clip(r, 1 - clip_range, 1 + clip_range)),

plus ``kl_beta * KL`` against the reference policy (``kl.py``). The log-probs are
means over the latent's dimensions, so the ratio is very close to 1 and clip ranges
are small (flow_grpo uses 1e-4).

With an SDE window (Flow-GRPO-Fast) the steps outside it are never trained, yet they
share the weights the window moves, and they drift with them. ``outside_kl_beta``
adds the v-based KL ``mean((v - v_ref)^2)`` at one such step per sample, on the
rollout's own latent there, so the window changes what its steps decide and the rest
of the trajectory stays the reference's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Algorithm, Policy, TrainBatch
from .kl import v_based_kl, x_based_kl


def clipped_surrogate(
    log_ratio: Tensor, advantages: Tensor, clip_range: float, adv_clip_range: float,
    weight: Tensor | float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's pessimistic clipped objective on a (B,) log importance ratio, each sample's term
    times ``weight`` (a number, or one per sample).

    Metrics: ratio mean/min/max and ``clip_frac``, the fraction of samples whose
    clipped term is the larger (active) one and differs from the unclipped term,
    i.e. the samples that give no gradient.
    """
    if log_ratio.shape != advantages.shape:
        # a (B, 1) advantage against a (B,) ratio would broadcast to (B, B) silently
        raise ValueError(
            f"advantages shape {tuple(advantages.shape)} does not match the log-ratio's {tuple(log_ratio.shape)}"
        )
    adv = advantages.to(log_ratio.dtype).clamp(-adv_clip_range, adv_clip_range)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    loss = (weight * torch.maximum(unclipped, clipped)).mean()
    r = ratio.detach()
    metrics = {
        "ratio_mean": r.mean(),
        "ratio_min": r.min(),
        "ratio_max": r.max(),
        "clip_frac": (clipped.detach() > unclipped.detach()).float().mean(),
    }
    return loss, metrics


class GRPO(Algorithm):
    """Flow-GRPO's loss for one micro-batch at one SDE step.

    Reads ``clip_range``, ``adv_clip_range``, ``kl_type`` and ``kl_beta`` from the
    training config. Subclasses change the importance ratio (``log_ratio``) or the
    weight of a step's policy loss (``policy_loss_weight``).
    """

    name = "grpo"

    def __init__(self, train_cfg, dynamics):
        super().__init__(train_cfg, dynamics)
        if not dynamics.stochastic:
            raise ValueError(
                f"{self.name} trains the log-probs of stochastic steps, but dynamics "
                f"{dynamics.name!r} is deterministic; set scheduler.dynamics_type to an SDE "
                "(Flow-SDE, Dance-SDE or CPS)"
            )

    # --- what subclasses change ------------------------------------------------
    def log_ratio(self, log_prob: Tensor, mean: Tensor, std: Tensor, batch: TrainBatch) -> Tensor:
        """(B,) log importance ratio of the recorded step under the current weights."""
        return log_prob - batch.old_log_prob.to(log_prob.dtype)

    def policy_loss_weight(self, sigma: Tensor, sigma_next: Tensor) -> Tensor | float:
        """Weight of a step's policy loss relative to the other steps' ((B,) sigmas: one per row)."""
        return 1.0

    def reference_guidance(self) -> dict:
        """``policy.reference_velocity``'s keywords for the KL's reference: the policy's own guidance."""
        return {}

    def policy_loss(self, log_ratio: Tensor, batch: TrainBatch, v: Tensor, mean: Tensor,
                    std: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The surrogate of the (B,) ``log_ratio``: PPO's clipped one (``clipped_surrogate``)."""
        return clipped_surrogate(log_ratio, batch.advantages, self.cfg.clip_range, self.cfg.adv_clip_range,
                                 weight=self.policy_loss_weight(batch.sigma, batch.sigma_next))

    # --- the loss ----------------------------------------------------------------
    def loss(self, policy: Policy, batch: TrainBatch) -> tuple[Tensor, dict[str, Tensor]]:
        x, sigma, sigma_next = batch.x, batch.sigma, batch.sigma_next

        # the same velocity() and mean_and_std() the rollout used: on-policy r == 1
        v = policy.velocity(x, sigma, batch.cond)
        mean, std = self.dynamics.mean_and_std(x, v, sigma, sigma_next)
        log_prob = self.dynamics.log_prob(batch.x_next, mean, std)

        policy_loss, metrics = self.policy_loss(self.log_ratio(log_prob, mean, std, batch), batch, v, mean, std)
        loss = policy_loss

        adv = batch.advantages.detach().float()
        metrics.update(
            policy_loss=policy_loss.detach(),
            advantage_mean=adv.mean(),
            advantage_min=adv.min(),
            advantage_max=adv.max(),
        )
        if self.cfg.kl_beta > 0:
            kl = self.kl_to_reference(policy, batch, v, mean, std)
            loss = loss + self.cfg.kl_beta * kl
            metrics["kl"] = kl.detach()
        if batch.outside_x is not None:
            outside_kl = self.kl_outside_window(policy, batch)
            loss = loss + self.cfg.outside_kl_beta * outside_kl
            metrics["outside_kl"] = outside_kl.detach()
        return loss, metrics

    def kl_outside_window(self, policy: Policy, batch: TrainBatch) -> Tensor:
        """Batch-mean v-based KL to the reference at each sample's step outside the window."""
        x, sigma = batch.outside_x, batch.outside_sigma
        with torch.no_grad():
            v_ref = policy.reference_velocity(x, sigma, batch.cond)
        return v_based_kl(policy.velocity(x, sigma, batch.cond), v_ref).mean()

    def kl_to_reference(self, policy: Policy, batch: TrainBatch, v: Tensor, mean: Tensor, std: Tensor) -> Tensor:
        """Batch-mean KL to the reference; gradients flow through the policy's side only."""
        x, sigma, sigma_next = batch.x, batch.sigma, batch.sigma_next
        with torch.no_grad():
            v_ref = policy.reference_velocity(x, sigma, batch.cond, **self.reference_guidance())
        if self.cfg.kl_type == "v-based":
            return v_based_kl(v, v_ref).mean()
        mean, std = self.stochastic_part(mean, std, batch, "kl_type")
        with torch.no_grad():
            mean_ref = self.dynamics.stochastic_part(self.dynamics.mean_and_std(x, v_ref, sigma, sigma_next)[0])
        return x_based_kl(mean, mean_ref, std).mean()

    def stochastic_part(self, mean: Tensor, std: Tensor, batch: TrainBatch, key: str) -> tuple[Tensor, Tensor]:
        """The step's mean and std over the elements its noise reaches (all, but LTX-2's video alone), for an
        x-based KL, which divides by the std: 0 there is an error naming ``train.<key>``."""
        part = self.dynamics.stochastic_part
        mean, std = part(mean), part(torch.as_tensor(std))
        n = len(mean)
        zero = ~(std > 0).reshape(n, -1).all(dim=1) if std.ndim else (~(std > 0)).expand(n)
        if bool(zero.any()):
            i = int(batch.step[zero.nonzero()[0, 0]])
            raise ValueError(
                f"x-based KL divides by the step's std, which is 0 at step {i} (sigma_next = "
                f"{float(batch.sigma_next[zero][0]):g}) under {self.dynamics.name}; use train.{key}: v-based, "
                "or leave that step out of scheduler.sde_steps"
            )
        return mean, std
