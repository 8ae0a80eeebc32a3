"""TDM-R1: reinforcing a few-step TDM generator with non-differentiable rewards through a learned
surrogate reward (arXiv:2603.07700), as Flow-Factory's ``trainers/distillation/tdm_r1.py`` does it.

Roles: the generator and the fake score of TDM (``tdm.py``), a trainable *surrogate* (a copy of the
teacher's velocity field) and the frozen *reference* (the teacher). One optimisation step is
``ttur_fake_updates`` fake passes, one surrogate pass, one generator pass, each over the K
transitions of a rollout.

**Surrogate** (a group preference on denoising errors, DGPO's form: ``algorithms/dgpo.py``). The
rollout's stored state after transition k, ``x_{k+1}``, is noised with fresh noise at a query level
``sigma_t`` of that stage (``tdm.sample_query_sigma``); the per-sample flow-matching errors

    e = mean_elems (v_sur(x_t) - (eps - x_{k+1}))^2,    e_ref likewise with the reference

(the surrogate queried without guidance, the reference with ``real_guidance_scale``, as upstream), and
the rollout's endpoint advantages ``A`` (group-normalised rewards, clipped to
``advantage_clip_range``), per group g of size G:

    s_g = beta / G sum_{i in g} A_i (e_i - e_ref_i)                  (no gradient; beta = surrogate_preference_beta)
    L_pref = mean_i sigmoid(s_g(i)) A_i e_i                           (gradient of -log sigmoid(-s_g))
    L_sur = w_k [ L_pref + surrogate_reference_beta mean_i (e_i - e_ref_i)^2 ],

with two stop-gradients on ``e_i`` inside ``L_pref`` (``surrogate_masks``): a PPO trust region against
a slow EMA copy of the surrogate (``ratio = exp(e_slow - e)``; no gradient where ``A > 0`` and
``ratio > 1 + surrogate_clip_range``, or ``A <= 0`` and ``ratio < 1 - surrogate_clip_range``), and a
runaway clip against the reference (no gradient where the sample already moved the way its advantage
asks and ``(e - e_ref)^2 > surrogate_reference_threshold``). The time weight is
``w_k = (k + 2) / K`` for transition k in [0, K) (upstream's ``(boundary_index + 1) / K``;
1 without ``use_time_weighting``). After the step the slow copy moves as
``slow <- d slow + (1 - d) surrogate`` with ``d = min(surrogate_slow_decay_max,
surrogate_slow_decay_min + 0.001 step)``.

**Generator**: at the TDM query point ``x_t`` of transition k (``tdm.conditional_renoise``), with the
student's live clean prediction ``x0``,

    L_gen = L_tdm + tdm_weight L_cfg + (1 - tdm_weight) L_sur_reward,

all three ``tdm.revised_x0_loss`` terms (squared when ``use_huber`` is false, TDM-R1's default):
``L_tdm`` the TDM term (correction ``x0_real - x0_fake``, normaliser ``x0_real``); the guidance reward
``L_cfg`` with correction ``cfg_reward_scale (x0_cond - x0_uncond)`` of the teacher, recovered from
the guided and the conditional query as ``cfg_reward_scale / (s - 1) (x0_real - x0_cond)``
(absent when the teacher is queried without guidance, ``s <= 1``, or ``cfg_reward_scale`` is 0) and
normaliser ``x0_real``; the learned reward ``L_sur_reward`` with correction ``x0_sur - x0_real``
(the surrogate queried with the same guidance as the teacher) and normaliser ``x0_sur``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..dgpo import dgpo_loss, dsm_clip_mask, group_preferences
from .flow import mean_over_sample, velocity_target
from .tdm import revised_x0_loss

__all__ = ["TDMR1Settings", "cfg_reward_correction", "denoising_errors", "runaway_mask", "slow_surrogate_decay", "surrogate_loss",
           "surrogate_masks", "surrogate_reward_correction", "tdm_r1_generator_loss", "time_weight"]


@dataclass(frozen=True)
class TDMR1Settings:
    """TDM-R1's loss knobs under upstream's key names, with its defaults (``train.<key>``)."""

    tdm_weight: float = 0.3
    cfg_reward_scale: float = 3.5
    use_huber: bool = False
    huber_c: float = 1e-3
    surrogate_preference_beta: float = 1.0
    surrogate_reference_beta: float = 1e-3
    surrogate_reference_threshold: float = 0.05
    surrogate_clip_range: float = 1e-3

    def __post_init__(self):
        if not 0.0 < self.tdm_weight < 1.0:
            raise ValueError(f"tdm_weight must be in (0, 1), got {self.tdm_weight}")


def denoising_errors(velocity: Tensor, x_clean: Tensor, noise: Tensor) -> Tensor:
    """(B,) flow-matching errors ``mean_elems (v - (eps - x))^2`` of a velocity read at
    ``(1 - sigma) x + sigma eps`` (the preference's "density values": lower = likelier)."""
    return mean_over_sample((velocity.float() - velocity_target(x_clean.detach(), noise.detach())) ** 2)


def time_weight(transition: int, num_inference_steps: int, use_time_weighting: bool = True) -> float:
    """Upstream's boundary weight ``(boundary_index + 1) / K`` with ``boundary_index = transition + 1``:
    later transitions, nearer the image the reward scored, weigh more."""
    if not use_time_weighting:
        return 1.0
    return (transition + 2) / num_inference_steps


def slow_surrogate_decay(step: int, decay_min: float = 0.001, decay_max: float = 0.3) -> float:
    """The slow surrogate's EMA decay after optimizer step ``step``: ``min(max, min + 0.001 step)``."""
    return min(decay_max, decay_min + 0.001 * step)


def runaway_mask(err: Tensor, err_ref: Tensor, advantages: Tensor, threshold: float = 0.05) -> Tensor:
    """(B,) bool: samples whose error already moved past the reference the way their advantage asks
    (down for ``A > 0``, up otherwise) by more than ``(e - e_ref)^2 > threshold``."""
    e, e_ref = err.detach().float(), err_ref.detach().float()
    improved = torch.where(advantages > 0, e < e_ref, e > e_ref)
    return improved & ((e - e_ref) ** 2 > threshold)


def surrogate_masks(err: Tensor, err_ref: Tensor, err_slow: Tensor | None, advantages: Tensor,
                    clip_range: float = 1e-3, reference_threshold: float = 0.05) -> Tensor:
    """(B,) bool: the samples whose error the preference term stops the gradient of (trust region
    against the slow copy, when given and ``clip_range`` > 0, or the runaway clip)."""
    mask = runaway_mask(err, err_ref, advantages, reference_threshold)
    if err_slow is not None and clip_range > 0:
        mask = mask | dsm_clip_mask(err, err_slow, advantages, clip_range)
    return mask


def surrogate_loss(err: Tensor, err_ref: Tensor, advantages: Tensor, group: Tensor, group_size: int,
                   settings: TDMR1Settings = TDMR1Settings(), err_slow: Tensor | None = None,
                   weight: float = 1.0) -> tuple[Tensor, dict[str, Tensor]]:
    """TDM-R1's surrogate loss (module docstring) for one transition and its metrics. ``err`` (B,) with
    gradient; ``group`` (B,) long ids in [0, num_groups) of whole groups of ``group_size``; ``advantages``
    already clipped; ``err_slow`` the slow copy's errors (no trust region without them); ``weight`` the
    transition's ``time_weight``. The group logits use the unmasked errors, as upstream."""
    advantages = advantages.float()
    num_groups = int(group.max().item()) + 1
    preferences = group_preferences(err, err_ref, advantages, group, group_size, settings.surrogate_preference_beta,
                                    num_groups)
    mask = surrogate_masks(err, err_ref, err_slow, advantages, settings.surrogate_clip_range,
                           settings.surrogate_reference_threshold)
    masked = torch.where(mask, err.detach().float(), err.float())
    pref, metrics = dgpo_loss(masked, advantages, group, preferences)
    penalty = ((err.float() - err_ref.detach().float()) ** 2).mean()
    metrics.update(preference_loss=pref.detach(), reference_penalty=penalty.detach(),
                   clip_fraction=mask.float().mean())
    return weight * (pref + settings.surrogate_reference_beta * penalty), metrics


def cfg_reward_correction(x0_guided: Tensor, x0_conditional: Tensor, guidance_scale: float,
                          cfg_reward_scale: float = 3.5) -> Tensor | None:
    """The guidance reward's correction ``cfg_reward_scale (x0_c - x0_u) = cfg_reward_scale / (s - 1)
    (x0_guided - x0_c)``; None when the teacher is queried without guidance or the scale is 0."""
    if guidance_scale <= 1.0 or cfg_reward_scale == 0.0:
        return None
    return (cfg_reward_scale / (guidance_scale - 1.0)) * (x0_guided.detach().float() - x0_conditional.detach().float())


def surrogate_reward_correction(x0_surrogate: Tensor, x0_real: Tensor) -> Tensor:
    """The learned reward's correction ``x0_sur - x0_real``: what the surrogate learned beyond the teacher."""
    return x0_surrogate.detach().float() - x0_real.detach().float()


def tdm_r1_generator_loss(x0: Tensor, x0_real: Tensor, x0_fake: Tensor, x0_surrogate: Tensor,
                          settings: TDMR1Settings = TDMR1Settings(), x0_conditional: Tensor | None = None,
                          guidance_scale: float = 1.0) -> tuple[Tensor, dict[str, Tensor]]:
    """TDM-R1's generator loss ``L_tdm + tdm_weight L_cfg + (1 - tdm_weight) L_sur_reward`` (module
    docstring) and its terms. ``x0`` with gradient; the others are the score queries' clean predictions
    at the same ``x_t`` (``x0_real`` guided at ``guidance_scale``, ``x0_conditional`` the teacher's
    conditional one, needed only for the guidance reward)."""
    s = settings
    tdm = revised_x0_loss(x0, x0_real.detach().float() - x0_fake.detach().float(), x0_real, s.use_huber, s.huber_c)
    correction = None if x0_conditional is None else cfg_reward_correction(x0_real, x0_conditional, guidance_scale,
                                                                           s.cfg_reward_scale)
    cfg = x0.new_zeros((), dtype=torch.float32) if correction is None else \
        revised_x0_loss(x0, correction, x0_real, s.use_huber, s.huber_c)
    sur = revised_x0_loss(x0, surrogate_reward_correction(x0_surrogate, x0_real), x0_surrogate, s.use_huber,
                          s.huber_c)
    loss = tdm + s.tdm_weight * cfg + (1.0 - s.tdm_weight) * sur
    return loss, {"generator_tdm_loss": tdm.detach(), "generator_guidance_reward_loss": cfg.detach(),
                  "generator_surrogate_reward_loss": sur.detach()}
