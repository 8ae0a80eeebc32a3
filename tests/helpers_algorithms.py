"""A small stand-in for an epoch's rollouts, for the algorithms' micro-batch tests."""

from types import SimpleNamespace

import torch


def toy_rollouts(n: int) -> SimpleNamespace:
    """``n`` samples of a 2-step ODE rollout: (n, 3, 2, 2) latents (last = x0), sigmas 1 -> 0, and
    a conditioning row per sample holding its index, so a test can tell which samples a batch holds."""
    gen = torch.Generator().manual_seed(0)
    return SimpleNamespace(latents=torch.randn(n, 3, 2, 2, generator=gen), sigmas=torch.linspace(1, 0, 3),
                           cond={"prompt_embeds": torch.arange(n).float().unsqueeze(1)},
                           log_probs=torch.zeros(n, 2), sde_steps=[], means=None)
