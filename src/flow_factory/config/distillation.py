"""What the torch-free config knows of the few-step distillation trainers (issue 39): DMD2, TDM and TDM-R1,
with Flow-Factory's keys and defaults, each registered in ``config/algorithms.py``'s ``ALGORITHM_SPECS`` (their
trainers ``algorithms/distillation/trainers.py`` and ``tdm_r1_trainer.py``, their roles ``trainer/roles.py``).

Each ``DistillationSpec`` names its trainable roles (each with upstream's default optimiser when a
config gives no ``optimizers`` entry for it), the frozen ``reference`` (the teacher), the phases of
one optimisation step (a role and how many passes; ``"ttur_fake_updates"`` means that key's value),
the keys only it reads with upstream's defaults, and ``distillation_problems`` gives upstream's rule
checks on a ``{key: value}`` mapping as messages, to report before anything loads.

Followed: Flow-Factory ``hparams/training_args/dmd2.py`` (the PeterWangyi/Flow-Factory fork at
091df9df205467bb9490e0b4ef0b3bcc420a2ebd, which X-GenGroup/Flow-Factory's ``tdm.py`` imports),
``tdm.py`` (X-GenGroup/Flow-Factory 15932582d7f0eec90c77406b9dda5cd4da7fd9b5) and ``tdm_r1.py``
(X-GenGroup/Flow-Factory d68609c26da2a8d96346cbf5ef4bdcc8581a684f). The maths is in
``flow_factory.algorithms.distillation``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ROLES = ("generator", "fake", "surrogate")  # trainable; "reference" is the frozen teacher
GENERATOR = "generator"  # the role the rollouts sample with and the checkpoint saves for diffusers
QUERY_INTERVALS = ("trajectory", "reverse")
QUERY_DISTRIBUTIONS = ("actual_uniform", "conditional_logit_normal", "source_uniform")


@dataclass(frozen=True)
class RoleOptimizer:
    """Upstream's per-role AdamW default (its other settings AdamW's: weight decay, eps, ...)."""

    learning_rate: float
    betas: tuple[float, float] = (0.9, 0.999)


@dataclass(frozen=True)
class DistillationSpec:
    name: str
    roles: tuple[str, ...]  # trainable roles, in upstream's materialisation order
    phases: tuple[tuple[str, int | str], ...]  # (role, passes) per optimisation step, in order
    optimizers: dict[str, RoleOptimizer]  # upstream's default per role
    keys: tuple[str, ...] = ()  # train keys only these trainers read
    defaults: dict = field(default_factory=dict)  # upstream's, for the keys above and the shared ones it sets
    rewards: bool = False  # trains on rewards (else data-free: rewards only for evaluation)
    dynamics: str = "ODE"  # deterministic rollouts: the generator's steps are replayed exactly
    num_inner_epochs: int = 1  # every generator update owns a fresh rollout


_DMD2_KEYS = ("ttur_fake_updates", "perturbation_timestep_range", "real_guidance_scale", "replay_rtol", "replay_atol")
_DMD2_DEFAULTS = {"ttur_fake_updates": 5, "perturbation_timestep_range": (0.02, 0.98), "real_guidance_scale": None,
                  "replay_rtol": 1e-4, "replay_atol": 1e-4, "gradient_step_per_epoch": 1}
_DMD2_OPTIMIZERS = {"generator": RoleOptimizer(1e-5), "fake": RoleOptimizer(1e-5)}
_TDM_KEYS = _DMD2_KEYS + ("use_huber", "huber_c", "tdm_snr_gamma", "tdm_importance_clip", "tdm_query_interval",
                          "tdm_query_distribution", "tdm_query_max_sigma", "tdm_query_logit_mean",
                          "tdm_query_logit_std")
_TDM_DEFAULTS = {**_DMD2_DEFAULTS, "num_inference_steps": 4, "use_huber": True, "huber_c": 1e-3,
                 "tdm_snr_gamma": 5.0, "tdm_importance_clip": 20.0, "tdm_query_interval": "trajectory",
                 "tdm_query_distribution": "actual_uniform", "tdm_query_max_sigma": 1.0,
                 "tdm_query_logit_mean": 0.0, "tdm_query_logit_std": 1.0}
_TDM_R1_KEYS = _TDM_KEYS + ("tdm_weight", "surrogate_preference_beta", "advantage_clip_range",
                            "surrogate_reference_beta", "surrogate_reference_threshold", "surrogate_clip_range",
                            "surrogate_slow_decay_min", "surrogate_slow_decay_max", "cfg_reward_scale",
                            "use_time_weighting")
_TDM_R1_DEFAULTS = {**_TDM_DEFAULTS, "use_huber": False, "global_std": True, "advantage_aggregation": "gdpo",
                    "tdm_weight": 0.3, "surrogate_preference_beta": 1.0, "advantage_clip_range": 5.0,
                    "surrogate_reference_beta": 1e-3, "surrogate_reference_threshold": 0.05,
                    "surrogate_clip_range": 1e-3, "surrogate_slow_decay_min": 1e-3, "surrogate_slow_decay_max": 0.3,
                    "cfg_reward_scale": 3.5, "use_time_weighting": True}

# DiffusionOPD (hparams/training_args/opd.py of the PeterWangyi/Flow-Factory fork at 091df9df): the student alone
# trains, with the run's one optimizer (train section's keys); its teachers are frozen LoRAs (``train.teachers``)
_OPD_KEYS = ("teachers", "loss_target", "self_normalize")
_OPD_DEFAULTS = {"timestep_range": 0.99, "group_size": 1, "loss_target": "xt", "self_normalize": False}
LOSS_TARGETS = ("xt", "v", "x0")
OPD_DYNAMICS = ("ODE", "Flow-SDE", "Dance-SDE", "CPS")  # a step's mean a function of its state and velocity alone

DISTILLATION_SPECS = {spec.name: spec for spec in (
    DistillationSpec("dmd2", ("generator", "fake"), (("fake", "ttur_fake_updates"), ("generator", 1)),
                     _DMD2_OPTIMIZERS, _DMD2_KEYS, _DMD2_DEFAULTS),
    DistillationSpec("tdm", ("generator", "fake"), (("fake", "ttur_fake_updates"), ("generator", 1)),
                     _DMD2_OPTIMIZERS, _TDM_KEYS, _TDM_DEFAULTS),  # TDM reuses DMD2's optimisers
    DistillationSpec("tdm-r1", ("generator", "fake", "surrogate"),
                     (("fake", "ttur_fake_updates"), ("surrogate", 1), ("generator", 1)),
                     {"generator": RoleOptimizer(7.5e-5, (0.0, 0.999)), "fake": RoleOptimizer(3e-4, (0.0, 0.999)),
                      "surrogate": RoleOptimizer(3e-4, (0.9, 0.999))},
                     _TDM_R1_KEYS, _TDM_R1_DEFAULTS, rewards=True),
    DistillationSpec("diffusion-opd", ("generator",), (("generator", 1),), {}, _OPD_KEYS, _OPD_DEFAULTS),
)}


def distilled_steps(num_steps: int, timestep_range) -> range:
    """DiffusionOPD's distilled rollout steps: ``[int(T lo), max(lo + 1, int(T hi)))`` of the ``T`` steps,
    ``timestep_range`` ``f`` meaning ``(lo, hi) = (0, f)`` (upstream's ``resolve_distill_step_band``)."""
    lo, hi = (0.0, float(timestep_range)) if isinstance(timestep_range, (int, float)) else timestep_range
    first = int(num_steps * lo)
    return range(first, min(num_steps, max(first + 1, int(num_steps * hi))))


def micro_steps_per_sample(name: str, num_inference_steps: int, timestep_range=1.0) -> int:
    """What one sample's rollout counts in the epoch's micro-steps (``gradient_accumulation_steps``), as upstream
    counts its replay units: DMD2 trains one drawn step of it, TDM and TDM-R1 every transition, DiffusionOPD each
    distilled step (``timestep_range``)."""
    if name == "diffusion-opd":
        return len(distilled_steps(num_inference_steps, timestep_range))
    return 1 if name == "dmd2" else num_inference_steps


def resolved(name: str, values: dict) -> dict:
    """``values`` over the spec's defaults."""
    return {**DISTILLATION_SPECS[name].defaults, **values}


def _finite(value, low: float | None = None, *, strict: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return low is None or (value > low if strict else value >= low)


def _dmd2_problems(v: dict, name: str) -> list[str]:
    """The checks of every distillation trainer (DMD2's arguments and the replay's requirements)."""
    out, ttur, rng = [], v["ttur_fake_updates"], v["perturbation_timestep_range"]
    if isinstance(ttur, bool) or not isinstance(ttur, int) or ttur < 1:
        out.append(f"train.ttur_fake_updates: an integer >= 1, got {ttur!r}")
    if not (isinstance(rng, (list, tuple)) and len(rng) == 2 and all(_finite(x, 0.0) for x in rng)
            and 0.0 <= rng[0] < rng[1] <= 1.0):
        out.append(f"train.perturbation_timestep_range: [lower, upper] with 0 <= lower < upper <= 1, got {rng!r}")
    if v["real_guidance_scale"] is not None and not _finite(v["real_guidance_scale"], 1.0):
        out.append(f"train.real_guidance_scale: null or a number >= 1, got {v['real_guidance_scale']!r}")
    for key in ("replay_rtol", "replay_atol"):
        if not _finite(v[key], 0.0):
            out.append(f"train.{key}: a finite number >= 0, got {v[key]!r}")
    if v.get("num_inner_epochs", 1) != 1:
        out.append(f"train.num_inner_epochs: {name} needs 1 (every generator update owns a fresh rollout)")
    if v.get("optimizer_steps_per_epoch", 1) > 1:
        out.append(f"train.gradient_step_per_epoch / gradient_accumulation_steps: {name} takes one generator step per "
                   "epoch (every generator update owns a fresh rollout: a later step would train on states its last "
                   f"step moved away from, which the rollout replay stops), got {v['optimizer_steps_per_epoch']}")
    if v.get("dynamics_type", "ODE") != "ODE":
        out.append(f"scheduler.dynamics_type: {name} replays deterministic ODE rollouts; use ODE")
    steps = v.get("num_inference_steps", 1)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        out.append(f"train.num_inference_steps: an integer >= 1, got {steps!r}")
    return out


def _tdm_problems(v: dict) -> list[str]:
    """TDM's own checks: its loss and its score-query policy."""
    out = []
    if not isinstance(v["use_huber"], bool):
        out.append(f"train.use_huber: true or false, got {v['use_huber']!r}")
    for key in ("huber_c", "tdm_snr_gamma", "tdm_importance_clip", "tdm_query_logit_std"):
        if not _finite(v[key], 0.0, strict=True):
            out.append(f"train.{key}: a finite number > 0, got {v[key]!r}")
    if v["tdm_query_interval"] not in QUERY_INTERVALS:
        out.append(f"train.tdm_query_interval: one of {list(QUERY_INTERVALS)}, got {v['tdm_query_interval']!r}")
    if v["tdm_query_distribution"] not in QUERY_DISTRIBUTIONS:
        out.append(f"train.tdm_query_distribution: one of {list(QUERY_DISTRIBUTIONS)}, "
                   f"got {v['tdm_query_distribution']!r}")
    if not (_finite(v["tdm_query_max_sigma"], 0.0, strict=True) and v["tdm_query_max_sigma"] <= 1):
        out.append(f"train.tdm_query_max_sigma: in (0, 1], got {v['tdm_query_max_sigma']!r}")
    if not _finite(v["tdm_query_logit_mean"]):
        out.append(f"train.tdm_query_logit_mean: a finite number, got {v['tdm_query_logit_mean']!r}")
    return out


def _tdm_r1_problems(v: dict) -> list[str]:
    """TDM-R1's own checks: the reward mix, the surrogate's knobs, the slow copy's decays."""
    out = []
    if not (_finite(v["tdm_weight"]) and 0.0 < v["tdm_weight"] < 1.0):
        out.append("train.tdm_weight: in (0, 1); it mixes the guidance reward against the surrogate reward as "
                   f"tdm_weight * cfg_reward + (1 - tdm_weight) * surrogate_reward, got {v['tdm_weight']!r}")
    for key in ("surrogate_preference_beta", "advantage_clip_range", "surrogate_reference_threshold"):
        if not _finite(v[key], 0.0, strict=True):
            out.append(f"train.{key}: a finite number > 0, got {v[key]!r}")
    for key in ("surrogate_reference_beta", "cfg_reward_scale", "surrogate_clip_range"):
        if not _finite(v[key], 0.0):
            out.append(f"train.{key}: a finite number >= 0, got {v[key]!r}")
    lo, hi = v["surrogate_slow_decay_min"], v["surrogate_slow_decay_max"]
    for key, d in (("surrogate_slow_decay_min", lo), ("surrogate_slow_decay_max", hi)):
        if not (_finite(d, 0.0) and d <= 1.0):
            out.append(f"train.{key}: in [0, 1], got {d!r}")
    if _finite(lo) and _finite(hi) and lo > hi:
        out.append(f"train.surrogate_slow_decay_min ({lo}) must not exceed train.surrogate_slow_decay_max ({hi})")
    if not isinstance(v["use_time_weighting"], bool):
        out.append(f"train.use_time_weighting: true or false, got {v['use_time_weighting']!r}")
    if v.get("advantage_aggregation", "gdpo") not in ("sum", "gdpo"):
        out.append(f"train.advantage_aggregation: 'sum' or 'gdpo', got {v['advantage_aggregation']!r}")
    return out


def _opd_problems(v: dict) -> list[str]:
    """DiffusionOPD's checks: its dynamics and target space, and its teachers (each a LoRA, named once)."""
    out, dynamics, target = [], v.get("dynamics_type", "ODE"), v["loss_target"]
    if dynamics not in OPD_DYNAMICS:
        out.append(f"scheduler.dynamics_type: diffusion-opd matches one step's mean at a time, which "
                   f"{dynamics}'s multistep history does not have; use one of {list(OPD_DYNAMICS)}")
    if target not in LOSS_TARGETS:
        out.append(f"train.loss_target: one of {list(LOSS_TARGETS)}, got {target!r}")
    elif target != "xt" and dynamics != "ODE":
        out.append(f"train.loss_target: {target!r} compares velocities, defined for ODE rollouts only; use "
                   "scheduler.dynamics_type: ODE, or loss_target: xt (the step's mean, over its variance)")
    if not isinstance(v["self_normalize"], bool):
        out.append(f"train.self_normalize: true or false, got {v['self_normalize']!r}")
    teachers = v.get("teachers") or []  # not in the spec's defaults: none given is the error below
    if not teachers:
        out.append("train.teachers: diffusion-opd distils at least one teacher: [{name, path, "
                   "applicable_datasets, guidance_scale}], each path a LoRA of the base model")
    names = [t.name for t in teachers]
    for i, teacher in enumerate(teachers):
        if names.index(teacher.name) != i:
            out.append(f"train.teachers[{i}].name: {teacher.name!r} is used twice; each teacher's name is its own")
        if not teacher.applicable_datasets and len(teachers) > 1:
            out.append(f"train.teachers[{i}].applicable_datasets: with several teachers each names the datasets "
                       "whose samples it scores (data.datasets' names)")
    return out


def teacher_routing_problems(teachers, datasets: list[str] | None, eval_only: tuple[str, ...] = ()) -> list[str]:
    """Each teacher names datasets of the run that train (``datasets``: their names in data.datasets; None: the
    one dataset of ``data.dataset_dir``), and each of those has exactly one teacher. An evaluation-only dataset
    (``eval_only``) has none: the student alone samples its test prompts, as upstream, whose teachers name training
    datasets only."""
    out, owner = [], {}
    for i, teacher in enumerate(teachers):
        for name in teacher.applicable_datasets:
            if name in eval_only:
                out.append(f"train.teachers[{i}].applicable_datasets: {name!r} is evaluation-only (train: false): "
                           "no rollout of it is distilled, so no teacher serves it; leave it out")
            elif datasets is None:
                out.append(f"train.teachers[{i}].applicable_datasets: names {name!r}, but the run reads one dataset "
                           "(data.dataset_dir), which its one teacher serves: leave applicable_datasets out, or "
                           "name the datasets in data.datasets")
            elif name not in datasets:
                out.append(f"train.teachers[{i}].applicable_datasets: {name!r} is not a dataset of the run; "
                           f"data.datasets names {datasets}")
            elif name in owner:
                out.append(f"train.teachers[{i}].applicable_datasets: {name!r} is teachers[{owner[name]}]'s "
                           "already; one teacher per dataset")
            else:
                owner[name] = i
    serves_all = len(teachers) == 1 and not teachers[0].applicable_datasets
    orphans = [] if serves_all or datasets is None else [d for d in datasets if d not in owner]
    if teachers and orphans:
        out.append(f"train.teachers: no teacher serves the datasets {orphans}; name each in one teacher's "
                   "applicable_datasets")
    if datasets is None and len(teachers) > 1:
        out.append(f"train.teachers: {len(teachers)} teachers and one dataset (data.dataset_dir); give each "
                   "teacher its datasets in data.datasets")
    return out


def distillation_problems(name: str, values: dict) -> list[str]:
    """Upstream's rule checks (its training arguments' ``__post_init__`` and trainers' constructors) on
    ``values`` (the train keys a config gives; the rest take the defaults), as messages."""
    if name not in DISTILLATION_SPECS:
        return [f"train.trainer_type: {name!r} is not a distillation trainer; valid: {list(DISTILLATION_SPECS)}"]
    v = resolved(name, values)
    if name == "diffusion-opd":
        return _opd_problems(v)
    out = _dmd2_problems(v, name)
    if name in ("tdm", "tdm-r1"):
        out += _tdm_problems(v)
    if name == "tdm-r1":
        out += _tdm_r1_problems(v)
    return out


# ------------------------------------------------------------------ per-role optimisers
# an ``optimizers:`` entry's keys (Flow-Factory's: name, learning_rate, weight_decay, betas, eps, max_grad_norm;
# ``optimizer`` and the muon_* keys are ours, as the train section spells them) -> the role's setting; and
# ``ema_decay``, ours: an EMA of that role (upstream's train.ema_* keys are the generator's EMA alone, its other
# roles' copies made by the trainers, not asked for: Jayce-Ping/Flow-Factory-Draft models/roles.py at 34319d5c)
ROLE_OPTIMIZER_KEYS = ("name", "optimizer", "learning_rate", "weight_decay", "betas", "eps", "max_grad_norm",
                       "muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_adjust_lr", "ema_decay")
OPTIMIZER_KINDS = ("adamw", "muon")


@dataclass(frozen=True)
class RoleOptimizerSettings:
    """One role's optimiser, resolved: the entry's keys over upstream's default for the role (learning rate,
    betas) over the train section's (the rest); and its EMA's decay (0: none; the generator's is train.ema_decay)."""

    role: str
    optimizer: str = "adamw"
    learning_rate: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-4
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_adjust_lr: str = "match_rms_adamw"
    ema_decay: float = 0.0


def _entry_problems(where: str, entry) -> list[str]:
    """The values of one entry's keys (its name and keys are checked by ``role_optimizer_problems``)."""
    out = []
    if entry.get("optimizer", "adamw") not in OPTIMIZER_KINDS:
        out.append(f"{where}.optimizer: one of {list(OPTIMIZER_KINDS)}, got {entry['optimizer']!r}")
    for key, strict in (("learning_rate", True), ("weight_decay", False), ("eps", True), ("max_grad_norm", True)):
        if key in entry and not _finite(entry[key], 0.0, strict=strict):
            out.append(f"{where}.{key}: a finite number {'>' if strict else '>='} 0, got {entry[key]!r}")
    betas = entry.get("betas", (0.9, 0.999))
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_finite(b, 0.0) and b < 1 for b in betas)):
        out.append(f"{where}.betas: [beta1, beta2], each in [0, 1), got {betas!r}")
    if "muon_momentum" in entry and not (_finite(entry["muon_momentum"], 0.0) and entry["muon_momentum"] < 1):
        out.append(f"{where}.muon_momentum: in [0, 1), got {entry['muon_momentum']!r}")
    steps = entry.get("muon_ns_steps", 5)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        out.append(f"{where}.muon_ns_steps: an integer >= 1, got {steps!r}")
    if entry.get("muon_adjust_lr", "match_rms_adamw") not in ("match_rms_adamw", "original"):
        out.append(f"{where}.muon_adjust_lr: 'match_rms_adamw' or 'original', got {entry['muon_adjust_lr']!r}")
    if "ema_decay" in entry and entry.get("name") == GENERATOR:  # one home: what eval and off_policy read
        out.append(f"{where}.ema_decay: the generator's EMA is train.ema_decay (with train.ema_decay_schedule, "
                   "ema_update_interval and ema_device); ema_decay here is for the other roles")
    elif "ema_decay" in entry and not (_finite(entry["ema_decay"], 0.0) and entry["ema_decay"] < 1):
        out.append(f"{where}.ema_decay: in [0, 1) (0: no EMA of this role), got {entry['ema_decay']!r}")
    return out


