"""``train.trainer_type: tdm-r1`` (arXiv:2603.07700) over the shared loop, as Flow-Factory's
``trainers/distillation/tdm_r1.py`` (X-GenGroup 15932582; hyperparameters d68609c2) trains it: TDM's generator
and fake score (``trainers.TDM``) with a third trainable role, the *surrogate*, that learns the rewards, and the
frozen teacher as the reference. The maths is ``tdm_r1.py``'s; this file lays it over the roles and phases.

One optimizer step: ``ttur_fake_updates`` fake passes (TDM's), one surrogate pass, one generator pass, each over
every transition of the chunk's rollouts. A micro-batch holds whole groups (a unit is a group; the preference
compares a group's members), so ``per_device_batch_size`` is a multiple of ``group_size``.

- surrogate: the rollout's state after transition k, ``x_{k+1}``, noised with fresh noise at the transition's
  query level; its denoising error and the teacher's (guided at ``real_guidance_scale``) and the slow copy's
  (``trainer/roles.py`` keeps it, moved after each surrogate step) give DGPO's group preference with the trust
  region and the runaway clip (``surrogate_loss``), at the time weight of the transition; the transitions'
  losses averaged.
- generator: TDM's query point; the TDM term, the guidance reward and the surrogate's learned reward
  (``tdm_r1_generator_loss``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...config.distillation import GENERATOR
from ..base import mean_over_parts
from .flow import add_noise, clean_from_velocity
from .tdm import conditional_renoise, student_prediction
from .tdm_r1 import TDMR1Settings, denoising_errors, surrogate_loss, tdm_r1_generator_loss, time_weight
from .trainers import TDM, TransitionBatch


class TDMR1(TDM):
    name = "tdm-r1"
    needs_groups = True

    def __init__(self, train_cfg, dynamics):
        super().__init__(train_cfg, dynamics)
        c = train_cfg
        self.settings = TDMR1Settings(c.tdm_weight, c.cfg_reward_scale, c.use_huber, c.huber_c,
                                      c.surrogate_preference_beta, c.surrogate_reference_beta,
                                      c.surrogate_reference_threshold, c.surrogate_clip_range)

    @property
    def phases(self) -> tuple:
        return (("fake", self.cfg.ttur_fake_updates), ("surrogate", 1), (GENERATOR, 1))

    def training_units(self, group_ids: Tensor, advantages: Tensor) -> Tensor:
        """(groups, group_size): each group's samples, groups in the order they were sampled."""
        ids = group_ids.cpu()
        first = {int(g): i for i, g in reversed(list(enumerate(ids.tolist())))}
        return torch.stack([torch.nonzero(ids == g).reshape(-1) for g in sorted(first, key=first.get)])

    def units_per_chunk(self, batch_size: int) -> int:
        return max(1, batch_size // self.cfg.group_size)

    def loss(self, policy, batch: TransitionBatch) -> tuple[Tensor, dict[str, Tensor]]:
        if batch.role == "fake":
            return super().loss(policy, batch)
        if batch.role == "surrogate":
            return self._surrogate_loss(policy, batch)
        v = self.replayed(batch, policy.velocity(batch.x, batch.sigma, batch.cond), "tdm-r1's generator loss")
        x0, noise = student_prediction(batch.x, v, batch.sigma)  # v: at the rollout's own guidance
        x_t, _, _ = conditional_renoise(x0, noise, batch.sigma_next, batch.sigma_t, self.cfg.tdm_importance_clip,
                                        fresh=batch.fresh)
        s_t, cond, scale = batch.sigma_t, batch.cond, self.real_scale
        x0_of = lambda v: clean_from_velocity(x_t, v, s_t)  # noqa: E731
        x0_real = x0_of(policy.reference_velocity(x_t, s_t, cond, guidance_scale=scale))
        x0_fake = x0_of(policy.role_velocity("fake", x_t, s_t, cond))
        x0_surrogate = x0_of(policy.role_velocity("surrogate", x_t, s_t, cond, scale))
        guided = scale > 1 and self.settings.cfg_reward_scale > 0
        x0_conditional = x0_of(policy.reference_velocity(x_t, s_t, cond, guidance_scale=1.0)) if guided else None
        loss, metrics = tdm_r1_generator_loss(x0, x0_real, x0_fake, x0_surrogate, self.settings, x0_conditional,
                                              scale)
        return loss, metrics

    def _surrogate_loss(self, policy, batch: TransitionBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """The surrogate's denoising errors for every row in one call each, then the loss transition by
        transition (each a part of the batch: its groups compared within it), averaged (``mean_over_parts``)."""
        x, noise, s_t, cond = batch.x_next.float(), batch.fresh, batch.sigma_t, batch.cond
        x_t = add_noise(x, noise, s_t)
        err = denoising_errors(policy.velocity(x_t, s_t, cond, guidance_scale=1.0), x, noise)
        err_ref = denoising_errors(policy.reference_velocity(x_t, s_t, cond, guidance_scale=self.real_scale), x, noise)
        err_slow = None
        if self.settings.surrogate_clip_range > 0:
            err_slow = denoising_errors(policy.slow_velocity("surrogate", x_t, s_t, cond), x, noise)
        clip = self.cfg.adv_clip_range
        advantages = batch.advantages.float().clamp(-clip, clip).to(err.device)
        steps = self.cfg.num_inference_steps
        rows_per_part = len(err) // batch.parts

        def part_loss(r: slice):  # one transition of one chunk (parts: each chunk's K transitions in turn)
            k = (r.start // rows_per_part) % steps
            group = torch.unique(batch.group[r], return_inverse=True)[1].to(err.device)
            return surrogate_loss(err[r], err_ref[r], advantages[r], group, self.cfg.group_size, self.settings,
                                  None if err_slow is None else err_slow[r],
                                  time_weight(k, steps, self.cfg.use_time_weighting))

        loss, metrics = mean_over_parts(batch, part_loss)
        return loss, {"surrogate_loss": loss.detach(), **metrics}
