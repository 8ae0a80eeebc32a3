"""The distillation trainers over the shared loop (``train.trainer_type: dmd2``, ``tdm``): what their rollouts keep, the
micro-batches of each role's phase, and each role's loss. The maths is in this package's other files; the roles
(LoRA adapters beside the generator's, each with its optimizer) are ``trainer/roles.py``'s.

DMD2 (arXiv:2405.14867), as Flow-Factory's ``trainers/distillation/dmd2.py`` (the PeterWangyi/Flow-Factory fork
at 091df9df) trains it. Each epoch the generator samples its few-step ODE rollouts (``num_inference_steps``,
every state kept), then each optimizer step runs two phases over the same chunks:

- ``fake``, ``ttur_fake_updates`` passes: the fake score learns the distribution the generator's loss is taken
  on. At a step ``i`` drawn uniformly in ``[0, K)`` (each pass its own draw, as upstream's ``_fake_replay_loss``)
  the generator's clean prediction ``x0_i = x_i - sigma_i v_theta(x_i, sigma_i)`` from the rollout's state ``x_i``
  (a live forward of the generator's weights at the rollout's guidance, without gradients) is re-noised,
  ``x_t = (1 - s) x0_i + s eps``, ``s ~ U(perturbation_timestep_range)``, and the fake score regresses its
  flow-matching velocity there (``fake_score_loss``), queried without guidance. Only for ``K = 1``, or at the
  last step, is ``x0_i`` the rollout's final sample;
- ``generator``, one pass: at a step ``i`` drawn alike, its live clean prediction ``x0_i`` (with gradients),
  re-noised as above, moves towards the teacher's clean prediction (the base model, adapters off, with CFG at
  ``real_guidance_scale``) and away from the fake score's (``dmd2_generator_loss``).

The rollout's states are the generator's own under the weights of this epoch, which the fake phases do not
change, so ``x0_i`` is what the rollout computed there: each live velocity of the generator at a rollout state,
in either phase, is checked to step onto the next state the rollout stored, within ``replay_rtol`` /
``replay_atol`` (``replay.py``, upstream's replay; no extra transformer call).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from ...config import ConfigError
from ...config.distillation import GENERATOR
from ...seeding import derived_seed
from ...models.conditioning import Conditioning, index_cond
from ..base import Algorithm, RolloutsLike
from .dmd2 import dmd2_generator_loss, sample_boundary_index
from .fake_score import fake_score_loss, sample_perturbation_sigma
from .flow import add_noise, clean_from_velocity
from .replay import check_replay
from .tdm import (conditional_renoise, query_interval, sample_query_sigma, student_prediction, tdm_fake_loss,
                  tdm_generator_loss)


def sample_generators(rollouts: RolloutsLike, idx: Tensor, generator: torch.Generator) -> list[torch.Generator]:
    """One generator per chosen sample, seeded by the loop's (``generator``: seed, epoch, inner epoch, phase, pass;
    no process rank) and the sample's index in the epoch's draw (``Rollouts.sample_ids``; else its index here): a
    sample's training draws are the same whichever process trains it, and in a resumed run."""
    ids = rollouts.sample_ids[idx.to(rollouts.sample_ids.device)] if getattr(rollouts, "sample_ids", None) \
        is not None else idx
    return [torch.Generator().manual_seed(derived_seed(generator.initial_seed(), int(i))) for i in ids.tolist()]


@dataclass
class RoleBatch:
    """One role's micro-batch: each sample's rollout state ``x`` at ``sigma`` (its drawn step), the state the
    rollout stored after it (``x_next`` at ``sigma_next``, the replay), and the fresh noise and noise level at which
    the generator's clean prediction there is re-noised."""

    role: str
    x: Tensor  # (B, *latent)
    sigma: Tensor  # (B,)
    noise: Tensor  # (B, *latent)
    noise_sigma: Tensor  # (B,)
    advantages: Tensor  # (B,) unused: distillation trains on no reward
    cond: Conditioning
    x_next: Tensor  # (B, *latent)
    sigma_next: Tensor  # (B,)
    stored_in: torch.dtype = torch.float32  # the dtype the rollout stored its states in (a micro-batch's are float32)
    parts: int = 1  # per-step batches this one joins (``base.merge_batches``)


