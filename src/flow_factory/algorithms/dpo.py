"""Online Diffusion-DPO (B. Wallace et al., arXiv:2311.12908) on each epoch's groups.

Per group, the sample with the highest advantage is the winner and the one with the
lowest the loser. Both get the same noise and noise level; with the flow-matching
errors ``e = mean((v - (eps - x0))^2)`` of the policy and of the reference,

    L = -log sigmoid(-beta / 2 ((e_w - e_l) - (e_ref_w - e_ref_l))),

so the loss falls as the policy fits the winner better, and the loser worse, than the
reference does. ``beta`` is the DPO temperature (Diffusion-DPO used 2000 to 5000 with
these per-dimension means). A group whose best and worst advantages are equal (all
rewards tied) prefers nothing: its pair is weighted 0, so every rank still runs the
same number of micro-batches.

A micro-batch holds ``per_device_batch_size`` pairs: winners first, then losers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..dynamics.base import mean_over_sample
from .base import mean_over_parts
from .decoupled import DecoupledAlgorithm, NoisedBatch


def best_and_worst(group_ids: Tensor, advantages: Tensor) -> Tensor:
    """(G, 2) sample indices: per group (in order of first appearance) its best and worst sample."""
    pairs = []
    for g in dict.fromkeys(group_ids.tolist()):
        members = torch.nonzero(group_ids.cpu() == g).flatten()
        adv = advantages.detach().cpu()[members]
        pairs.append([int(members[adv.argmax()]), int(members[adv.argmin()])])
    return torch.tensor(pairs, dtype=torch.long)


def dpo_loss(v: Tensor, v_ref: Tensor, target: Tensor, beta: float,
             pair_weight: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """``v``, ``v_ref``, ``target``: (2P, ...) winners then losers. Returns the mean pair loss."""
    err = mean_over_sample((v.float() - target.float()) ** 2)
    with torch.no_grad():
        err_ref = mean_over_sample((v_ref.float() - target.float()) ** 2)
    p = len(err) // 2
    model_diff = err[:p] - err[p:]
    ref_diff = err_ref[:p] - err_ref[p:]
    inside = -0.5 * beta * (model_diff - ref_diff)
    per_pair = -F.logsigmoid(inside)
    weight = torch.ones_like(per_pair) if pair_weight is None else pair_weight.float()
    metrics = {"implicit_accuracy": (inside.detach() > 0).float().mean(),
               "model_diff": model_diff.detach().mean(), "ref_diff": ref_diff.mean(),
               "valid_pairs": weight.mean()}
    return (weight * per_pair).mean(), metrics


class DPO(DecoupledAlgorithm):
    name = "dpo"
    always_uses_reference = True
    noise_shared_within_unit = True

    def training_units(self, group_ids: Tensor, advantages: Tensor) -> Tensor:
        return best_and_worst(group_ids, advantages)

    def loss(self, policy, batch: NoisedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        x_t = batch.x_t
        v = batch.part(policy.velocity(x_t, batch.sigma, batch.cond))
        v_ref = batch.part(policy.reference_velocity(x_t, batch.sigma, batch.cond))
        target, adv = batch.part(batch.target), batch.advantages

        def pairs_of(rows: slice):  # each timestep's rows are its winners, then its losers
            p = len(adv[rows]) // 2
            valid = adv[rows][:p] > adv[rows][p:]
            return dpo_loss(v[rows], v_ref[rows], target[rows], self.cfg.beta, valid)

        loss, metrics = mean_over_parts(batch, pairs_of)
        metrics.update(policy_loss=loss.detach(), **self.advantage_metrics(adv))
        return loss, metrics


class OfflineDPO(DPO):
    """Diffusion-DPO on a dataset's preference pairs (Flow-Factory's ``offline-dpo``): each record a group of
    two, the chosen image with advantage +1, the rejected -1 (``Trainer``'s offline epoch), so the pair
    ``best_and_worst`` picks is the record's own."""

    name = "offline-dpo"
