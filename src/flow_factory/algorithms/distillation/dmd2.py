"""DMD2's generator loss: distribution matching against the teacher's score (arXiv:2405.14867).

DMD (arXiv:2311.18828, eq. 7-8) moves the generator's samples ``x = G(z)`` down the gradient of
``KL(p_fake || p_real)`` after noising: with ``x_t = (1 - sigma) x + sigma eps``,

    grad_theta KL = E[ w_t (s_fake(x_t) - s_real(x_t)) dG/dtheta ],

and as ``s(x_t) = -(x_t - (1 - sigma) x0_hat(x_t)) / sigma^2``, the score difference is a
difference of clean-state predictions: ``s_fake - s_real`` points along ``x0_fake - x0_real`` up to
a positive per-sample factor. The weighting (eq. 8) normalises per sample by the mean absolute
error of the real score's prediction,

    w = 1 / mean_elems | x - x0_real |,

so every sample's step has a comparable size whatever the noise level. Here, with ``x0`` read from
velocities as ``x0 = x_t - sigma v`` (``flow.clean_from_velocity``), per sample

    g = (x0_fake - x0_real) / max(mean|x - x0_real|, eps),             (no gradient)
    L = mean_elems  1/2 || x - sg(x - g) ||^2,                         (the DMD2 code's pseudo-loss)

then averaged over the batch, so ``dL/dx = g / (numel B)``: gradient descent moves ``x`` towards
``x0_real`` and away from ``x0_fake``, i.e. towards the teacher's distribution. Non-finite entries of
``g`` (a normaliser of zero with equal predictions) are zeroed, as upstream does.

Upstream's choices (Flow-Factory ``trainers/distillation/dmd2.py`` and ``distribution_matching.py``):

- ``x`` is the generator's live clean prediction ``x0_i = x_i - sigma_i v_theta(x_i, sigma_i)`` at one
  step ``i`` of its own deterministic K-step rollout, drawn uniformly in ``[0, K)`` per replay unit
  (for K = 1 the one-step generator ``G(z) = z - v_theta(z, 1)``); the rollout states ``x_i`` are
  detached (DMD2's "backward simulation": the student's own trajectory provides its inputs);
- ``sigma ~ U(perturbation_timestep_range)``, default (0.02, 0.98), one per sample, with fresh noise;
- the real score is the frozen teacher queried with classifier-free guidance at
  ``real_guidance_scale`` (null: ``guidance_scale``), the fake score without guidance;
- no GAN term (DMD2's optional GAN classifier is not in upstream's trainer), no regression loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .flow import mean_over_sample

__all__ = ["distribution_matching_direction", "dmd2_generator_loss", "sample_boundary_index"]


def distribution_matching_direction(x0_gen: Tensor, x0_real: Tensor, x0_fake: Tensor, eps: float = 1e-6) -> Tensor:
    """DMD's normalised gradient ``g = (x0_fake - x0_real) / max(mean|x0_gen - x0_real|, eps)`` (no
    gradient), per sample; the generator descends along it."""
    x0_gen, x0_real, x0_fake = x0_gen.detach().float(), x0_real.detach().float(), x0_fake.detach().float()
    normaliser = mean_over_sample((x0_gen - x0_real).abs()).clamp_min(eps)
    g = (x0_fake - x0_real) / normaliser.reshape(-1, *([1] * (x0_gen.ndim - 1)))
    return torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)


def dmd2_generator_loss(x0_gen: Tensor, x0_real: Tensor, x0_fake: Tensor, eps: float = 1e-6) -> Tensor:
    """Scalar DMD pseudo-loss of the generator's clean samples ``x0_gen`` (with gradient) whose gradient
    is ``distribution_matching_direction / (numel B)``; ``x0_real`` and ``x0_fake`` are the real and fake
    scores' clean predictions at the same noised ``x_t`` (no gradient)."""
    g = distribution_matching_direction(x0_gen, x0_real, x0_fake, eps)
    x = x0_gen.float()
    target = (x - g).detach()
    return mean_over_sample(0.5 * (x - target) ** 2).mean()


def sample_boundary_index(num_inference_steps: int, generator: torch.Generator | None = None) -> int:
    """The rollout step, in ``[0, K)``, whose clean prediction a DMD2 replay unit matches (uniform)."""
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    return int(torch.randint(num_inference_steps, (1,), generator=generator).item())