class DMD2(Algorithm):
    name = "dmd2"
    coupled = False
    needs_reference = False  # the teacher is the roles' (trainer/roles.py): the base, or a copy of it made at start

    @property
    def phases(self) -> tuple:
        return (("fake", self.cfg.ttur_fake_updates), (GENERATOR, 1))

    @property
    def real_scale(self) -> float:
        """The teacher's guidance (``real_guidance_scale``; none given: the rollouts')."""
        return self.cfg.real_guidance_scale or self.cfg.guidance_scale

    def kept_states(self, num_steps: int, sde_steps: list[int] | None) -> list[int]:
        return list(range(num_steps + 1))  # both roles train at any of the generator's steps, replayed onto the next

    def replayed(self, batch, v: Tensor, what: str) -> Tensor:
        """``v``, the generator's velocity at ``batch.x``, once its step is checked to land on ``batch.x_next``
        (``replay.check_replay``, at ``train.replay_rtol`` / ``replay_atol``)."""
        check_replay(self.dynamics, batch, v, (self.cfg.replay_rtol, self.cfg.replay_atol), what)
        return v

    def micro_steps_per_chunk(self, rollouts: RolloutsLike) -> int:
        """The micro-steps (``gradient_accumulation_steps``' units) one chunk's micro-batch stands for: one drawn
        step of each rollout (``config.distillation.micro_steps_per_sample``)."""
        return 1

    def micro_batches(self, rollouts: RolloutsLike, advantages: Tensor, units: Tensor,
                      generator: torch.Generator, role: str = GENERATOR) -> Iterator[RoleBatch]:
        """Each chosen sample at a step of its rollout drawn uniformly in ``[0, K)``, with the stored state after
        it (the replay) and a fresh noise level and noise, all from the sample's own generator: the fake passes
        and the generator's draw alike, each pass its own (``generator`` is seeded per phase and pass), as
        upstream's fake and generator losses each draw their step."""
        idx = units[:, 0]
        steps = len(rollouts.sigmas) - 1
        draws = sample_generators(rollouts, idx, generator)
        step = torch.tensor([sample_boundary_index(steps, g) for g in draws])
        x = rollouts.latents_at(idx, step.to(rollouts.sigmas.device))
        x_next = rollouts.latents_at(idx, (step + 1).to(rollouts.sigmas.device))
        sigma_range = tuple(self.cfg.perturbation_timestep_range)
        noise_sigma = torch.cat([sample_perturbation_sigma(1, sigma_range, generator=g) for g in draws])
        noise = torch.cat([torch.randn((1, *x.shape[1:]), generator=g, dtype=torch.float32) for g in draws])
        sigmas = rollouts.sigmas.cpu()
        yield RoleBatch(role=role, x=x, sigma=sigmas[step].to(x.device), noise=noise.to(x.device),
                        noise_sigma=noise_sigma.to(x.device), advantages=advantages[idx],
                        cond=index_cond(rollouts.cond, idx), x_next=x_next, sigma_next=sigmas[step + 1].to(x.device),
                        stored_in=x_next.dtype)

    def generated(self, policy, batch: RoleBatch) -> Tensor:
        """The generator's clean prediction ``x0_i = x_i - sigma_i v_theta(x_i, sigma_i)`` at the batch's step, its
        velocity replayed: live with gradients in its own phase, without them (its weights switched in) in the
        fake score's, as upstream's fake loss recomputes it."""
        if batch.role == GENERATOR:
            v = policy.velocity(batch.x, batch.sigma, batch.cond)  # at the rollout's own guidance
        else:
            v = policy.role_velocity(GENERATOR, batch.x, batch.sigma, batch.cond, self.cfg.loss_guidance_scale)
        return clean_from_velocity(batch.x, self.replayed(batch, v, f"dmd2's {batch.role} loss"), batch.sigma)

    def loss(self, policy, batch: RoleBatch) -> tuple[Tensor, dict[str, Tensor]]:
        x0_gen = self.generated(policy, batch)
        x_t = add_noise(x0_gen.detach(), batch.noise, batch.noise_sigma)
        if batch.role == "fake":
            v_fake = policy.velocity(x_t, batch.noise_sigma, batch.cond, guidance_scale=1.0)
            loss = fake_score_loss(v_fake, x0_gen, batch.noise)
            return loss, {"fake_score_loss": loss.detach()}
        x0_real = clean_from_velocity(x_t, policy.reference_velocity(x_t, batch.noise_sigma, batch.cond,
                                                                     guidance_scale=self.real_scale), batch.noise_sigma)
        x0_fake = clean_from_velocity(x_t, policy.role_velocity("fake", x_t, batch.noise_sigma, batch.cond),
                                      batch.noise_sigma)
        loss = dmd2_generator_loss(x0_gen, x0_real, x0_fake)
        gap = (x0_fake - x0_real).float().pow(2).mean()
        return loss, {"dmd_loss": loss.detach(), "fake_real_gap": gap.detach()}


