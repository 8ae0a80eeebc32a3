"""A small stand-in for an epoch's rollouts, for the algorithms' micro-batch tests."""

import torch

from flow_factory.sampling import Rollouts


def rollouts_of(latents: torch.Tensor, sigmas: torch.Tensor, cond: dict) -> Rollouts:
    """An epoch's rollouts holding ``latents`` (N, T + 1, *latent), every state, of an ODE rollout."""
    n = len(latents)
    return Rollouts(prompts=[""] * n, group_ids=torch.arange(n), latents=latents,
                    log_probs=torch.zeros(n, len(sigmas) - 1), sigmas=sigmas, sde_steps=[], cond=cond,
                    media=torch.empty(0))


def toy_rollouts(n: int) -> Rollouts:
    """``n`` samples of a 2-step ODE rollout: (n, 3, 2, 2) latents (last = x0), sigmas 1 -> 0, and
    a conditioning row per sample holding its index, so a test can tell which samples a batch holds."""
    gen = torch.Generator().manual_seed(0)
    return rollouts_of(torch.randn(n, 3, 2, 2, generator=gen), torch.linspace(1, 0, 3),
                       {"prompt_embeds": torch.arange(n).float().unsqueeze(1)})