def role_optimizer_problems(name: str, entries) -> list[str]:
    """What is wrong with the ``optimizers:`` entries of trainer ``name``: each a mapping naming one of its
    trainable roles once, with known keys and valid values."""
    roles = DISTILLATION_SPECS[name].roles
    if not isinstance(entries, list):
        return [f"optimizers: a list of {{name: <role>, ...}} entries, got {entries!r}"]
    out, seen = [], set()
    for i, entry in enumerate(entries):
        where = f"optimizers[{i}]"
        if not isinstance(entry, dict):
            out.append(f"{where}: a mapping {{name: <role>, learning_rate: ...}}, got {entry!r}")
            continue
        role = entry.get("name")
        if role not in roles:
            out.append(f"{where}.name: {role!r} is not a trainable role of {name}; valid: {list(roles)}")
        elif role in seen:
            out.append(f"{where}.name: {role!r} is named twice; one entry per role")
        seen.add(role)
        unknown = sorted(set(entry) - set(ROLE_OPTIMIZER_KEYS))
        if unknown:
            out.append(f"{where}: unknown keys {unknown}; valid: {', '.join(ROLE_OPTIMIZER_KEYS)}")
        out += _entry_problems(where, entry)
    return out


def role_optimizers(name: str, entries: list[dict], train) -> dict[str, RoleOptimizerSettings]:
    """Each trainable role's optimiser (checked entries, ``role_optimizer_problems``): its entry, else upstream's
    default for the role (learning rate, betas), the train section's ``adam_*``, ``muon_*``, ``max_grad_norm``
    and ``optimizer`` for what neither gives; its ``ema_decay``, else no EMA of it."""
    spec, given = DISTILLATION_SPECS[name], {e["name"]: e for e in entries}
    out = {}
    for role in spec.roles:
        # a trainer with no default of its own for a role (diffusion-opd's one) takes the train section's
        entry = given.get(role, {})
        default = spec.optimizers.get(role) or RoleOptimizer(train.learning_rate, train.betas)
        out[role] = RoleOptimizerSettings(
            role, entry.get("optimizer", train.optimizer), float(entry.get("learning_rate", default.learning_rate)),
            tuple(float(b) for b in entry.get("betas", default.betas)),
            float(entry.get("weight_decay", train.adam_weight_decay)), float(entry.get("eps", train.adam_epsilon)),
            float(entry.get("max_grad_norm", train.max_grad_norm)),
            float(entry.get("muon_momentum", train.muon_momentum)),
            bool(entry.get("muon_nesterov", train.muon_nesterov)),
            int(entry.get("muon_ns_steps", train.muon_ns_steps)), entry.get("muon_adjust_lr", train.muon_adjust_lr),
            float(entry.get("ema_decay", 0.0)))
    return out