@dataclass
class TransitionBatch:
    """TDM's micro-batch: every transition ``k`` of the chosen samples' rollouts, one row each, transition by
    transition: K parts of B rows (``parts``: upstream's K accumulation units, merged into one call; the loss is
    the mean over rows, so over the parts, and the loop counts K micro-steps): the rollout's state ``x`` at
    ``sigma`` (``sigma_k``), the stage's end ``sigma_next``, the query level ``sigma_t`` and the fresh noise of
    the conditional re-noising."""

    role: str
    x: Tensor  # (R, *latent)
    sigma: Tensor  # (R,)
    sigma_next: Tensor  # (R,)
    sigma_t: Tensor  # (R,)
    fresh: Tensor  # (R, *latent)
    advantages: Tensor  # (R,) unused by TDM
    cond: Conditioning
    x_next: Tensor | None = None  # (R, *latent) the rollout's state after the transition (the replay; TDM-R1's surrogate)
    group: Tensor | None = None  # (R,) long: each row's group id in the epoch (TDM-R1's preference)
    stored_in: torch.dtype = torch.float32  # the dtype the rollout stored its states in
    parts: int = 1


class TDM(DMD2):
    """TDM (arXiv:2503.06674) as Flow-Factory's ``trainers/distillation/tdm.py`` (X-GenGroup 15932582) trains it:
    DMD2's roles and phases, every transition of the student's rollout in each step (``tdm.py``'s docstring
    has the maths). Per transition, from the rollout's state ``x_k``: the student's clean prediction and its
    noise, a query level ``sigma_t`` in the stage (``tdm_query_interval``, ``tdm_query_distribution``), the
    conditional re-noising of the stage's end to ``sigma_t``; the fake score regresses the student's clean
    prediction there (SNR-weighted, importance-corrected), the student is revised by the teacher's minus the
    fake score's clean predictions (squared or pseudo-Huber)."""

    name = "tdm"
    needs_groups = False  # TDM-R1's micro-batches carry each row's next state and group
    source_shift: float | None = None  # the rollouts' static flow shift, for source_uniform's draws (bind_model)

    def bind_model(self, adapter) -> None:
        """``source_uniform`` draws uniformly in the unshifted coordinate of the rollouts' schedule: its static
        flow shift, read from the model (a resolution-dependent one is refused, naming the way out)."""
        if self.cfg.tdm_query_distribution != "source_uniform":
            return
        self.source_shift = adapter.static_flow_shift()
        if self.source_shift is None:
            raise ConfigError(f"train.tdm_query_distribution: source_uniform draws uniformly in the unshifted "
                              f"schedule, and {adapter.model_type}'s scheduler shifts it by resolution "
                              "(use_dynamic_shifting); set scheduler.flow_shift (a static shift), or use "
                              "actual_uniform or conditional_logit_normal")

    def micro_steps_per_chunk(self, rollouts: RolloutsLike) -> int:
        return len(rollouts.sigmas) - 1  # every transition: the batch joins one part per transition

    def micro_batches(self, rollouts: RolloutsLike, advantages: Tensor, units: Tensor,
                      generator: torch.Generator, role: str = GENERATOR) -> Iterator[TransitionBatch]:
        cfg, idx = self.cfg, units.reshape(-1)  # TDM: a unit is one sample; TDM-R1: a whole group
        n, steps = len(idx), len(rollouts.sigmas) - 1
        sigmas = rollouts.sigmas.float().cpu()
        k = torch.arange(steps).repeat_interleave(n)  # transition of each row; samples within a transition
        rows = idx.repeat(steps)
        lower, upper = query_interval(sigmas[k + 1], sigmas[k], cfg.tdm_query_interval, cfg.tdm_query_max_sigma)
        lower, upper = lower.view(steps, n), upper.view(steps, n)
        x = torch.cat([rollouts.latents_at(idx, step) for step in range(steps)])
        # each sample's K query levels and K fresh noises from its own generator; rows transition by transition
        draws = sample_generators(rollouts, idx, generator)
        sigma_t = torch.stack([sample_query_sigma(
            lower[:, i], upper[:, i], cfg.tdm_query_distribution, logit_mean=cfg.tdm_query_logit_mean,
            logit_std=cfg.tdm_query_logit_std, source_shift=self.source_shift, generator=g)
            for i, g in enumerate(draws)], dim=1).reshape(-1)
        fresh = torch.stack([torch.randn((steps, *x.shape[1:]), generator=g, dtype=torch.float32) for g in draws],
                            dim=1).reshape(x.shape)
        device = x.device
        extra = {} if not self.needs_groups else dict(group=rollouts.group_ids[rows.to(rollouts.group_ids.device)].cpu())
        extra["x_next"] = torch.cat([rollouts.latents_at(idx, step + 1) for step in range(steps)])
        extra["stored_in"] = extra["x_next"].dtype
        yield TransitionBatch(role=role, x=x, sigma=sigmas[k].to(device), sigma_next=sigmas[k + 1].to(device),
                              sigma_t=sigma_t.to(device), fresh=fresh.to(device), advantages=advantages[rows],
                              cond=index_cond(rollouts.cond, rows), parts=steps, **extra)

    def loss(self, policy, batch: TransitionBatch) -> tuple[Tensor, dict[str, Tensor]]:
        cfg = self.cfg
        if batch.role == "fake":  # the student's prediction without gradients: it is not the active role
            v = policy.role_velocity(GENERATOR, batch.x, batch.sigma, batch.cond, cfg.loss_guidance_scale)
        else:
            v = policy.velocity(batch.x, batch.sigma, batch.cond)  # at the rollout's own guidance
        x0, noise = student_prediction(batch.x, self.replayed(batch, v, f"{self.name}'s {batch.role} loss"),
                                       batch.sigma)
        x_t, _, importance = conditional_renoise(x0, noise, batch.sigma_next, batch.sigma_t,
                                                 cfg.tdm_importance_clip, fresh=batch.fresh)
        if batch.role == "fake":
            v_fake = policy.velocity(x_t, batch.sigma_t, batch.cond, guidance_scale=1.0)
            loss = tdm_fake_loss(clean_from_velocity(x_t, v_fake, batch.sigma_t), x0, batch.sigma_t, importance,
                                 cfg.tdm_snr_gamma)
            return loss, {"fake_score_loss": loss.detach(), "importance_mean": importance.mean()}
        x0_real = clean_from_velocity(x_t, policy.reference_velocity(x_t, batch.sigma_t, batch.cond,
                                                                     guidance_scale=self.real_scale), batch.sigma_t)
        x0_fake = clean_from_velocity(x_t, policy.role_velocity("fake", x_t, batch.sigma_t, batch.cond),
                                      batch.sigma_t)
        loss = tdm_generator_loss(x0, x0_real, x0_fake, cfg.use_huber, cfg.huber_c)
        gap = (x0_fake - x0_real).float().pow(2).mean()
        return loss, {"tdm_loss": loss.detach(), "fake_real_gap": gap.detach()}
