"""The algorithm registry: what the torch-free config knows of each ``train.trainer_type``, one line per algorithm.

Adding an algorithm: its file in ``algorithms/`` and its line here (docs/guides/adding-an-algorithm.md). The config
(``config/train.py``, ``config/schema.py``) and the trainer (``algorithms.ALGORITHMS``) both read this table; no
other file compares trainer names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .distillation import DISTILLATION_SPECS


@dataclass(frozen=True)
class AlgorithmSpec:
    """What the torch-free config knows of an algorithm (``train.trainer_type``), and where its class is. Adding an
    algorithm: its file in ``algorithms/`` and a line here (docs/guides/adding-an-algorithm.md)."""

    name: str
    # the sampler's SDE steps / the forward process / a dataset / a few-step generator's roles (config/distillation.py)
    family: Literal["coupled", "decoupled", "offline", "distillation"]
    algorithm: str  # "module:Class" in flow_factory.algorithms, imported by name (algorithms.ALGORITHMS)
    keys: tuple[str, ...] = ()  # train keys only it reads: set under another trainer, an error
    defaults: dict = field(default_factory=dict)  # Flow-Factory's for keys a config leaves out
    time_shift: float = 3.0  # what time_shift: null means
    # a training unit is a group's best-and-worst pair, made on one process (DPO): the epoch's micro-batches count
    # groups, which must split evenly over the processes
    pairs_per_group: bool = False
    dynamics: tuple[str, ...] = ()  # the only scheduler.dynamics_type it works with (empty: any of its family's)
    dynamics_why: str = ""  # why, for the error message
    # its loss reads a whole group at once (DGPO sums each group's preference over its members): the micro-batch of
    # all processes together must hold whole groups; the text says why, for the error message
    whole_groups_why: str = ""
    ema_kl: bool = False  # reads train.ema_kl_beta (a KL to its own EMA policy, AWM's): set for another, an error
    own_sampler: str = ""  # the weights it samples with, when its own copy (CRD's): train.off_policy is refused


_LOGIT_NORMAL_ONE_STEP = {"time_sampling_strategy": "logit_normal", "timestep_range": 0.99, "num_train_timesteps": 1}
# in the order the config's trainer_type lists them; Flow-Factory's training_args/<trainer>.py for the defaults
ALGORITHM_SPECS = {spec.name: spec for spec in (
    AlgorithmSpec("grpo", "coupled", "grpo:GRPO"),
    AlgorithmSpec("grpo-guard", "coupled", "grpo_guard:GRPOGuard", dynamics=("Flow-SDE",),
                  dynamics_why="re-normalises Flow-SDE's log-ratios"),
    AlgorithmSpec("dppo", "coupled", "dppo:DPPO", keys=("kl_mask_type", "kl_mask_threshold", "kl_guidance_scale")),
    AlgorithmSpec("nft", "decoupled", "nft:NFT"),
    AlgorithmSpec("awm", "decoupled", "awm:AWM", ema_kl=True),
    AlgorithmSpec("dpo", "decoupled", "dpo:DPO", defaults=_LOGIT_NORMAL_ONE_STEP, time_shift=1.0,
                  pairs_per_group=True),
    AlgorithmSpec("dgpo", "decoupled", "dgpo:DGPO", defaults={"timestep_range": 0.6},
                  whole_groups_why="sums each group's preference over its members",
                  keys=("dpo_beta", "use_shared_noise", "clip_dsm", "clip_kl", "kl_cfg", "switch_ema_ref",
                        "use_ema_ref", "ema_ref_max_decay", "ema_ref_ramp_rate", "ema_ref_device")),
    AlgorithmSpec("crd", "decoupled", "crd:CRD", defaults={"timestep_range": 0.99, "kl_beta": 0.1, "kl_cfg": 4.5},
                  own_sampler="its own sampling model (sampling_model_decay)",
                  keys=("crd_beta", "crd_loss_type", "use_old_for_loss", "adaptive_logp", "weight_temp",
                        "old_model_decay", "sampling_model_decay", "reward_adaptive_kl", "kl_cfg")),
    AlgorithmSpec("sft", "offline", "sft:SFT", defaults=_LOGIT_NORMAL_ONE_STEP, time_shift=1.0),
    AlgorithmSpec("offline-dpo", "offline", "dpo:OfflineDPO", defaults=_LOGIT_NORMAL_ONE_STEP, time_shift=1.0),
    AlgorithmSpec("dmd2", "distillation", "flow_factory.algorithms.distillation.trainers:DMD2",
                  keys=DISTILLATION_SPECS["dmd2"].keys, defaults={"num_train_timesteps": 1, "group_size": 1}),
    AlgorithmSpec("tdm", "distillation", "flow_factory.algorithms.distillation.trainers:TDM",
                  keys=DISTILLATION_SPECS["tdm"].keys,
                  defaults={"num_train_timesteps": 1, "group_size": 1, "num_inference_steps": 4}),
    AlgorithmSpec("tdm-r1", "distillation", "flow_factory.algorithms.distillation.tdm_r1_trainer:TDMR1",
                  keys=tuple(k for k in DISTILLATION_SPECS["tdm-r1"].keys if k != "advantage_clip_range"),
                  defaults={"num_train_timesteps": 1, "num_inference_steps": 4, "use_huber": False,
                            "global_std": True, "advantage_aggregation": "gdpo"}),
    AlgorithmSpec("diffusion-opd", "distillation", "flow_factory.algorithms.distillation.opd:DiffusionOPD",
                  keys=DISTILLATION_SPECS["diffusion-opd"].keys,
                  defaults={k: v for k, v in DISTILLATION_SPECS["diffusion-opd"].defaults.items()
                            if k in ("timestep_range", "group_size")}),
)}
TRAINER_TYPES = tuple(ALGORITHM_SPECS)
COUPLED_TRAINER_TYPES = tuple(n for n, a in ALGORITHM_SPECS.items() if a.family == "coupled")
# train on the forward process at their own timesteps (of rollouts, or of a dataset's images or videos)
DECOUPLED_TRAINER_TYPES = tuple(n for n, a in ALGORITHM_SPECS.items() if a.family != "coupled")
OFFLINE_TRAINER_TYPES = tuple(n for n, a in ALGORITHM_SPECS.items() if a.family == "offline")  # no rollout, reward
# train roles (a generator, a fake score, ...) over a frozen teacher, each with its own optimizer (trainer/roles.py)
DISTILLATION_TRAINER_TYPES = tuple(n for n, a in ALGORITHM_SPECS.items() if a.family == "distillation")
