"""The one denoising loop: noise -> trajectory, for every model and every dynamics.

It records what the coupled algorithms (GRPO family) train on: the latents at
every step, the log-prob of each stochastic step, and which steps were
stochastic. Steps outside ``sde_steps`` use the ODE (the MixGRPO / Flow-GRPO-Fast
window), and only those inside are trained.

A group that shares its starting noise and prompt (``same_latent``) is one
trajectory until its first stochastic step; ``shared_rows`` says which rows those
are, and the deterministic prefix is then computed once per group (with the window
on steps 0-4 and groups of 8, about a sixth of the sampling compute).

``storage_dtype`` (``train.latent_storage_dtype``) stores the trajectory in half the
bytes. The state is rounded to it after every step, and a step's log-prob is that of the
rounded sample, so the stored trajectory is exactly the one sampled: training recomputes
each step from the very values the rollout used, and the on-policy ratio stays 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .dynamics import Dynamics
from .dynamics.ode import ODE
from .models.base import Conditioning, FlowAdapter, index_cond


@dataclass
class Trajectory:
    latents: Tensor  # (B, T + 1, *latent) in the storage dtype (float32 by default): x at every step, [:, 0] the noise
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
    shared_rows: Tensor | None = None,
    storage_dtype: torch.dtype | None = None,
) -> Trajectory:
    """Integrate from ``noise`` along ``sigmas``. ``sde_steps=None``: every step uses ``dynamics``.

    ``record_means`` also keeps each step's mean (GRPO-Guard's ratio normalisation needs it).
    ``shared_rows`` (B,): rows with equal ids have equal ``noise`` and ``cond``; the steps
    before the first stochastic one are then integrated once per id. ``storage_dtype``: the
    trajectory is kept (and integrated) at that precision; None = float32.
    """
    keep = (lambda t: t) if storage_dtype is None else (lambda t: t.to(storage_dtype))

    num_steps = len(sigmas) - 1
    if sde_steps is None:
        sde_steps = list(range(num_steps)) if dynamics.stochastic else []
    stochastic = set(sde_steps)
    # a deterministic dynamics (ODE, DPM-Solver++2M) runs every step; an SDE only its window.
    # solver(): a fresh per-trajectory object, so a multistep solver's history starts empty
    solver, ode = dynamics.solver(), ODE()
    x = keep(noise.float()).float()
    latents, log_probs, means = [keep(x)], [], []
    prefix = min(stochastic, default=num_steps) if dynamics.stochastic else num_steps
    groups = _shared_groups(shared_rows) if shared_rows is not None and prefix > 0 else None
    if groups is not None:  # integrate one row per group until the rows part
        first, expand = (t.to(x.device) for t in groups)
        full_cond, cond, x, latents = cond, index_cond(cond, first), x[first], [latents[0][first]]
    for i in range(num_steps):
        if groups is not None and i == prefix:
            x, latents, log_probs, means = _expand(expand, x, latents, log_probs, means)
            cond, groups = full_cond, None
        v = adapter.velocity(x, sigmas[i], cond, guidance_scale)
        step_dynamics = solver if (i in stochastic or not dynamics.stochastic) else ode
        # noise is drawn on the CPU generator so a seed means the same thing on any device
        step_noise = None
        if step_dynamics.stochastic:
            step_noise = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x.device)
        out = step_dynamics.step(x, v, sigmas[i], sigmas[i + 1], noise=step_noise)
        latents.append(keep(out.sample))
        x = latents[-1].float()  # integrate on from the value stored
        if record_means:
            means.append(out.mean)
        if out.log_prob is None:
            log_probs.append(torch.zeros(x.shape[0], device=x.device))
        else:  # the density of the sample as stored (the same value when nothing is rounded)
            log_probs.append(out.log_prob if storage_dtype is None else step_dynamics.log_prob(x, out.mean, out.std))
    if groups is not None:  # deterministic to the end
        x, latents, log_probs, means = _expand(expand, x, latents, log_probs, means)
    return Trajectory(torch.stack(latents, 1), torch.stack(log_probs, 1), sigmas.float(), sorted(stochastic),
                      torch.stack(means, 1) if record_means else None)


def _shared_groups(shared_rows: Tensor) -> tuple[Tensor, Tensor] | None:
    """(the first row of each id, each row's index into those), or None when no id repeats."""
    ids, expand = torch.unique(shared_rows.cpu(), return_inverse=True)
    if len(ids) == len(shared_rows):
        return None
    first = torch.full((len(ids),), len(shared_rows), dtype=torch.long)
    first.scatter_reduce_(0, expand, torch.arange(len(shared_rows)), reduce="amin")
    return first, expand


def _expand(expand: Tensor, x: Tensor, *histories: list[Tensor]):
    """The per-group state so far, one row per sample again."""
    return (x[expand], *([t[expand] for t in h] for h in histories))
