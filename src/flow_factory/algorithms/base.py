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
            loss = algorithm.loss(policy, batch); backward; step every N micro-batches

Coupled algorithms (GRPO family) make one micro-batch per trained SDE step of the
rollout; decoupled ones (``decoupled.py``) one per training timestep they draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterator, Protocol

import torch
from torch import Tensor

from ..dynamics import Dynamics
from ..models.base import Conditioning, index_cond


class Policy(Protocol):
    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor: ...

    def reference_velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor: ...


class RolloutsLike(Protocol):
    """What ``micro_batches`` reads from an epoch's rollouts (``sampling.Rollouts``)."""

    latents: Tensor  # (N, T + 1, *latent)
    log_probs: Tensor  # (N, T)
    sigmas: Tensor  # (T + 1,)
    sde_steps: list[int]
    cond: Conditioning
    means: Tensor | None


@dataclass
class TrainBatch:
    """A micro-batch of rollout samples, all trained at the same step index ``step``."""

    latents: Tensor  # (B, T + 1, *latent)
    old_log_probs: Tensor  # (B, T)
    advantages: Tensor  # (B,)
    sigmas: Tensor  # (T + 1,)
    cond: Conditioning
    step: int  # which denoising step this loss is for
    # (B, T, *latent): each step's Gaussian mean as the rollout computed it; recorded
    # only for algorithms with ``records_step_means`` (GRPO-Guard), else None
    old_means: Tensor | None = None
    # (B,) long: per sample, one step its rollout did not train, where the loss compares the
    # policy with the reference (train.outside_kl_beta > 0), else None
    outside_steps: Tensor | None = None


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

    def __init__(self, train_cfg, dynamics: Dynamics):
        self.cfg = train_cfg
        self.dynamics = dynamics

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

    # --- how an epoch's rollouts become micro-batches --------------------------------
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
        outside = [s for s in range(len(rollouts.sigmas) - 1) if s not in rollouts.sde_steps]
        for step in rollouts.sde_steps:
            outside_steps = None
            if self.cfg.outside_kl_beta > 0:
                if not outside:
                    raise ValueError("train.outside_kl_beta: every step of this rollout was trained, so no "
                                     "step is outside the SDE window; narrow scheduler.sde_steps")
                pick = torch.randint(len(outside), (len(idx),), generator=generator)
                outside_steps = torch.tensor(outside)[pick]
            yield TrainBatch(
                latents=rollouts.latents[idx], old_log_probs=rollouts.log_probs[idx],
                advantages=advantages[idx], sigmas=rollouts.sigmas, cond=index_cond(rollouts.cond, idx),
                step=step, old_means=None if rollouts.means is None else rollouts.means[idx],
                outside_steps=outside_steps)

    def loss(self, policy: Policy, batch) -> tuple[Tensor, dict[str, Tensor]]:
        """Scalar loss and detached metrics (each a 0-d tensor) for one micro-batch."""
        raise NotImplementedError  # abstract
