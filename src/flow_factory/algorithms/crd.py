"""Centered Reward Distillation (CRD; arXiv:2603.14128).

Fits the policy's implicit reward to the external one, both centered over the batch.
At ``x_t = (1 - sigma) x0 + sigma eps`` with target ``u = eps - x0``, the current velocity
``v`` and the "old" model's ``v_old`` (a slow copy of the trained weights, or the frozen
reference with ``use_old_for_loss: false``), the implicit reward of a sample is

    r = -mean((v - u)^2 / w - (v_old - u)^2 / w_old)

with ``w = max(mean|v - u|, 1e-5)`` and ``w_old`` likewise, taken without gradient
(``adaptive_logp``; without it w = w_old = 1). The external reward is the advantage as an
optimality probability ``q = clip(A, +-c) / (2 c) + 1/2`` (c = ``adv_clip_range``). With
weights ``p`` over the batch (all processes), centering subtracts ``sum p q`` from q and
``sum p r`` (no gradient) from r, and

    mse:  L_p = mean((crd_beta rc - qc)^2)
    bce:  L_p = mean(BCE_with_logits(crd_beta rc, sigmoid(qc)))

``weight_temp < 0``: p uniform and L = L_p. Otherwise the mean of two directions:
``p = softmax(q / T)`` and ``softmax(-q / T)`` (T = ``weight_temp``), or for T = 0 uniform
over the samples with q above (below) 1/2, all samples when none are. The policy loss is
``c L / crd_beta``. KL (v-based, ``kl_beta``): ``mean((v - v_ref)^2)`` per sample, with
``reward_adaptive_kl`` weighted by ``m + q (1 - m)``, ``m = 1e-4 / kl_beta``; ``v_ref`` is the
frozen reference with CFG at ``kl_cfg`` when that is above 1 (a guided teacher), else at the
policy's own guidance.

Two copies of the trained weights (``weight_snapshots``), updated by the trainer after
each epoch as ``w <- d w + (1 - d) theta`` with d a schedule of the optimizer steps so far
(``decay_at``): the old model (``old_model_decay``) and the one the rollout samples with
(``sampling_model_decay``).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config.train import parse_decay
from ..dynamics.base import mean_over_sample
from .across_processes import gather
from .base import mean_over_parts
from .decoupled import DecoupledAlgorithm, NoisedBatch, reference_guidance
from .kl import v_based_kl
from .nft import optimality_probability

CRD_LOSS_TYPES = ("mse", "bce")


def decay_at(schedule: str | int, step: int) -> float:
    """The decay after ``step`` optimizer steps: ``start_value`` before ``start_step``, then rising by
    ``slope`` per step up to ``end_value``."""
    start, v0, slope, end = parse_decay(schedule)
    if step < start:
        return v0
    return min(v0 + (step - start) * slope, end)


def implicit_reward(v: Tensor, v_old: Tensor, target: Tensor, adaptive: bool) -> Tensor:
    """(B,) ``-mean((v - u)^2 / w - (v_old - u)^2 / w_old)``; gradient through ``v`` only."""
    err = (v.float() - target.float()) ** 2
    err_old = (v_old.detach().float() - target.float()) ** 2
    if adaptive:
        with torch.no_grad():
            w = mean_over_sample((v.detach().double() - target.double()).abs()).clamp(min=1e-5)
            w_old = mean_over_sample((v_old.detach().double() - target.double()).abs()).clamp(min=1e-5)
        return -(mean_over_sample(err) / w.float() - mean_over_sample(err_old) / w_old.float())
    return -mean_over_sample(err - err_old)


def _centering_weights(q_all: Tensor, weight_temp: float) -> list[Tensor]:
    n = len(q_all)
    if weight_temp < 0:
        return [torch.full_like(q_all, 1.0 / n)]
    if weight_temp == 0:
        out = []
        for mask in (q_all > 0.5, q_all < 0.5):  # advantage above / below zero
            out.append(mask.float() / mask.sum() if mask.any() else torch.full_like(q_all, 1.0 / n))
        return out
    return [torch.softmax(q_all / weight_temp, 0), torch.softmax(-q_all / weight_temp, 0)]


def crd_policy_loss(r: Tensor, q: Tensor, r_all: Tensor, q_all: Tensor, beta: float, loss_type: str,
                    weight_temp: float) -> Tensor:
    """The unscaled centered loss. ``r`` / ``q`` this process's implicit rewards (with grad) and
    optimality probabilities; ``r_all`` / ``q_all`` those of the whole batch (centering)."""
    r_all, q_all = r_all.detach().float(), q_all.detach().float()
    directions = _centering_weights(q_all, weight_temp)
    total = r.new_zeros(())
    for p in directions:
        rc = r - (p * r_all).sum()
        qc = q - (p * q_all).sum()
        if loss_type == "bce":
            total = total + F.binary_cross_entropy_with_logits(beta * rc, torch.sigmoid(qc))
        elif loss_type == "mse":
            total = total + ((beta * rc - qc) ** 2).mean()
        else:
            raise ValueError(f"train.crd_loss_type: unknown {loss_type!r}; valid: {list(CRD_LOSS_TYPES)}")
    return total / len(directions)


class CRD(DecoupledAlgorithm):
    name = "crd"
    OLD, SAMPLING = "crd_old", "crd_sampling"
    rollout_snapshot = SAMPLING

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_beta > 0 or not self.cfg.use_old_for_loss

    @property
    def weight_snapshots(self) -> dict:
        snaps = {self.SAMPLING: partial(decay_at, self.cfg.sampling_model_decay)}
        if self.cfg.use_old_for_loss:
            snaps[self.OLD] = partial(decay_at, self.cfg.old_model_decay)
        return snaps

    def loss(self, policy, batch: NoisedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        cfg = self.cfg
        x_t, target = batch.x_t, batch.part(batch.target)
        v = batch.part(policy.velocity(x_t, batch.sigma, batch.cond))
        with torch.no_grad():
            v_old = batch.part(policy.snapshot_velocity(self.OLD, x_t, batch.sigma, batch.cond) if cfg.use_old_for_loss
                               else policy.reference_velocity(x_t, batch.sigma, batch.cond))
        r = implicit_reward(v, v_old, target, cfg.adaptive_logp)
        q = optimality_probability(batch.advantages, cfg.adv_clip_range)
        # centred over one timestep's batch (on every process): one part at a time
        raw, _ = mean_over_parts(batch, lambda rows: (crd_policy_loss(
            r[rows], q[rows], gather(r[rows]), gather(q[rows]), cfg.crd_beta, cfg.crd_loss_type, cfg.weight_temp), {}))
        loss = raw * cfg.adv_clip_range / cfg.crd_beta
        metrics = {"policy_loss": loss.detach(), "unweighted_policy_loss": raw.detach(),
                   "r_theta_mean": r.detach().mean(), "old_deviation": mean_over_sample(
                       (v.detach().float() - v_old.float()) ** 2).mean(), **self.advantage_metrics(batch.advantages)}
        if cfg.kl_beta > 0:
            with torch.no_grad():
                v_ref = batch.part(policy.reference_velocity(x_t, batch.sigma, batch.cond, **reference_guidance(cfg)))
            kl = v_based_kl(v, v_ref)
            if cfg.reward_adaptive_kl:
                m = 1e-4 / cfg.kl_beta
                kl_loss = cfg.kl_beta * ((m + q * (1 - m)) * kl).mean()
            else:
                kl_loss = cfg.kl_beta * kl.mean()
            loss = loss + kl_loss
            metrics.update(kl=kl.detach().mean(), kl_loss=kl_loss.detach())
        return loss, metrics