def _launch_config(config_file) -> dict:
    """The accelerate config ``config_file`` names ({}: none, or unreadable)."""
    if config_file is None:
        return {}
    import yaml

    from ..launch_configs import resolve

    try:
        found = yaml.safe_load(resolve(config_file).read_text())
    except (OSError, ValueError, yaml.YAMLError, AttributeError):
        return {}
    return found if isinstance(found, dict) else {}


def _launch_kind(config_file) -> str | None:
    """The ``distributed_type`` of the accelerate config ``config_file`` names (None: none, or unreadable)."""
    return _launch_config(config_file).get("distributed_type")


def _sharded_role_problems(cfg, kind: str, others: str) -> list[str]:
    """What FSDP2 (``kind`` FSDP) and DeepSpeed cannot train of a run with roles (``trainer/roles.py``): FSDP2
    shards every role (LoRA: adapters of the one transformer it shards; full: each copy and the teacher sharded
    too), each role's optimizer over its own shards; DeepSpeed ZeRO-1/2 hold the generator's optimizer in the engine
    and train the other roles' LoRA adapters beside it, each with its own optimizer, as DDP does; diffusion-opd's
    teachers are frozen adapters beside the student's there (``Roles._beside_engine``), and under FSDP2 shards of the
    transformer as the roles' adapters are."""
    train, name, where = cfg.train, cfg.train.trainer_type, f"config_file: {cfg.config_file} runs {kind}"
    teachers_only = len(DISTILLATION_SPECS[name].roles) == 1  # diffusion-opd: one optimizer, teachers beside it
    if kind == "DEEPSPEED" and cfg.model.finetune_type != "lora" and not teachers_only:  # opd: its own error
        return [f"{where}: without LoRA {name}'s other roles are whole copies of the transformer, outside DeepSpeed's "
                "one engine (which holds the generator's optimizer alone): each would train whole on every process, "
                "its AdamW state unpartitioned; use fsdp2 (each copy sharded), multi_gpu (DDP) or one process"]
    zero_stage = (_launch_config(cfg.config_file).get("deepspeed_config") or {}).get("zero_stage")
    if kind == "DEEPSPEED" and zero_stage == 3 and teachers_only:
        return [f"{where} with ZeRO-3, which partitions every weight of the network its engine wraps, {name}'s "
                f"{others} included, which this trainer does not gather for their queries; use zero1 or zero2 (the "
                "teachers whole, frozen, beside the student's LoRA), multi_gpu or one process"]
    if kind == "DEEPSPEED" and zero_stage == 3:
        return [f"{where} with ZeRO-3, which partitions every weight of the network its engine wraps, {name}'s "
                f"{others} included, and their own optimizers beside the engine cannot step partitions; use zero1 or "
                "zero2 (the other roles' adapters whole, trained beside the engine), fsdp2, multi_gpu or one process"]
    if role_optimizer_problems(name, train.role_optimizers):
        return []  # reported already
    return [f"optimizers: the {role} role's optimizer is muon, which updates each weight matrix whole, but {where} "
            "and shards them; use adamw for it, or multi_gpu (DDP)"
            for role, chosen in role_optimizers(name, train.role_optimizers, train).items()
            if chosen.optimizer == "muon"]


