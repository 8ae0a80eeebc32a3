"""Supervised fine-tuning on a dataset's images (Flow-Factory's trainer ``sft``): the flow-matching loss

    x_t = (1 - sigma) x0 + sigma eps,    L = mean_b mean((v(x_t, sigma) - (eps - x0))^2),

at ``num_train_timesteps`` noise levels drawn per micro-batch (``time_sampling_strategy``: logit_normal
by default, upstream's ``weighting_scheme``). ``x0`` is a demonstration's image encoded by the VAE
(``data/offline.py``); there is no rollout and no reward, and every sample weighs the same.
"""

from __future__ import annotations

from torch import Tensor

from ..dynamics.base import mean_over_sample
from .decoupled import DecoupledAlgorithm, NoisedBatch


def flow_matching_loss(v: Tensor, target: Tensor) -> Tensor:
    """The mean over samples of each one's mean squared velocity error."""
    return mean_over_sample((v.float() - target.float()) ** 2).mean()


class SFT(DecoupledAlgorithm):
    name = "sft"

    def loss(self, policy, batch: NoisedBatch) -> tuple[Tensor, dict[str, Tensor]]:
        v = policy.velocity(batch.x_t, batch.sigma, batch.cond)
        loss = flow_matching_loss(batch.part(v), batch.part(batch.target))
        return loss, {"flow_matching_loss": loss.detach()}
