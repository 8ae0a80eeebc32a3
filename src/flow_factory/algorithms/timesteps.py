"""Training timesteps of the decoupled algorithms (NFT, AWM, DPO).

These algorithms train on the forward process ``x_t = (1 - sigma) x0 + sigma eps`` at
noise levels they draw themselves, not at the sampler's steps. Per micro-batch we draw
``num_train_timesteps`` levels, each shared by the micro-batch (as Flow-Factory does).

``timestep_range`` is a fraction of the denoising axis, from sigma = 1 (pure noise,
fraction 0) to sigma = 0 (fraction 1): ``[lo, hi]`` keeps sigma in ``[1 - hi, 1 - lo]``,
and a single number ``f`` means ``[0, f]``: the first fraction of the trajectory.

Strategies:
- ``uniform``: stratified uniform u in (0, 1) (one draw per stratum ``[k/K, (k+1)/K)``,
  then shuffled), so K draws always cover the range evenly;
- ``logit_normal``: the same strata pushed through the standard normal's quantile and
  a sigmoid (SD3's logit-normal, stratified);
- both are warped by ``time_shift`` s as the SD3 / FLUX schedulers shift sigmas,
  ``u -> s u / (1 + (s - 1) u)`` (s > 1: noisier), then mapped into the range:
  ``sigma = (1 - hi) + u (hi - lo)``;
- ``discrete*``: the rollout's own sigmas (already shifted by the pipeline) that lie
  in the range, K stratified over them in order from the noisiest;
  ``discrete_with_init`` always includes the first (noisiest) one, ``discrete_wo_init``
  never does, ``discrete`` treats it like the others.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config.train import range_fractions, resolve_num_train_timesteps

num_train_timesteps = resolve_num_train_timesteps  # the config's rule, for any object with the train keys

STRATEGIES = ("uniform", "logit_normal", "discrete", "discrete_with_init", "discrete_wo_init")
CONTINUOUS = ("uniform", "logit_normal")


def _strata(count: int, generator: torch.Generator) -> Tensor:
    """One uniform draw in each of ``count`` equal strata of (0, 1), shuffled."""
    u = (torch.arange(count, dtype=torch.float64) + torch.rand(count, generator=generator, dtype=torch.float64)) / count
    return u[torch.randperm(count, generator=generator)]


def _stratified_indices(count: int, n: int, generator: torch.Generator) -> Tensor:
    """``count`` indices into ``range(n)``, one per equal stratum (repeats when count > n)."""
    bounds = torch.linspace(0, n, count + 1, dtype=torch.float64)
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    return (bounds[:-1] + u * (bounds[1:] - bounds[:-1])).floor().long().clamp(max=n - 1)


def shift_sigma(u: Tensor, shift: float) -> Tensor:
    return shift * u / (1 + (shift - 1) * u)


def draw_training_sigmas(strategy: str, count: int, rollout_sigmas: Tensor, timestep_range, time_shift: float,
                         generator: torch.Generator) -> Tensor:
    """(count,) float32 noise levels for one micro-batch's training timesteps."""
    if strategy not in STRATEGIES:
        raise ValueError(f"train.time_sampling_strategy: unknown {strategy!r}; valid: {list(STRATEGIES)}")
    if count < 1:
        raise ValueError(f"train.num_train_timesteps must be >= 1, got {count}")
    lo, hi = range_fractions(timestep_range)
    sigma_min, sigma_max = 1.0 - hi, 1.0 - lo
    if strategy in CONTINUOUS:
        u = _strata(count, generator)
        if strategy == "logit_normal":
            u = torch.sigmoid(torch.special.ndtri(u.clamp(1e-7, 1 - 1e-7)))
        u = shift_sigma(u, time_shift)
        return (sigma_min + u * (sigma_max - sigma_min)).float()

    steps = rollout_sigmas[:-1].double()  # the last entry is the clean end (sigma = 0), never a step
    inside = torch.nonzero((steps >= sigma_min - 1e-6) & (steps <= sigma_max + 1e-6)).flatten()
    if len(inside) == 0:
        raise ValueError(f"train.timestep_range {list(timestep_range) if not isinstance(timestep_range, (int, float)) else timestep_range} "
                         f"keeps sigma in [{sigma_min:g}, {sigma_max:g}], which holds none of the rollout's "
                         f"sigmas {[round(float(s), 4) for s in steps]}; widen the range or use a continuous strategy")
    if strategy == "discrete_wo_init":
        inside = inside[1:]
        if len(inside) == 0:
            raise ValueError("train.time_sampling_strategy 'discrete_wo_init' leaves out the first step, and "
                             "train.timestep_range keeps only that one; widen the range")
    if strategy == "discrete_with_init":
        rest = inside[1:]
        chosen = inside[:1]
        if count > 1:
            pool = rest if len(rest) else inside
            chosen = torch.cat([chosen, pool[_stratified_indices(count - 1, len(pool), generator)]])
    else:
        chosen = inside[_stratified_indices(count, len(inside), generator)]
    return rollout_sigmas[chosen].float()
