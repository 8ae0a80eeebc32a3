"""Training objectives: each algorithm is a ``loss(policy, batch)`` and what its rollout records."""

from .base import Algorithm, Policy, TrainBatch
from .grpo import GRPO, clipped_policy_loss, clipped_surrogate
from .grpo_guard import GRPOGuard, normalized_log_ratio
from .kl import KL_TYPES, v_based_kl, x_based_kl

ALGORITHMS: dict[str, type[Algorithm]] = {"grpo": GRPO, "grpo-guard": GRPOGuard}


def make_algorithm(name: str, train_cfg, dynamics) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"train.trainer_type: unknown {name!r}; valid: {sorted(ALGORITHMS)}")
    return ALGORITHMS[name](train_cfg, dynamics)


__all__ = [
    "ALGORITHMS", "Algorithm", "GRPO", "GRPOGuard", "KL_TYPES", "Policy", "TrainBatch",
    "clipped_policy_loss", "clipped_surrogate", "make_algorithm", "normalized_log_ratio",
    "v_based_kl", "x_based_kl",
]
