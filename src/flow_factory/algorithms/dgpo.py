"""Direct Group Preference Optimization (DGPO; Y. Luo et al., arXiv:2510.08425).

A group-level DPO on the forward process. Per sample, the flow-matching error
``e = mean((v - (eps - x0))^2)`` of the policy and ``e_ref`` of the preference reference at
the same ``x_t`` (the frozen starting weights; with ``use_ema_ref`` the fast old-policy EMA
below); per group g of size G (advantages ``A`` clipped to ``adv_clip_range``)

    s_g = dpo_beta / G * sum_{i in g} A_i (e_i - e_ref_i)          (no gradient)
    L   = mean_i  sigmoid(s_g(i)) A_i e_i

whose gradient is that of the group DPO loss ``-log sigmoid(-s_g)`` up to the factor
``dpo_beta / G``: samples with a positive advantage have their error pushed down (their
likelihood up), those with a negative one up, and a group whose preference the policy
already expresses more than the reference (``s_g`` very negative) weighs little.

A group may be spread over micro-batches of several processes, as Flow-Factory's group-distributed
sampler spreads it: one micro-batch of every process together (``num_processes x
per_device_batch_size`` samples, laid out by ``data.process_share``) holds whole groups, every
process trains its share at the same time (``lockstep``), and ``s_g`` adds up each process's
part of the group before the sigmoid. The timesteps are drawn alike on every process, shared
noise per group from its group id, independent noise for the whole global micro-batch of which
each process takes its rows: N processes train on what one process with N times the batch would.

``clip_dsm`` (PPO-style): with the old policy's error ``e_old`` at the same ``x_t``,
``ratio = exp(e_old - e)``; a sample with ``A > 0`` and ``ratio > 1 + clip_range``, or
``A <= 0`` and ``ratio < 1 - clip_range``, contributes no gradient. ``clip_kl`` applies the
same mask to the optional v-based KL ``kl_beta * mean((v - v_ref)^2)``. The old policy is
``ema_ref``, a fast EMA of the trained weights moved after the k-th optimizer step (0-based) as
``w <- d w + (1 - d) theta`` with ``d = min(ema_ref_max_decay, ema_ref_ramp_rate k)`` (the DGPO
authors' schedule, as Flow-Factory keeps it). It exists when ``clip_dsm``, ``clip_kl`` or
``use_ema_ref`` reads it, and once more than ``switch_ema_ref`` optimizer steps are done the
rollout samples with it.

``kl_cfg`` > 1: the frozen reference (the preference's and the KL's) is called with CFG at that
scale, a guided teacher for a policy trained at ``guidance_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterator

import torch
from torch import Tensor

from ..dynamics.base import mean_over_sample
from ..models.conditioning import index_cond
from ..seeding import generator as seeded
from .across_processes import gather, rank_and_world, sum_over_processes
from .base import mean_over_parts
from .decoupled import DecoupledAlgorithm, NoisedBatch, generated_rows, reference_guidance
from .kl import v_based_kl
from .timesteps import draw_training_sigmas

EMA_REF = "ema_ref"


def ema_ref_decay(max_decay: float, ramp_rate: float, step: int) -> float:
    """The fast old-policy EMA's decay after optimizer step ``step`` (0-based)."""
    return min(max_decay, ramp_rate * step)


def dsm_clip_mask(err: Tensor, err_old: Tensor, advantages: Tensor, clip_range: float) -> Tensor:
    """(B,) bool: samples whose likelihood ratio ``exp(e_old - e)`` left the clip range in the
    direction their advantage pushes it."""
    ratio = torch.exp(err_old.detach().float() - err.detach().float())
    return torch.where(advantages > 0, ratio > 1 + clip_range, ratio < 1 - clip_range)


def group_preferences(err: Tensor, err_ref: Tensor, advantages: Tensor, group: Tensor, group_size: int,
                      beta: float, num_groups: int) -> Tensor:
    """(num_groups,) these samples' share of each group's ``s_g`` (no gradient); ``group`` (B,) long in
    [0, num_groups). The shares of a group's parts add up to its ``s_g``."""
    per_sample = advantages.float() * beta * (err.detach().float() - err_ref.detach().float()) / group_size
    return torch.zeros(num_groups, dtype=per_sample.dtype, device=per_sample.device).scatter_add_(
        0, group, per_sample)


