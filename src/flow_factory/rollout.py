"""The one denoising loop: noise -> trajectory, for every model and every dynamics.

It records what the coupled algorithms (GRPO family) train on: the latents at
every step, the log-prob of each stochastic step, and which steps were
stochastic. Steps outside ``sde_steps`` use the ODE (the MixGRPO / Flow-GRPO-Fast
window), and only those inside are trained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .dynamics import Dynamics
from .dynamics.ode import ODE
from .models.base import Conditioning, FlowAdapter


@dataclass
class Trajectory:
    latents: Tensor  # (B, T + 1, *latent) float32: x at every step, [:, 0] is the noise
    log_probs: Tensor  # (B, T) float32, log-prob of each step's sample (0 at ODE steps)
    sigmas: Tensor  # (T + 1,) float32
    sde_steps: list[int]  # the stochastic (trained) step indices, ascending
    means: Tensor | None = None  # (B, T, *latent): each step's Gaussian mean, when recorded

    @property
    def final(self) -> Tensor:
        return self.latents[:, -1]


@torch.no_grad()
def sample_trajectory(
    adapter: FlowAdapter,
    dynamics: Dynamics,
    cond: Conditioning,
    noise: Tensor,
    sigmas: Tensor,
    guidance_scale: float,
    sde_steps: list[int] | None = None,
    generator: torch.Generator | None = None,
    record_means: bool = False,
) -> Trajectory:
    """Integrate from ``noise`` along ``sigmas``. ``sde_steps=None``: every step uses ``dynamics``.

    ``record_means`` also keeps each step's mean (GRPO-Guard's ratio normalisation needs it).
    """
    num_steps = len(sigmas) - 1
    if sde_steps is None:
        sde_steps = list(range(num_steps)) if dynamics.stochastic else []
    stochastic = set(sde_steps)
    # a deterministic dynamics (ODE, DPM-Solver++2M) runs every step; an SDE only its window.
    # solver(): a fresh per-trajectory object, so a multistep solver's history starts empty
    solver, ode = dynamics.solver(), ODE()
    x = noise.float()
    latents, log_probs, means = [x], [], []
    for i in range(num_steps):
        v = adapter.velocity(x, sigmas[i], cond, guidance_scale)
        step_dynamics = solver if (i in stochastic or not dynamics.stochastic) else ode
        # noise is drawn on the CPU generator so a seed means the same thing on any device
        step_noise = None
        if step_dynamics.stochastic:
            step_noise = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x.device)
        out = step_dynamics.step(x, v, sigmas[i], sigmas[i + 1], noise=step_noise)
        x = out.sample
        latents.append(x)
        if record_means:
            means.append(out.mean)
        log_probs.append(out.log_prob if out.log_prob is not None else torch.zeros(x.shape[0], device=x.device))
    return Trajectory(torch.stack(latents, 1), torch.stack(log_probs, 1), sigmas.float(), sorted(stochastic),
                      torch.stack(means, 1) if record_means else None)
