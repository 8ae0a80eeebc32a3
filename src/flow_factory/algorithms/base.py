"""What an algorithm is: what its rollout needs, how an epoch's rollouts become
micro-batches, and a loss over one micro-batch.

An algorithm never sees a model's packing or text encoders: it calls
``policy.velocity`` (the current weights, with grad), ``policy.reference_velocity``
(the reference: the LoRA adapter disabled, or a frozen copy), and for the decoupled
algorithms ``policy.sampling_velocity`` (the weights the rollout sampled with) and
``policy.ema_velocity`` on latents.

The trainer's loop is the same for every algorithm (``trainer/optimize.py``):

    units = algorithm.training_units(group_ids, advantages)      # rows of sample indices
    for each shuffled chunk of per_device_batch_size units:
        for batch in algorithm.micro_batches(rollouts, advantages, chunk, generator):
            (up to train.steps_per_call batches merged into one: one transformer call)
            loss = algorithm.loss(policy, batch); backward; step every N micro-batches

Coupled algorithms (GRPO family) make one micro-batch per trained SDE step of the
rollout; decoupled ones (``decoupled.py``) one per training timestep they draw. Batches
are per row, so several steps' batches concatenate (``merge_batches``); a loss over a
merged batch is the mean of its per-step losses, which every loss over independent rows
is already, and the others (pairs, groups, centering) get through ``mean_over_parts``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import ClassVar, Iterator, Protocol

import torch
from torch import Tensor

from ..dynamics import Dynamics
from ..models.conditioning import Conditioning, cat_cond, index_cond


class Policy(Protocol):
    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor: ...

    def reference_velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning,
                           guidance_scale: float | None = None) -> Tensor: ...


class RolloutsLike(Protocol):
    """What ``micro_batches`` reads from an epoch's rollouts (``sampling.Rollouts``)."""

    latents: Tensor  # (N, K, *latent): the latents at the steps ``latent_steps`` names
    latent_steps: list[int]  # which of the T + 1 states of a trajectory ``latents`` keeps, ascending
    log_probs: Tensor  # (N, T)
    sigmas: Tensor  # (T + 1,)
    sde_steps: list[int]
    cond: Conditioning
    means: Tensor | None
    generated: Tensor | None  # bool (*latent): the elements the model generates; None: every one

    def latents_at(self, idx: Tensor, step: int | Tensor) -> Tensor:
        """(len(idx), *latent): sample ``idx[j]``'s latent before step ``step`` (one, or one per row)."""


@dataclass
class TrainBatch:
    """A micro-batch of rollout samples, each row one sample at one trained SDE step.

    Every field is per row, so the batches of several steps concatenate into one
    (``merge_batches``) and go through the transformer in one call; ``parts`` says how many
    per-step batches a batch joins (equal-sized, one after the other)."""

    x: Tensor  # (B, *latent) the latent before the step
    x_next: Tensor  # (B, *latent) the sample the rollout drew
    sigma: Tensor  # (B,)
    sigma_next: Tensor  # (B,)
    old_log_prob: Tensor  # (B,) the log-prob the rollout recorded
    advantages: Tensor  # (B,)
    cond: Conditioning
    step: Tensor  # (B,) long: which denoising step each row is
    # (B, *latent): the step's Gaussian mean as the rollout computed it; recorded only for
    # algorithms with ``records_step_means`` (GRPO-Guard), else None
    old_mean: Tensor | None = None
    # (B, *latent) and (B,): per sample, the latent and sigma at one step its rollout did not
    # train, where the loss compares the policy with the reference (train.outside_kl_beta > 0)
    outside_x: Tensor | None = None
    outside_sigma: Tensor | None = None
    parts: int = 1


def merge_batches(batches: list):
    """One batch of the rows of ``batches`` (per-row dataclasses of one type, equal sizes), in
    order: tensors and conditioning concatenate, ``parts`` add up, other fields must agree."""
    if len(batches) == 1:
        return batches[0]
    merged = {}
    for f in fields(batches[0]):
        values = [getattr(b, f.name) for b in batches]
        if f.name == "parts":
            merged[f.name] = sum(values)
        elif isinstance(values[0], Tensor):
            merged[f.name] = torch.cat(values)
        elif isinstance(values[0], dict):
            merged[f.name] = cat_cond(values)
        elif any(v != values[0] for v in values[1:]):
            raise ValueError(f"merge_batches: field {f.name!r} differs between the batches")
        else:
            merged[f.name] = values[0]
    return replace(batches[0], **merged)


def mean_over_parts(batch, loss_of_part: Callable[[slice], tuple[Tensor, dict[str, Tensor]]]):
    """For losses whose rows are not independent (pairs, groups, batch centering): the mean of
    ``loss_of_part(rows)`` over the batch's ``parts``, loss and metrics alike, so a merged batch
    gives the mean of what its per-step batches give."""
    n = len(batch.advantages) // batch.parts
    results = [loss_of_part(slice(p * n, (p + 1) * n)) for p in range(batch.parts)]
    if len(results) == 1:
        return results[0]
    loss = torch.stack([r[0] for r in results]).mean()
    metrics = {}
    for k in results[0][1]:
        values = torch.stack([r[1][k] for r in results])
        metrics[k] = values.min() if k.endswith("_min") else values.max() if k.endswith("_max") else values.mean()
    return loss, metrics


