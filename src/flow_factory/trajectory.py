"""The one denoising loop: noise -> trajectory, for every model and every dynamics.

It records what the coupled algorithms (GRPO family) train on: the latents at
every step, the log-prob of each stochastic step, and which steps were
stochastic. Steps outside ``sde_steps`` use the ODE (the MixGRPO / Flow-GRPO-Fast
window), and only those inside are trained.

A group that shares its starting noise and prompt (``same_latent``) is one
trajectory until its first stochastic step; ``shared_rows`` says which rows those
are, and the deterministic prefix is then computed once per group (with the window
on steps 0-4 and groups of 8, about a sixth of the sampling compute).

``keep_states`` keeps only the states an algorithm trains on (the decoupled ones need
the final latent alone, the GRPO family its window's steps): memory in proportion to
what is used, not to the number of steps.

``storage_dtype`` (``train.latent_storage_dtype``) stores the trajectory in half the
bytes. The state is rounded to it after every step, and a step's log-prob is that of the
rounded sample, so the stored trajectory is exactly the one sampled: training recomputes
each step from the very values the rollout used, and the on-policy ratio stays 1.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .dynamics import Dynamics
from .dynamics.ode import ODE
from .models.base import FlowAdapter
from .models.conditioning import Conditioning, index_cond


class KeptStates:
    """Latents kept at some of a trajectory's T + 1 states: ``latents`` (B, K, *latent) holds
    state ``latent_steps[k]`` (state i: the latent before step i; T: the final one) at ``k``."""

    latents: Tensor
    latent_steps: list[int] | None  # None: all T + 1 states
    sigmas: Tensor

    def __post_init__(self):
        if self.latent_steps is None:
            self.latent_steps = list(range(len(self.sigmas)))

    def latents_at(self, idx: Tensor, step: int | Tensor) -> Tensor:
        """(len(idx), *latent): sample ``idx[j]``'s state ``step`` (one for all, or one per row)."""
        where = {s: k for k, s in enumerate(self.latent_steps)}
        steps = torch.as_tensor(step).reshape(-1).tolist()
        missing = sorted(set(steps) - set(where))
        if missing:
            raise KeyError(f"states {missing} were not kept (kept: {self.latent_steps})")
        pos = torch.tensor([where[s] for s in steps], device=self.latents.device)
        return self.latents[idx.to(self.latents.device), pos]


@dataclass
class Trajectory(KeptStates):
    latents: Tensor  # (B, K, *latent) in the storage dtype (float32 by default): the kept states
    log_probs: Tensor  # (B, T) float32, log-prob of each step's sample (0 at ODE steps)
    sigmas: Tensor  # (T + 1,) float32
    sde_steps: list[int]  # the stochastic (trained) step indices, ascending
    means: Tensor | None = None  # (B, T, *latent): each step's Gaussian mean, when recorded
    latent_steps: list[int] | None = None  # the states ``latents`` holds; None: all T + 1
    final: Tensor | None = None  # (B, *latent): the last state, always kept (decode needs it)


@dataclass
class TrajectoryOptions:
    """What ``sample_trajectory`` does beyond integrating: which steps are stochastic, what it keeps, how
    the network runs.

    ``sde_steps``: the stochastic steps; None = every step uses the dynamics. ``record_means`` also keeps
    each step's mean (GRPO-Guard's ratio normalisation needs it). ``shared_rows`` (B,): rows with equal ids
    have equal ``noise`` and ``cond``; the steps before the first stochastic one are then integrated once per
    id. ``storage_dtype``: the trajectory is kept (and integrated) at that precision; None = float32.
    ``keep_states``: the states (0 the noise .. T the final latent) the trajectory keeps; None = all.
    ``autocast``: the context the network's calls run under (mixed precision); the rest (the dynamics,
    log-probs and the trajectory's storage) runs outside it, in float32 and the storage dtype (precision.py).
    """

    sde_steps: list[int] | None = None
    record_means: bool = False
    shared_rows: Tensor | None = None
    storage_dtype: torch.dtype | None = None
    keep_states: list[int] | None = None
    autocast: Callable = nullcontext


