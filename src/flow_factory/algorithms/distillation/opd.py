"""DiffusionOPD (arXiv:2605.15055): on-policy distillation of several teachers into one student
(``train.trainer_type: diffusion-opd``), as Flow-Factory's ``trainers/distillation/opd/trainer.py`` and
``opd/common.py`` compute it (the PeterWangyi/Flow-Factory fork at 091df9df205467bb9490e0b4ef0b3bcc420a2ebd, and
Jayce-Ping/Flow-Factory-Draft's ``common.py``; their keys ``hparams/training_args/opd.py`` at 091df9df).

Each teacher is a LoRA on the base model, frozen, serving the datasets its ``applicable_datasets`` names
(``trainer/roles.py`` loads them beside the student's adapter). Each epoch the student samples its own rollouts
(no gradient); at every distilled step ``j`` of a sample's trajectory, the student (with gradient, at the rollout's
guidance) and the teacher of the sample's dataset (at its own ``guidance_scale``) read the same state ``x_j``, and
each prediction is taken to the target space ``train.loss_target``:

    xt:  the step's mean  mu(x_j, v)  under the run's dynamics      (ODE: x_j + (sigma_{j+1} - sigma_j) v)
    v:   the velocity  v
    x0:  the clean state it points at  x_j - sigma_j v

Per sample, with ``e = p_student - p_teacher`` over the sample's elements,

    D_j = mean(e^2)  [ / (mean|e| + 1e-8), mean|e| without gradient: self_normalize ]  [ / max(s_j^2, 1e-8) ]

where the last factor is the step's transition variance (``s_j`` the dynamics' scale at ``j``), only under a
stochastic dynamics and ``xt``; ``v`` and ``x0`` need ODE rollouts. A micro-batch's loss is the mean of ``D_j`` over
its rows, one micro-batch per distilled step (upstream's one backward per step), so the gradient descends
``e``: the student moves towards its own teacher. Upstream's docstrings write a factor 1/2 that its code does not
apply; the code is followed. The distilled steps are ``[int(T lo), max(lo + 1, int(T hi)))`` of the ``T`` rollout
steps, ``timestep_range`` ``f`` meaning ``(0, f)`` (upstream's default 0.99: all but the last of 10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from ...config.distillation import GENERATOR, LOSS_TARGETS, distilled_steps
from ...dynamics.partial import PartlyStochastic
from ...models.conditioning import Conditioning, index_cond
from ..base import Algorithm, RolloutsLike
from .flow import clean_from_velocity, mean_over_sample

VARIANCE_FLOOR = 1e-8  # upstream's clamp of the transition variance
NORMALISER_EPS = 1e-8  # upstream's floor of self-normalisation


def opd_target(loss_target: str, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, dynamics) -> Tensor:
    """A prediction ``v`` at ``(x, sigma)`` in the target space (float32; see the module's docstring)."""
    if loss_target == "v":
        return v.float()
    if loss_target == "x0":
        return clean_from_velocity(x, v, sigma)
    if loss_target == "xt":
        return dynamics.mean_and_std(x, v, sigma, sigma_next)[0].float()
    raise ValueError(f"train.loss_target: one of {list(LOSS_TARGETS)}, got {loss_target!r}")


def opd_sample_loss(student: Tensor, teacher: Tensor, self_normalize: bool = False,
                    variance: Tensor | None = None) -> Tensor:
    """(B,) per-sample ``D_j`` of the student's target (with gradient) against the teacher's; ``variance``: the
    step's transition variance (broadcast to the samples' shape), floored at ``VARIANCE_FLOOR``."""
    error = student.float() - teacher.detach().float()
    squared = error.square()
    if variance is not None:
        squared = squared / variance.float().clamp_min(VARIANCE_FLOOR).expand_as(squared)
    loss = mean_over_sample(squared)
    if self_normalize:
        loss = loss / (mean_over_sample(error.abs()).detach() + NORMALISER_EPS)
    return loss


@dataclass
class OPDBatch:
    """One distilled step of the chosen samples: their rollout state ``x`` at ``sigma``, the step's end
    ``sigma_next``, and each row's teacher (by position in ``train.teachers``)."""

    x: Tensor  # (B, *latent)
    sigma: Tensor  # (B,)
    sigma_next: Tensor  # (B,)
    teacher: Tensor  # (B,) long
    advantages: Tensor  # (B,) unused: the loss reads no reward
    cond: Conditioning
    parts: int = 1


class DiffusionOPD(Algorithm):
    name = "diffusion-opd"
    coupled = False
    needs_reference = False  # the teachers are the roles' (trainer/roles.py): LoRA adapters on the base
    phases = ((GENERATOR, 1),)

    def __init__(self, train_cfg, dynamics):
        super().__init__(train_cfg, dynamics)
        if isinstance(dynamics, PartlyStochastic) and dynamics.stochastic and train_cfg.loss_target == "xt":
            raise ValueError("scheduler.dynamics_type: diffusion-opd divides a step's error by one transition "
                             "variance, and this model keeps part of its latent (its audio) on the ODE; use ODE")
        self.teachers = list(train_cfg.teachers)
        self.routes = {dataset: k for k, t in enumerate(self.teachers) for dataset in t.applicable_datasets}

    def steps(self, num_steps: int) -> range:
        return distilled_steps(num_steps, self.cfg.timestep_range)

    def kept_states(self, num_steps: int, sde_steps: list[int] | None) -> list[int]:
        return list(self.steps(num_steps))  # each distilled step's state; the targets are read there

    def micro_steps_per_chunk(self, rollouts: RolloutsLike) -> int:
        return len(self.steps(len(rollouts.sigmas) - 1))

    def teacher_of(self, dataset: str | None) -> int:
        """The position in ``train.teachers`` of the teacher of a sample of ``dataset`` (the config routes every
        training dataset; a single teacher without ``applicable_datasets`` serves them all)."""
        if dataset in self.routes:
            return self.routes[dataset]
        if len(self.teachers) == 1 and not self.teachers[0].applicable_datasets:
            return 0
        raise ValueError(f"train.teachers: no teacher serves dataset {dataset!r}; they serve {sorted(self.routes)}")

    def micro_batches(self, rollouts: RolloutsLike, advantages: Tensor, units: Tensor,
                      generator: torch.Generator, role: str = GENERATOR) -> Iterator[OPDBatch]:
        idx = units[:, 0]
        datasets = getattr(rollouts, "datasets", None) or [None] * len(rollouts.group_ids)
        teacher = torch.tensor([self.teacher_of(datasets[i]) for i in idx.tolist()], dtype=torch.long)
        cond, sigmas, n = index_cond(rollouts.cond, idx), rollouts.sigmas, len(idx)
        for step in self.steps(len(sigmas) - 1):
            yield OPDBatch(x=rollouts.latents_at(idx, step), sigma=sigmas[step].expand(n),
                           sigma_next=sigmas[step + 1].expand(n), teacher=teacher.to(idx.device),
                           advantages=advantages[idx], cond=cond)

    def teacher_velocity(self, policy, batch: OPDBatch) -> Tensor:
        """Each row's teacher's velocity at its state, each teacher called once on its rows (no gradient)."""
        out = torch.empty(batch.x.shape, dtype=torch.float32, device=batch.x.device)
        for k in batch.teacher.unique().tolist():
            rows = (batch.teacher == k).nonzero().squeeze(1)
            teacher = self.teachers[k]
            scale = teacher.guidance_scale if teacher.guidance_scale is not None else self.cfg.guidance_scale
            out[rows] = policy.teacher_velocity(teacher.name, batch.x[rows], batch.sigma[rows],
                                                index_cond(batch.cond, rows), guidance_scale=scale).float()
        return out

    def loss(self, policy, batch: OPDBatch) -> tuple[Tensor, dict[str, Tensor]]:
        cfg, target = self.cfg, self.cfg.loss_target
        v_student = policy.velocity(batch.x, batch.sigma, batch.cond)  # at the rollout's own guidance
        v_teacher = self.teacher_velocity(policy, batch)
        variance = None
        if self.dynamics.stochastic and target == "xt":
            # the step's scale depends on the schedule alone (a column per sample, or a number)
            std = self.dynamics.mean_and_std(batch.x, v_teacher, batch.sigma, batch.sigma_next)[1]
            variance = torch.as_tensor(std, dtype=torch.float32, device=batch.x.device) ** 2
        per_sample = opd_sample_loss(
            opd_target(target, batch.x, v_student, batch.sigma, batch.sigma_next, self.dynamics),
            opd_target(target, batch.x, v_teacher, batch.sigma, batch.sigma_next, self.dynamics),
            cfg.self_normalize, variance)
        metrics = {"distill_loss": per_sample.detach().mean()}
        for k in batch.teacher.unique().tolist():  # each teacher's share, as upstream logs it
            metrics[f"distill_loss_{self.teachers[k].name}"] = per_sample.detach()[batch.teacher == k].mean()
        return per_sample.mean(), metrics
