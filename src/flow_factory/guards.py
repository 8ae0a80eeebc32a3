"""Nothing non-finite reaches the weights.

One NaN reward makes its group's advantages NaN, the loss NaN, the gradient NaN, and
after one AdamW step every trained weight NaN, in every later checkpoint. So each
quantity on the way is checked: the rewards of an epoch (gathered from every process,
so all processes decide alike), the advantages, and the clipped gradient's norm of every
optimizer step (computed after the gradients are reduced across processes, so again the
same on every process; a NaN loss always shows there; under DeepSpeed its engine's own check of
the reduced gradients, which skips the step itself). What fails is skipped (the epoch's
update, or one optimizer step) and counted; ``train.max_nonfinite_in_a_row`` skips in a
row stop the run with ``NonFiniteError``, its weights those of the last finite update.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


class NonFiniteError(FloatingPointError):
    """Non-finite values the run cannot skip: too many in a row, weights that overflowed, or a
    model or checkpoint that holds them."""


class NonFiniteGuard:
    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0

    def passed(self) -> None:
        self.in_a_row = 0

    def skip(self, what: str) -> None:
        self.in_a_row += 1
        if self.in_a_row > self.limit:
            raise NonFiniteError(
                f"{what}; {self.in_a_row} non-finite updates in a row (train.max_nonfinite_in_a_row is "
                f"{self.limit}), so the run stops. No non-finite value reached the weights: they and the "
                "checkpoints are those of the last finite update")
        logger.warning("skipped: %s (%d in a row; the run stops after %d)", what, self.in_a_row, self.limit + 1)


def nonfinite_rewards(rewards: dict[str, Tensor]) -> str | None:
    """``"reward 'x' is NaN or inf for 1 of 8 samples"`` for each reward that has any, or None."""
    found = []
    for name, scores in rewards.items():
        bad = int((~torch.isfinite(scores)).sum())
        if bad:
            found.append(f"reward {name!r} is NaN or inf for {bad} of {scores.numel()} samples")
    return "; ".join(found) or None


def all_finite(tensors) -> bool:
    """One device sync for the whole list."""
    tensors = list(tensors)
    return not tensors or bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def nonfinite_tensors(module: torch.nn.Module) -> list[str]:
    """Names of the parameters and buffers of ``module`` that hold NaN or inf."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return [name for name, t in named if t.is_floating_point() and not torch.isfinite(t).all()]


def check_pipeline_finite(pipeline, source: str) -> None:
    """``NonFiniteError`` naming ``source`` when a component of a diffusers pipeline holds NaN or inf
    (garbled weights would train to NaN, and sample black images without a word)."""
    for name, component in pipeline.components.items():
        bad = nonfinite_tensors(component) if isinstance(component, torch.nn.Module) else []
        if bad:
            raise NonFiniteError(f"{source}: {name} holds NaN or inf in {len(bad)} tensors (e.g. {bad[0]})")