def distillation_contradictions(cfg) -> list[str]:
    """What a run of a distillation trainer (or its ``optimizers:`` entries under another trainer) cannot be,
    checked before anything loads: upstream's rule checks, the entries, and what the roles do not do yet."""
    train, model, name = cfg.train, cfg.model, cfg.train.trainer_type
    if name not in DISTILLATION_SPECS:
        return [] if not train.role_optimizers else [
            f"optimizers: {len(train.role_optimizers)} entries by role name are read for the distillation trainers "
            f"({', '.join(DISTILLATION_SPECS)}); {name} trains one optimizer: give one entry, or the train keys"]
    spec = DISTILLATION_SPECS[name]
    values = {k: getattr(train, k) for k in spec.keys if hasattr(train, k)}
    steps = cfg.gradient_steps_per_epoch if cfg.gradient_accumulation else 1  # 0: the epoch's geometry's error
    values.update(num_inner_epochs=train.num_inner_epochs, optimizer_steps_per_epoch=steps,
                  num_inference_steps=train.num_inference_steps,
                  dynamics_type=cfg.scheduler.dynamics_type, advantage_aggregation=train.advantage_aggregation,
                  advantage_clip_range=train.adv_clip_range)
    out = distillation_problems(name, values) + role_optimizer_problems(name, train.role_optimizers)
    if name == "diffusion-opd":
        out += _opd_contradictions(cfg)
    # what the roles (trainer/roles.py) do not do yet, refused rather than done wrong
    kind = _launch_kind(cfg.config_file)
    others = "other roles (LoRA adapters or copies beside the generator)" if len(spec.roles) > 1 else \
        "teachers (LoRA adapters beside the student's)"
    if kind in ("FSDP", "DEEPSPEED"):
        out += _sharded_role_problems(cfg, kind, others)
    if spec.rewards and train.unique_sample_num_per_epoch % cfg.num_processes:
        out.append(f"train.unique_sample_num_per_epoch: {name}'s surrogate compares a group's samples within one "
                   f"micro-batch, so each of the {cfg.num_processes} processes must hold whole groups: make it a "
                   f"multiple of num_processes, got {train.unique_sample_num_per_epoch}")
    if list(model.trained_components) != ["transformer"]:
        out.append(f"model.target_components: {name} trains roles on one transformer; got "
                   f"{list(model.trained_components)}")
    if cfg.mixed_precision == "fp16":
        out.append(f"mixed_precision: fp16's gradient scaler is not built for {name}'s roles (one scaler would "
                   "serve several optimizers, or step beside the teachers); use bf16 or no")
    if spec.rewards and train.per_device_batch_size % train.group_size:
        out.append(f"train.per_device_batch_size: {name} trains whole groups (its surrogate compares a group's "
                   f"samples), so it must be a multiple of group_size {train.group_size}, got "
                   f"{train.per_device_batch_size}")
    if train.reward_optimization_overlap:
        out.append(f"train.reward_optimization_overlap: {name} trains on no reward; use false")
    if train.rollout_cache != "none":
        out.append(f"train.rollout_cache: {name} trains the generator on its own rollout's states, which a lossy "
                   "cache would change; use none")
    return out


def _opd_contradictions(cfg) -> list[str]:
    """DiffusionOPD's teachers against the rest of the config: each dataset routed to one teacher, LoRA."""
    several = cfg.data.datasets is not None
    datasets = [d.name for d in cfg.data.split_sources("train")] if several else None
    eval_only = tuple(d.name for d in cfg.data.sources if not d.train)
    out = teacher_routing_problems(cfg.train.teachers, datasets, eval_only)
    if cfg.model.finetune_type != "lora":
        out.append("model.finetune_type: diffusion-opd's teachers are LoRA adapters on the student's base model, "
                   "beside the student's own LoRA (upstream's trainer is LoRA-only too); use lora")
    return out
