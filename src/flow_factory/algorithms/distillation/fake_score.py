"""The fake score: a denoiser of the generator's own samples (DMD, arXiv:2311.18828, eq. 6; DMD2,
arXiv:2405.14867, sec. 4.1: updated ``ttur_fake_updates`` times per generator step, the two time-scale
update rule).

DMD2's fake score is trained as the teacher was, by denoising score matching on the generator's
outputs; in the flow-matching parameterisation that is the flow-matching loss at a fresh noising
of the detached generated clean state ``x0 = G(z)`` (for a K-step generator the clean prediction
``x0_i = x_i - sigma_i v_theta(x_i, sigma_i)`` at a step ``i`` of its rollout drawn in ``[0, K)``, the samples the
generator's loss is taken at; ``trainers.DMD2``):

    sigma ~ U(perturbation_timestep_range),  eps ~ N(0, I),  x_t = (1 - sigma) x0 + sigma eps,
    L_fake = E || v_fake(x_t, sigma) - (eps - x0) ||^2,

the squared error averaged over each sample's elements, then over the batch (upstream's
``flow_matching_loss`` with ``reduce_latent_values``, a per-sample mean). Its minimiser is the
velocity of the generator's distribution, ``E[eps - x0 | x_t]``, so the fake score follows the
generator: the gradient on ``v_fake`` is ``2 (v_fake - (eps - x0)) / (numel B)``.

Upstream (Flow-Factory ``trainers/distillation/dmd2.py``) draws sigma uniformly in
``perturbation_timestep_range`` (default (0.02, 0.98)), one per sample, for both the fake loss and
the generator's score queries, and queries the fake score without guidance (the fake score models
what the CFG-free generator produces; only the real score is guided).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .flow import mean_over_sample, velocity_target

__all__ = ["fake_score_loss", "sample_perturbation_sigma"]


def sample_perturbation_sigma(batch_size: int, sigma_range: tuple[float, float] = (0.02, 0.98), *,
                              generator: torch.Generator | None = None, device=None) -> Tensor:
    """(B,) noise levels drawn uniformly in ``sigma_range`` (upstream's ``perturbation_timestep_range``,
    a range of sigma in [0, 1], not of scheduler timesteps), one per sample."""
    lo, hi = (float(v) for v in sigma_range)
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"perturbation_timestep_range must satisfy 0 <= lower < upper <= 1, got {(lo, hi)}")
    u = torch.rand(batch_size, generator=generator, dtype=torch.float32, device=device)
    return lo + (hi - lo) * u


def fake_score_loss(v_fake: Tensor, x0: Tensor, noise: Tensor) -> Tensor:
    """Scalar flow-matching loss of the fake score's velocity ``v_fake`` read at
    ``x_t = (1 - sigma) x0 + sigma noise``; ``x0`` (the generated sample) and ``noise`` carry no gradient."""
    target = velocity_target(x0.detach(), noise.detach())
    return mean_over_sample((v_fake.float() - target) ** 2).mean()
