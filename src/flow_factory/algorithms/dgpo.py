"""Direct Group Preference Optimization (DGPO; Y. Luo et al., arXiv:2510.08425).

A group-level DPO on the forward process. Per sample, the flow-matching error
``e = mean((v - (eps - x0))^2)`` of the policy and ``e_ref`` of the frozen reference at
the same ``x_t``; per group g of size G (advantages ``A`` clipped to ``adv_clip_range``)

    s_g = dpo_beta / G * sum_{i in g} A_i (e_i - e_ref_i)          (no gradient)
    L   = mean_i  sigmoid(s_g(i)) A_i e_i

whose gradient is that of the group DPO loss ``-log sigmoid(-s_g)`` up to the factor
``dpo_beta / G``: samples with a positive advantage have their error pushed down (their
likelihood up), those with a negative one up, and a group whose preference the policy
already expresses more than the reference (``s_g`` very negative) weighs little.

``clip_dsm`` (PPO-style): with the sampling policy's error ``e_old`` at the same
``x_t``, ``ratio = exp(e_old - e)``; a sample with ``A > 0`` and ``ratio > 1 + clip_range``,
or ``A <= 0`` and ``ratio < 1 - clip_range``, contributes no gradient. ``clip_kl``
applies the same mask to the optional v-based KL ``kl_beta * mean((v - v_ref)^2)``.
The old policy here is the one the rollout sampled with (the weights at rollout time,
or the EMA with ``off_policy``), as Flow-Factory's first DGPO trainer did; its newer one
keeps a separate fast EMA (``ema_ref``) that this version does not have.

``use_shared_noise``: the samples of a group get the same noise (drawn per training
timestep). A training unit is a whole group, so every micro-batch holds complete groups
(``per_device_batch_size`` a multiple of ``group_size``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from ..dynamics.base import mean_over_sample
from .base import mean_over_parts
from .decoupled import DecoupledAlgorithm, NoisedBatch
from .kl import v_based_kl


def group_members(group_ids: Tensor) -> Tensor:
    """(G, k) sample indices: the members of each group, groups in order of first appearance."""
    ids = group_ids.cpu()
    rows = [torch.nonzero(ids == g).flatten() for g in dict.fromkeys(ids.tolist())]
    sizes = {len(r) for r in rows}
    if len(sizes) != 1:
        raise ValueError(f"dgpo needs every group on a process to be whole and of one size, got sizes {sorted(sizes)}")
    return torch.stack(rows)


def dsm_clip_mask(err: Tensor, err_old: Tensor, advantages: Tensor, clip_range: float) -> Tensor:
    """(B,) bool: samples whose likelihood ratio ``exp(e_old - e)`` left the clip range in the
    direction their advantage pushes it."""
    ratio = torch.exp(err_old.detach().float() - err.detach().float())
    return torch.where(advantages > 0, ratio > 1 + clip_range, ratio < 1 - clip_range)


def dgpo_loss(err: Tensor, err_ref: Tensor, advantages: Tensor, group: Tensor, group_size: int,
              beta: float) -> tuple[Tensor, dict[str, Tensor]]:
    """``err`` (B,) the policy's flow-matching errors (with grad), ``err_ref`` the reference's,
    ``group`` (B,) long group index in [0, n_groups). Returns the mean loss and metrics."""
    adv = advantages.float()
    per_sample = adv * beta * (err.detach().float() - err_ref.detach().float()) / group_size
    sums = torch.zeros(int(group.max()) + 1, dtype=per_sample.dtype, device=per_sample.device)
    sums.scatter_add_(0, group, per_sample)
    weight = torch.sigmoid(sums)[group].detach()
    loss = (weight * adv * err.float()).mean()
    metrics = {"group_weight": weight.mean(), "group_margin": sums.mean(),
               "implicit_accuracy": (sums < 0).float().mean()}
    return loss, metrics


@dataclass
class GroupBatch(NoisedBatch):
    group: Tensor | None = None  # (B,) long: each sample's group within the micro-batch
    group_size: int = 1


class DGPO(DecoupledAlgorithm):
    name = "dgpo"
    always_uses_reference = True

    def __init__(self, train_cfg, dynamics):
        super().__init__(train_cfg, dynamics)
        self.noise_shared_within_unit = train_cfg.use_shared_noise
        self.clips = train_cfg.clip_dsm or (train_cfg.clip_kl and train_cfg.kl_beta > 0)
        self.uses_sampling_policy = self.clips

    def training_units(self, group_ids: Tensor, advantages: Tensor) -> Tensor:
        return group_members(group_ids)

    def units_per_chunk(self, batch_size: int) -> int:
        return max(1, batch_size // self.cfg.group_size)

    def micro_batches(self, rollouts, advantages: Tensor, units: Tensor,
                      generator: torch.Generator) -> Iterator[GroupBatch]:
        b, k = units.shape
        group = torch.arange(b).repeat(k)  # samples come column by column: member j of every group
        for batch in super().micro_batches(rollouts, advantages, units, generator):
            yield GroupBatch(**vars(batch), group=group.to(batch.x0.device), group_size=k)

    def loss(self, policy, batch: GroupBatch) -> tuple[Tensor, dict[str, Tensor]]:
        cfg = self.cfg
        x_t, target = batch.x_t, batch.target
        adv = batch.advantages.float().clamp(-cfg.adv_clip_range, cfg.adv_clip_range)
        v = policy.velocity(x_t, batch.sigma, batch.cond)
        err = mean_over_sample((v.float() - target.float()) ** 2)
        with torch.no_grad():
            v_ref = policy.reference_velocity(x_t, batch.sigma, batch.cond)
            err_ref = mean_over_sample((v_ref.float() - target.float()) ** 2)
        clip = None
        if self.clips:
            with torch.no_grad():
                v_old = policy.sampling_velocity(x_t, batch.sigma, batch.cond)
                err_old = mean_over_sample((v_old.float() - target.float()) ** 2)
            clip = dsm_clip_mask(err, err_old, adv, cfg.clip_range)
        dsm = torch.where(clip, err.detach(), err) if clip is not None and cfg.clip_dsm else err
        # a group's margin sums its members at one timestep: one part at a time
        loss, metrics = mean_over_parts(batch, lambda rows: dgpo_loss(
            dsm[rows], err_ref[rows], adv[rows], batch.group[rows], batch.group_size, cfg.dpo_beta))
        metrics.update(policy_loss=loss.detach(), dsm_loss=err.detach().mean(),
                       **self.advantage_metrics(batch.advantages))
        if clip is not None:
            metrics["clip_frac"] = clip.float().mean()
        if cfg.kl_beta > 0:
            kl = v_based_kl(v, v_ref)
            if clip is not None and cfg.clip_kl:
                kl = torch.where(clip, kl.detach(), kl)
            loss = loss + cfg.kl_beta * kl.mean()
            metrics["kl"] = kl.detach().mean()
        return loss, metrics
