"""Training objectives: each algorithm is what its rollout records and a loss over a micro-batch.

The config's ``train.trainer_type`` chooses here (a class of ``ALGORITHMS`` by its ``name``);
the algorithm reads its settings from the ``train`` section.
"""

from .awm import AWM, AWM_WEIGHTINGS, awm_log_prob
from .base import Algorithm, Policy, TrainBatch
from .crd import CRD, crd_policy_loss, decay_at, implicit_reward
from .decoupled import DecoupledAlgorithm, NoisedBatch
from .dgpo import DGPO, dgpo_loss, dsm_clip_mask, ema_ref_decay, group_preferences
from .dpo import DPO, OfflineDPO, best_and_worst, dpo_loss
from .dppo import DPPO, step_kl, trust_region_loss
from .grpo import GRPO, clipped_surrogate
from .grpo_guard import GRPOGuard, normalized_log_ratio
from .kl import KL_TYPES, v_based_kl, x_based_kl
from .nft import NFT, NFT_WEIGHTINGS, nft_loss, optimality_probability
from .sft import SFT, flow_matching_loss

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (GRPO, GRPOGuard, DPPO, NFT, AWM, DPO, DGPO, CRD, SFT,
                                                                   OfflineDPO)}


def make_algorithm(name: str, train_cfg, dynamics) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"train.trainer_type: unknown {name!r}; valid: {sorted(ALGORITHMS)}")
    return ALGORITHMS[name](train_cfg, dynamics)


__all__ = [
    "ALGORITHMS", "AWM", "AWM_WEIGHTINGS", "Algorithm", "CRD", "DGPO", "DPO", "DPPO", "OfflineDPO", "SFT", "DecoupledAlgorithm", "GRPO", "GRPOGuard",
    "KL_TYPES", "NFT", "NFT_WEIGHTINGS", "NoisedBatch", "Policy", "TrainBatch", "awm_log_prob",
    "best_and_worst", "clipped_surrogate", "crd_policy_loss", "decay_at", "dgpo_loss", "dpo_loss", "dsm_clip_mask",
    "ema_ref_decay", "flow_matching_loss", "group_preferences", "implicit_reward", "make_algorithm", "nft_loss",
    "normalized_log_ratio", "optimality_probability", "step_kl", "trust_region_loss", "v_based_kl", "x_based_kl",
]
