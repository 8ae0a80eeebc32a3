"""Training objectives: each algorithm is what its rollout records and a loss over a micro-batch.

The config's ``train.trainer_type`` chooses here: ``ALGORITHMS`` holds the class each ``AlgorithmSpec``
(``config/algorithms.py``) names; the algorithm reads its settings from the ``train`` section.
"""

from importlib import import_module
from pathlib import Path

from ..config.algorithms import ALGORITHM_SPECS

from .awm import AWM, AWM_WEIGHTINGS, awm_log_prob
from .base import Algorithm, Policy, TrainBatch
from .crd import CRD, crd_policy_loss, decay_at, implicit_reward
from .decoupled import DecoupledAlgorithm, NoisedBatch
from .distillation.tdm_r1_trainer import TDMR1
from .distillation.trainers import DMD2, TDM
from .dgpo import DGPO, dgpo_loss, dsm_clip_mask, ema_ref_decay, group_preferences
from .dpo import DPO, OfflineDPO, best_and_worst, dpo_loss
from .dppo import DPPO, step_kl, trust_region_loss
from .grpo import GRPO, clipped_surrogate
from .grpo_guard import GRPOGuard, normalized_log_ratio
from .kl import KL_TYPES, v_based_kl, x_based_kl
from .nft import NFT, NFT_WEIGHTINGS, nft_loss, optimality_probability
from .sft import SFT, flow_matching_loss



def algorithm_class(path: str) -> type[Algorithm]:
    """The class an ``AlgorithmSpec.algorithm`` names: ``module:Class`` of this package (``grpo:GRPO``), or of
    any importable module."""
    module, _, name = path.partition(":")
    ours = (Path(__file__).parent / f"{module}.py").is_file()
    return getattr(import_module(f"{__name__}.{module}" if ours else module), name)


ALGORITHMS: dict[str, type[Algorithm]] = {name: algorithm_class(spec.algorithm) for name, spec in ALGORITHM_SPECS.items()}


def make_algorithm(name: str, train_cfg, dynamics) -> Algorithm:
    if name not in ALGORITHMS and name not in ALGORITHM_SPECS:
        raise ValueError(f"train.trainer_type: unknown {name!r}; valid: {sorted(ALGORITHM_SPECS)}")
    cls = ALGORITHMS[name] if name in ALGORITHMS else algorithm_class(ALGORITHM_SPECS[name].algorithm)
    return cls(train_cfg, dynamics)


__all__ = [
    "ALGORITHMS", "algorithm_class", "AWM", "AWM_WEIGHTINGS", "Algorithm", "CRD", "DGPO", "DMD2", "DPO", "TDM", "TDMR1", "DPPO", "OfflineDPO", "SFT", "DecoupledAlgorithm", "GRPO", "GRPOGuard",
    "KL_TYPES", "NFT", "NFT_WEIGHTINGS", "NoisedBatch", "Policy", "TrainBatch", "awm_log_prob",
    "best_and_worst", "clipped_surrogate", "crd_policy_loss", "decay_at", "dgpo_loss", "dpo_loss", "dsm_clip_mask",
    "ema_ref_decay", "flow_matching_loss", "group_preferences", "implicit_reward", "make_algorithm", "nft_loss",
    "normalized_log_ratio", "optimality_probability", "step_kl", "trust_region_loss", "v_based_kl", "x_based_kl",
]