def dgpo_loss(err: Tensor, advantages: Tensor, group: Tensor, preferences: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The mean loss over these samples and metrics: ``err`` (B,) the policy's flow-matching errors
    (with grad), ``preferences`` every group's whole ``s_g`` (``group_preferences`` summed over its parts)."""
    margin = preferences.detach()[group]
    weight = torch.sigmoid(margin)
    loss = (weight * advantages.float() * err.float()).mean()
    return loss, {"group_weight": weight.mean(), "group_margin": margin.mean(),
                  "implicit_accuracy": (margin < 0).float().mean()}


@dataclass
class GroupBatch(NoisedBatch):
    group: Tensor | None = None  # (B,) long: each sample's group id in the epoch
    group_size: int = 1


class DGPO(DecoupledAlgorithm):
    name = "dgpo"
    lockstep = True

    def __init__(self, train_cfg, dynamics):
        super().__init__(train_cfg, dynamics)
        cfg = train_cfg
        self.clips = cfg.clip_dsm or (cfg.clip_kl and cfg.kl_beta > 0)
        self.keeps_ema_ref = cfg.clip_dsm or cfg.clip_kl or cfg.use_ema_ref

    @property
    def needs_reference(self) -> bool:
        return self.cfg.kl_beta > 0 or not self.cfg.use_ema_ref

    @property
    def step_snapshots(self) -> dict:
        cfg = self.cfg
        return {EMA_REF: partial(ema_ref_decay, cfg.ema_ref_max_decay, cfg.ema_ref_ramp_rate)} if self.keeps_ema_ref \
            else {}

    def sampling_snapshot(self, optimizer_steps: int) -> str | None:
        switch = self.cfg.switch_ema_ref
        return EMA_REF if self.keeps_ema_ref and switch is not None and optimizer_steps > switch else None

    def training_units(self, group_ids: Tensor, advantages: Tensor) -> Tensor:
        """(M, per_device_batch_size): this process's share of each global micro-batch, in the order it
        sampled them (the layout ``data.process_share`` gives a lockstep algorithm)."""
        n, b = len(group_ids), self.cfg.per_device_batch_size
        if n % b:
            raise ValueError(f"dgpo: {n} samples on this process do not split into micro-batches of "
                             f"train.per_device_batch_size {b}")
        return torch.arange(n).view(-1, b)

    def units_per_chunk(self, batch_size: int) -> int:
        return 1  # a unit is already a whole micro-batch

    def micro_batches(self, rollouts, advantages: Tensor, units: Tensor,
                      generator: torch.Generator) -> Iterator[GroupBatch]:
        idx = units.reshape(-1)
        n = len(idx)
        x0 = rollouts.latents_at(idx, len(rollouts.sigmas) - 1).float()
        cond = index_cond(rollouts.cond, idx)
        group = rollouts.group_ids[idx].cpu()
        rank, world = rank_and_world()
        sigmas = draw_training_sigmas(self.cfg.time_sampling_strategy, self.num_timesteps, rollouts.sigmas.cpu(),
                                      self.cfg.timestep_range, self.cfg.time_shift, generator)
        for sigma in sigmas:
            if self.cfg.use_shared_noise:  # a group's noise from its id: the same on every process
                key = int(torch.randint(1 << 62, (1,), generator=generator))
                noise_of = {g: torch.randn(x0.shape[1:], generator=seeded("dgpo noise", key, g))
                            for g in dict.fromkeys(group.tolist())}
                noise = torch.stack([noise_of[g] for g in group.tolist()])
            else:  # the global micro-batch's noise, of which this process takes its rows
                noise = torch.randn((world * n, *x0.shape[1:]), generator=generator)[rank * n:(rank + 1) * n]
            yield GroupBatch(x0=x0, noise=noise.to(x0.device), sigma=sigma.expand(n).to(x0.device),
                             advantages=advantages[idx], cond=cond, group=group.to(x0.device),
                             group_size=self.cfg.group_size, generated=generated_rows(rollouts, x0))

    def loss(self, policy, batch: GroupBatch) -> tuple[Tensor, dict[str, Tensor]]:
        cfg = self.cfg
        x_t, target = batch.x_t, batch.part(batch.target)
        adv = batch.advantages.float().clamp(-cfg.adv_clip_range, cfg.adv_clip_range)

        def error(v: Tensor) -> Tensor:
            return mean_over_sample((v.float() - target.float()) ** 2)

        v = batch.part(policy.velocity(x_t, batch.sigma, batch.cond))
        err = error(v)
        with torch.no_grad():
            v_ref = (batch.part(policy.reference_velocity(x_t, batch.sigma, batch.cond, **reference_guidance(cfg)))
                     if self.needs_reference else None)
            err_old = (error(batch.part(policy.snapshot_velocity(EMA_REF, x_t, batch.sigma, batch.cond)))
                       if self.clips or cfg.use_ema_ref else None)
        err_pref = err_old if cfg.use_ema_ref else error(v_ref)
        clip = dsm_clip_mask(err, err_old, adv, cfg.clip_range) if self.clips else None
        dsm = torch.where(clip, err.detach(), err) if clip is not None and cfg.clip_dsm else err
        # a group's preference sums its members at one timestep, on every process: one part at a time
        loss, metrics = mean_over_parts(batch, lambda rows: self._group_loss(
            dsm[rows], err_pref[rows], adv[rows], batch.group[rows], batch.group_size))
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

    def _group_loss(self, err: Tensor, err_pref: Tensor, adv: Tensor, group: Tensor, group_size: int):
        """``dgpo_loss`` with each group's preference summed over every process's part of it."""
        rank, _ = rank_and_world()
        n = len(group)
        # one numbering of the global micro-batch's groups, the same on every process
        ids, dense = torch.unique(gather(group), return_inverse=True)
        local = dense[rank * n:(rank + 1) * n]
        shares = group_preferences(err, err_pref, adv, local, group_size, self.cfg.dpo_beta, len(ids))
        return dgpo_loss(err, adv, local, sum_over_processes(shares))
