"""The flow-matching conversions every distillation loss is written in.

The repository's convention (``dynamics/base.py``): ``sigma`` in [0, 1] is the noise level,

    x_t = (1 - sigma) x0 + sigma eps,        v = eps - x0,

so a velocity read at ``(x_t, sigma)`` names a clean state and a noise,

    x0_hat = x_t - sigma v,                  eps_hat = x0_hat + v = x_t + (1 - sigma) v.

All arithmetic is float32. ``sigma`` is a scalar or one value per sample (B,).
"""

from __future__ import annotations

from torch import Tensor

from ...dynamics.base import as_batch_column, mean_over_sample

__all__ = ["add_noise", "as_batch_column", "clean_from_velocity", "guided_velocity", "mean_over_sample",
           "noise_from_velocity", "velocity_target"]


def add_noise(x0: Tensor, noise: Tensor, sigma: Tensor | float) -> Tensor:
    """The forward process ``x_t = (1 - sigma) x0 + sigma eps``."""
    s = as_batch_column(sigma, x0)
    return (1 - s) * x0.float() + s * noise.float()


def velocity_target(x0: Tensor, noise: Tensor) -> Tensor:
    """The flow-matching target ``v = eps - x0``."""
    return noise.float() - x0.float()


def clean_from_velocity(x_t: Tensor, velocity: Tensor, sigma: Tensor | float) -> Tensor:
    """The clean state a velocity points at: ``x0_hat = x_t - sigma v``."""
    return x_t.float() - as_batch_column(sigma, x_t) * velocity.float()


def noise_from_velocity(x0_hat: Tensor, velocity: Tensor) -> Tensor:
    """The noise paired with ``x0_hat`` by the same velocity: ``eps_hat = x0_hat + v``."""
    return x0_hat.float() + velocity.float()


def guided_velocity(conditional: Tensor, unconditional: Tensor | None, scale: float) -> Tensor:
    """Classifier-free guidance ``v_u + s (v_c - v_u)``. Without an unconditional velocity (a CFG-free
    query: upstream's ``real_guidance_scale`` null with ``guidance_scale`` 1) the conditional one, which
    only scale 1 may ask for."""
    if unconditional is None:
        if scale != 1.0:
            raise ValueError(f"guidance scale {scale} needs an unconditional velocity")
        return conditional.float()
    return unconditional.float() + scale * (conditional.float() - unconditional.float())