@torch.no_grad()
def sample_trajectory(adapter: FlowAdapter, dynamics: Dynamics, cond: Conditioning, noise: Tensor, sigmas: Tensor,
                      guidance_scale: float, *, generator: torch.Generator | None = None,
                      options: TrajectoryOptions | None = None) -> Trajectory:
    """Integrate from ``noise`` along ``sigmas``; ``generator`` draws the stochastic steps' noise (on the
    CPU); ``options``: the stochastic steps, what is kept, mixed precision (``TrajectoryOptions``)."""
    o = options or TrajectoryOptions()
    storage_dtype = o.storage_dtype
    keep = (lambda t: t) if storage_dtype is None else (lambda t: t.to(storage_dtype))
    num_steps = len(sigmas) - 1
    kept, stochastic, prefix = _window(dynamics, num_steps, o.sde_steps, o.keep_states)
    # a deterministic dynamics (ODE, DPM-Solver++2M) runs every step; an SDE only its window.
    # solver(): a fresh per-trajectory object, so a multistep solver's history starts empty
    solver, ode = dynamics.solver(), ODE()
    x = keep(noise.float()).float()
    latents, log_probs, means = [keep(x)] if 0 in kept else [], [], []
    groups = _shared_groups(o.shared_rows) if o.shared_rows is not None and prefix > 0 else None
    if groups is not None:  # integrate one row per group until the rows part
        first, expand = (t.to(x.device) for t in groups)
        full_cond, cond, x, latents = cond, index_cond(cond, first), x[first], [t[first] for t in latents]
    for i in range(num_steps):
        if groups is not None and i == prefix:
            x, latents, log_probs, means = _expand(expand, x, latents, log_probs, means)
            cond, groups = full_cond, None
        with o.autocast():
            v = adapter.velocity(x, sigmas[i], cond, guidance_scale)
        step_dynamics = solver if (i in stochastic or not dynamics.stochastic) else ode
        out = _step(step_dynamics, x, v, sigmas[i], sigmas[i + 1], generator)
        stored = keep(out.sample)
        if i + 1 in kept:
            latents.append(stored)
        x = stored.float()  # integrate on from the value stored
        if o.record_means:
            means.append(out.mean)
        if out.log_prob is None:
            log_probs.append(torch.zeros(x.shape[0], device=x.device))
        else:  # the density of the sample as stored (the same value when nothing is rounded)
            log_probs.append(out.log_prob if storage_dtype is None else step_dynamics.log_prob(x, out.mean, out.std))
    if groups is not None:  # deterministic to the end
        x, latents, log_probs, means = _expand(expand, x, latents, log_probs, means)
    final = keep(x)  # exactly the stored value: x is it in float32
    empty = final.new_empty((x.shape[0], 0, *x.shape[1:]))
    return Trajectory(torch.stack(latents, 1) if latents else empty, torch.stack(log_probs, 1), sigmas.float(),
                      sorted(stochastic), torch.stack(means, 1) if o.record_means else None, latent_steps=kept,
                      final=final)


def _window(dynamics: Dynamics, num_steps: int, sde_steps: list[int] | None,
            keep_states: list[int] | None) -> tuple[list[int], set[int], int]:
    """(the states kept, the stochastic steps, the first step that is not deterministic: ``num_steps`` when
    every step is (no stochastic step, or a deterministic dynamics))."""
    kept = list(range(num_steps + 1)) if keep_states is None else sorted(set(keep_states))
    if kept and not 0 <= kept[0] <= kept[-1] <= num_steps:
        raise ValueError(f"keep_states: states run 0..{num_steps}, got {kept}")
    if sde_steps is None:
        sde_steps = list(range(num_steps)) if dynamics.stochastic else []
    stochastic = set(sde_steps)
    prefix = min(stochastic, default=num_steps) if dynamics.stochastic else num_steps
    return kept, stochastic, prefix


def _step(step_dynamics: Dynamics, x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor,
          generator: torch.Generator | None):
    """One step of ``step_dynamics``; its noise is drawn on the CPU generator, so a seed means the same thing
    on any device."""
    step_noise = None
    if step_dynamics.stochastic:
        step_noise = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x.device)
    return step_dynamics.step(x, v, sigma, sigma_next, noise=step_noise)


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
