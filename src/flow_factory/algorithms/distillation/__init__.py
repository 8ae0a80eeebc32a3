"""Few-step distillation objectives in the flow-matching parameterisation: DMD2 (arXiv:2405.14867),
TDM (arXiv:2503.06674) and TDM-R1 (arXiv:2603.07700), as Flow-Factory's distillation trainers define
them. Plain torch on tensors, one file per idea; the roles (generator, fake score, surrogate, frozen
reference) and their optimisers are the trainer's business, not these functions'.

Followed: X-GenGroup/Flow-Factory 15932582d7f0eec90c77406b9dda5cd4da7fd9b5 (``trainers/distillation/tdm.py``,
``tdm_r1.py``, ``tdm_time_sampling.py``, ``tdm_trajectory.py``; ``group_preference.py`` at b30dc004) and, for the
files that commit imports but the stored copy of X-GenGroup lacks (``trainers/distillation/dmd2.py``,
``distribution_matching.py``, ``hparams/training_args/dmd2.py``), the PeterWangyi/Flow-Factory fork at
091df9df205467bb9490e0b4ef0b3bcc420a2ebd, whose ``distribution_matching.py`` matches the calls of X-GenGroup's
``tdm.py``. The torch-free description of the trainers' keys is ``flow_factory.config.distillation``."""

from .dmd2 import distribution_matching_direction, dmd2_generator_loss, sample_boundary_index
from .fake_score import fake_score_loss, sample_perturbation_sigma
from .flow import add_noise, clean_from_velocity, guided_velocity, noise_from_velocity, velocity_target
from .tdm import (QUERY_DISTRIBUTIONS, QUERY_INTERVALS, conditional_renoise, query_interval, revised_x0_loss,
                  sample_query_sigma, snr_weight, student_prediction, tdm_fake_loss, tdm_generator_loss)
from .tdm_r1 import (TDMR1Settings, cfg_reward_correction, denoising_errors, runaway_mask, slow_surrogate_decay,
                     surrogate_loss, surrogate_masks, surrogate_reward_correction, tdm_r1_generator_loss, time_weight)

__all__ = [
    "QUERY_DISTRIBUTIONS", "QUERY_INTERVALS", "TDMR1Settings", "add_noise", "cfg_reward_correction", "clean_from_velocity",
    "conditional_renoise", "denoising_errors", "distribution_matching_direction", "dmd2_generator_loss",
    "fake_score_loss", "guided_velocity", "noise_from_velocity", "query_interval", "revised_x0_loss", "runaway_mask",
    "sample_boundary_index", "sample_perturbation_sigma", "sample_query_sigma", "slow_surrogate_decay", "snr_weight",
    "student_prediction", "surrogate_loss", "surrogate_masks", "surrogate_reward_correction", "tdm_fake_loss",
    "tdm_generator_loss", "tdm_r1_generator_loss", "time_weight", "velocity_target",
]
