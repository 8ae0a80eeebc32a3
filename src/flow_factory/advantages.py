"""Advantages from rewards: pure functions over the whole (gathered) batch.

Samples that share a prompt form a group, marked by equal ``group_ids``. The
group-relative advantage (GRPO, as flow_grpo's ``PerPromptStatTracker``) is

    A_i = (R_i - mean_{j in g(i)} R_j) / (std + eps)

with ``std`` the standard deviation of the rewards of i's group, or, with
``global_std``, of every reward in the batch. Standard deviations are the
population ones (``unbiased=False``, numpy's default ddof=0), as flow_grpo computes
them; ``eps = 1e-4`` as there. A group whose rewards are all equal gets A = 0.

Several rewards (weights ``w_k``) combine in one of two ways:

* ``sum``:  the advantage of the weighted sum, ``A = group_adv(sum_k w_k R_k)``.
* ``gdpo``: (GDPO, arXiv:2601.05242) each reward is normalised on its own, then
  the weighted sum is normalised over the batch:

      B = sum_k w_k group_adv(R_k),   A = (B - mean(B)) / (std(B) + eps)

  so a reward with a large scale cannot drown the others. As in GDPO's reference
  code and Flow-Factory, the per-reward step always uses per-group std (the batch
  normalisation after it plays the part of ``global_std``), so Flow-Factory
  configs give the same numbers here.
  GDPO's reference uses Bessel-corrected stds; with the population std used here
  the per-reward advantages differ by the constant factor sqrt(G / (G - 1)) for
  groups of size G, which the final batch normalisation removes (up to eps).

A weight may be one per sample (a (B,) tensor): a reward routed to some datasets (``data.datasets``)
weighs 0 on the others' samples, where it was not scored (NaN) and counts as 0. A group is one prompt,
so one dataset: its rewards are all scored or all not.

Clipping to ``adv_clip_range`` is the algorithm's job, not done here.

Distributed: call these on rewards and group ids gathered from every rank, then
take the rank's slice; one process and N processes then give identical advantages.
Arithmetic is float64 (rewards can be large and nearly equal); results are float32.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

AGGREGATIONS = ("sum", "gdpo")


def _check_1d(rewards: Tensor, group_ids: Tensor) -> None:
    if rewards.ndim != 1 or group_ids.ndim != 1 or rewards.shape != group_ids.shape:
        raise ValueError(f"rewards and group_ids must both be (B,), got {tuple(rewards.shape)} "
                         f"and {tuple(group_ids.shape)}")
    if rewards.numel() == 0:
        raise ValueError("cannot compute advantages of an empty batch")


def _population_std(x: Tensor) -> Tensor:
    return x.std(unbiased=False) if x.numel() > 1 else torch.zeros((), dtype=x.dtype, device=x.device)


def _group_advantages64(rewards: Tensor, group_ids: Tensor, global_std: bool, eps: float) -> Tensor:
    rewards = torch.as_tensor(rewards)
    group_ids = torch.as_tensor(group_ids, device=rewards.device)
    _check_1d(rewards, group_ids)
    r = rewards.to(torch.float64)
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n_groups = counts.numel()
    counts = counts.to(torch.float64)
    group_mean = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, inverse, r) / counts
    centred = r - group_mean[inverse]
    if global_std:
        std = _population_std(r)
    else:
        # two-pass variance: mean squared deviation from the group mean
        group_var = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(
            0, inverse, centred**2) / counts
        std = group_var.sqrt()[inverse]
    return centred / (std + eps)


def group_advantages(rewards: Tensor, group_ids: Tensor, global_std: bool = False,
                     eps: float = 1e-4) -> Tensor:
    """``(R - mean of R's group) / (std + eps)``; std per group, or over the batch with ``global_std``.

    Groups need not be contiguous. Returns float32 (B,) on ``rewards``' device.
    """
    return _group_advantages64(rewards, group_ids, global_std, eps).to(torch.float32)


def combine_advantages(rewards: Mapping[str, Tensor], weights: Mapping[str, float | Tensor], group_ids: Tensor,
                       aggregation: str = "sum", global_std: bool = False, eps: float = 1e-4) -> Tensor:
    """One advantage per sample from several rewards (see the module docstring for the formulas).

    ``rewards``: raw scores ``{name: (B,)}``; ``weights``: ``{name: w}`` for exactly those names.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown advantage aggregation {aggregation!r}; expected one of {list(AGGREGATIONS)}")
    if not rewards:
        raise ValueError("no rewards to compute advantages from")
    missing = sorted(set(rewards) - set(weights))
    unused = sorted(set(weights) - set(rewards))
    if missing or unused:
        raise ValueError(f"rewards and weights must name the same rewards; "
                         f"no weight for {missing}, no rewards for {unused}")
    names = list(rewards)
    group_ids = torch.as_tensor(group_ids)

    def weighted(k: str, values: Tensor) -> Tensor:  # w_k x values, 0 where a per-sample weight is 0
        w = weights[k]
        if not isinstance(w, Tensor):
            return float(w) * values
        w = w.to(device=values.device, dtype=torch.float64)
        return torch.where(w != 0, w * values, torch.zeros_like(values))

    if aggregation == "sum":
        total = sum(weighted(k, torch.as_tensor(rewards[k]).to(torch.float64)) for k in names)
        return _group_advantages64(total, group_ids, global_std, eps).to(torch.float32)
    combined = sum(weighted(k, _group_advantages64(rewards[k], group_ids, False, eps)) for k in names)
    return ((combined - combined.mean()) / (_population_std(combined) + eps)).to(torch.float32)
