"""Which denoising steps are stochastic (and trained) this epoch: the MixGRPO /
Flow-GRPO-Fast window.

``sde_steps`` lists the candidate step indices, ``num_sde_steps`` how many of them
are drawn per epoch. The caller passes a generator seeded by ``(scheduler.seed,
epoch)`` (the Trainer does): the same epoch draws the same window on every run, every
rank and after a resume, and different epochs draw independently.
"""

from __future__ import annotations

import torch


def choose_sde_steps(
    num_steps: int,
    candidates: list[int] | None,
    num_sde_steps: int | None,
    generator: torch.Generator,
) -> list[int]:
    """Draw ``num_sde_steps`` distinct step indices from ``candidates``, sorted ascending.

    ``candidates=None`` means every step ``0 .. num_steps - 1``; ``num_sde_steps=None``
    means all candidates. Raises ``ValueError`` for requests that cannot be met.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if candidates is None:
        candidates = list(range(num_steps))
    candidates = [int(c) for c in candidates]
    if not candidates:
        raise ValueError("sde_steps is empty: at least one step must be stochastic")
    out_of_range = [c for c in candidates if not 0 <= c < num_steps]
    if out_of_range:
        raise ValueError(
            f"sde_steps {out_of_range} out of range: "
            f"with {num_steps} steps valid indices are 0..{num_steps - 1}"
        )
    if len(set(candidates)) != len(candidates):
        raise ValueError(f"sde_steps has repeated indices: {candidates}")
    if num_sde_steps is None:
        num_sde_steps = len(candidates)
    if not 1 <= num_sde_steps <= len(candidates):
        raise ValueError(
            f"num_sde_steps={num_sde_steps} impossible: choose between 1 and {len(candidates)} "
            f"(the number of sde_steps candidates)"
        )
    # Always draw, even when every candidate is kept: a caller that reuses one generator
    # across draws then sees it advance by the same amount whatever the window size.
    order = torch.randperm(len(candidates), generator=generator)
    return sorted(candidates[i] for i in order[:num_sde_steps].tolist())