class Algorithm:
    name: ClassVar[str]
    # coupled: trains the sampler's own SDE steps through their log-probs (needs SDE dynamics)
    coupled: ClassVar[bool] = True
    # the rollout must also record each step's mean (TrainBatch.old_means)
    records_step_means: ClassVar[bool] = False
    # the loss calls policy.sampling_velocity: the trainer keeps the rollout's weights
    uses_sampling_policy: ClassVar[bool] = False
    # the loss always calls policy.reference_velocity (not only when kl_beta > 0)
    always_uses_reference: ClassVar[bool] = False
    # the name of a weight snapshot (``weight_snapshots``) the rollout samples with, else None
    rollout_snapshot: ClassVar[str | None] = None
    # every process trains its share of the same global micro-batch at the same time, and the loss
    # sums over all of them (DGPO: a group's members may sit on several processes): the trainer lays
    # an epoch's samples out by global micro-batch (``data.process_share``), and the shuffle and the
    # training draws are the same on every process
    lockstep: ClassVar[bool] = False
    # what one optimizer step trains, in turn: (role, passes over its chunks) each (``trainer/roles.py``; DMD2:
    # the fake score's ttur_fake_updates steps, then the generator's one); None: the one trained network
    phases: ClassVar[tuple] = ((None, 1),)

    def __init__(self, train_cfg, dynamics: Dynamics):
        self.cfg = train_cfg
        self.dynamics = dynamics

    def bind_model(self, adapter) -> None:
        """Read what the algorithm needs of the loaded model before it trains (TDM's ``source_uniform``: the
        schedule's static flow shift). Default: nothing."""

    @property
    def needs_reference(self) -> bool:
        """The loss calls policy.reference_velocity, so the policy keeps the starting weights."""
        cfg = self.cfg
        return self.always_uses_reference or cfg.kl_beta > 0 or cfg.outside_kl_beta > 0

    @property
    def weight_snapshots(self) -> dict:
        """Named copies of the trained weights the trainer keeps (CRD's old and sampling models):
        name -> ``decay(optimizer_steps) -> float``. After each epoch's update every copy moves as
        ``w <- d w + (1 - d) theta``; the loss reads one through ``policy.snapshot_velocity(name, ...)``,
        checkpoints carry them. Default: none."""
        return {}

    @property
    def step_snapshots(self) -> dict:
        """Like ``weight_snapshots``, but moved after every optimizer step, with ``decay(k)`` for the
        k-th step (0-based) of the run (DGPO's fast old-policy EMA). Default: none."""
        return {}

    def sampling_snapshot(self, optimizer_steps: int) -> str | None:
        """The weight snapshot the rollout samples with after ``optimizer_steps`` optimizer steps, else
        None (the current weights, or the EMA with ``off_policy``). Default: ``rollout_snapshot``."""
        return self.rollout_snapshot

    # --- how an epoch's rollouts become micro-batches --------------------------------
    def kept_states(self, num_steps: int, sde_steps: list[int] | None) -> list[int]:
        """The trajectory states (0 the noise .. ``num_steps`` the final latent) the rollout keeps for
        training. Coupled: each trained step's latent and the sample it drew, and with
        ``outside_kl_beta`` the untrained steps' latents too; the rest is never read again."""
        trained = range(num_steps) if sde_steps is None else sde_steps
        kept = {s for i in trained for s in (i, i + 1)}
        if self.cfg.outside_kl_beta > 0:
            kept |= set(range(num_steps)) - set(trained)
        return sorted(kept)

    def training_units(self, group_ids: Tensor, advantages: Tensor) -> Tensor:
        """(U, k) long: the sample indices each training unit holds. Default: every sample
        alone (k = 1); the trainer shuffles units and takes ``per_device_batch_size`` at a time."""
        return torch.arange(len(advantages)).unsqueeze(1)

    def units_per_chunk(self, batch_size: int) -> int:
        """Units the loop takes at a time, given ``per_device_batch_size``. Default: that many; an
        algorithm whose unit holds several samples (DGPO: a whole group) takes fewer, so that a
        micro-batch still holds ``per_device_batch_size`` samples."""
        return batch_size

    def micro_batches(self, rollouts: RolloutsLike, advantages: Tensor, units: Tensor,
                      generator: torch.Generator) -> Iterator[TrainBatch]:
        """Coupled: the chosen samples at each trained (stochastic) step of their rollout."""
        idx = units[:, 0]
        n = len(idx)
        sigmas = rollouts.sigmas
        outside = [s for s in range(len(sigmas) - 1) if s not in rollouts.sde_steps]
        cond = index_cond(rollouts.cond, idx)
        for step in rollouts.sde_steps:
            outside_x = outside_sigma = None
            if self.cfg.outside_kl_beta > 0:
                if not outside:
                    raise ValueError("train.outside_kl_beta: every step of this rollout was trained, so no "
                                     "step is outside the SDE window; narrow scheduler.sde_steps")
                picks = torch.tensor(outside)[torch.randint(len(outside), (n,), generator=generator)]
                outside_x, outside_sigma = rollouts.latents_at(idx, picks), sigmas[picks.to(sigmas.device)]
            yield TrainBatch(
                x=rollouts.latents_at(idx, step), x_next=rollouts.latents_at(idx, step + 1),
                sigma=sigmas[step].expand(n), sigma_next=sigmas[step + 1].expand(n),
                old_log_prob=rollouts.log_probs[idx, step], advantages=advantages[idx], cond=cond,
                step=torch.full((n,), step, dtype=torch.long),
                old_mean=None if rollouts.means is None else rollouts.means[idx, step],
                outside_x=outside_x, outside_sigma=outside_sigma)

    def loss(self, policy: Policy, batch) -> tuple[Tensor, dict[str, Tensor]]:
        """Scalar loss and detached metrics (each a 0-d tensor) for one micro-batch."""
        raise NotImplementedError  # abstract
