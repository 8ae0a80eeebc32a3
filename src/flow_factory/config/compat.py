"""Flow-Factory's other spellings of our keys, and its keys this version does not take.

Flow-Factory's guides and examples span several versions of its schema. Its spellings
of our keys are accepted as written and read into the key that means the same here
(``read_flow_factory_spellings``); writing both spellings with different values is an
error. Keys whose meaning here is uncertain get a "did you mean" (``MOVED``); keys this
version does not take say why (``NOT_HERE``). Upstream silently ignores keys it does
not know; here a key works, is refused with its reason, or, accepted so that its configs
load, is named by a note when it does nothing in the run (``without_effect``).
"""

from __future__ import annotations

from typing import Any

from .base import DTYPE_NAMES, problem, show
from .algorithms import ALGORITHM_SPECS, DISTILLATION_TRAINER_TYPES
from .distillation import DISTILLATION_SPECS

# Flow-Factory's spellings (its guides' and its earlier layouts') -> ours, with the same meaning
# (step indices count from 0 in both)
SPELLINGS = {
    "train.advantage_clip_range": "train.adv_clip_range",  # TDM-R1's spelling of the same clip
    "train.train_steps": "scheduler.sde_steps",
    "train.num_train_steps": "scheduler.num_sde_steps",
    "scheduler.train_steps": "scheduler.sde_steps",
    "scheduler.num_train_steps": "scheduler.num_sde_steps",
    "train.dynamics_type": "scheduler.dynamics_type",
    "train.noise_level": "scheduler.noise_level",
    "train.timestep_fraction": "train.timestep_range",
    "run_name": "log.run_name", "project": "log.project", "logging_backend": "log.logging_backend",
    "train.save_freq": "log.save_freq", "train.save_dir": "log.save_dir", "train.eval_freq": "eval.eval_freq",
    "reward": "rewards", "eval_reward": "eval_rewards",  # its reward guide's first layout
    "model.trainable_parameters_dtype": "model.master_weight_dtype",
    "train.weighting_scheme": "train.time_sampling_strategy",  # dpo's uniform / logit_normal
}
# keys Flow-Factory has whose only value here is its default: (path, the value)
FIXED = {"train.logit_mean": (0, "the logit-normal timesteps are the standard one, mean 0"),
         "train.logit_std": (1, "the logit-normal timesteps are the standard one, std 1"),
         "train.teacher_param_device": ("cuda", "diffusion-opd's teachers are LoRA adapters of the transformer, on "
                                        "its device")}
# LTX-2's sampling keys, at the values of Flow-Factory's LTX-2 examples (models/ltx2.py)
_LTX2_GUIDANCE = "LTX-2 samples with classifier-free guidance alone here, as Flow-Factory's LTX-2 examples set it"
_LTX2_FIXED = {
    "stg_scale": (0, _LTX2_GUIDANCE + " (no spatio-temporal guidance)"),
    "modality_scale": (1, _LTX2_GUIDANCE + " (no modality-isolation guidance)"),
    "guidance_rescale": (0, _LTX2_GUIDANCE + " (no rescale)"),
    **{f"audio_{key}": (None, "the audio takes the video's value here") for key in
       ("guidance_scale", "stg_scale", "modality_scale", "guidance_rescale")},
    "system_prompt": (None, "prompt enhancement is not in this version"),
    "prompt_enhancement_seed": (10, "prompt enhancement is not in this version"),
}
FIXED.update({f"{section}.{key}": fixed for section in ("train", "eval") for key, fixed in _LTX2_FIXED.items()})
# the single optimizer of Flow-Factory's newest layout (``optimizers: [{...}]``) -> train keys
OPTIMIZER_KEYS = {"optimizer": "optimizer", "learning_rate": "learning_rate", "weight_decay": "adam_weight_decay",
                  "betas": "adam_betas", "eps": "adam_epsilon", "max_grad_norm": "max_grad_norm"}
# the single dataset of its newest layout (``data.datasets: [{...}]``) -> ours
DATASET_KEYS = {"dataset_dir": "data.dataset_dir", "image_dir": "data.image_dir", "video_dir": "data.video_dir",
                "audio_dir": "data.audio_dir",
                "train.max_dataset_size": "data.max_dataset_size",
                "eval.max_dataset_size": "eval.num_samples", "eval.resolution": "eval.resolution",
                "eval.num_inference_steps": "eval.num_inference_steps", "eval.guidance_scale": "eval.guidance_scale"}

# keys of older Flow-Factory layouts whose meaning here is not certain: a pointer, not a guess
MOVED = {
    "train.sde_type": "scheduler.dynamics_type", "train.noise_steps": "scheduler.sde_steps",
    "train.num_noise_steps": "scheduler.num_sde_steps", "train.eval_args": "eval",
}

NOT_HERE = {
    "model.component_load_dtypes": "the frozen networks take mixed_precision's dtype here",
}


def _pop(data: dict, path: str) -> tuple[bool, Any]:
    section, _, key = path.rpartition(".")
    holder = data.get(section) if section else data
    if isinstance(holder, dict) and key in holder:
        return True, holder.pop(key)
    return False, None


def _put(data: dict, path: str, value, written: str) -> None:
    """``data[path] = value`` unless the config already says otherwise there (then an error naming both)."""
    section, _, key = path.rpartition(".")
    target = data
    if section:
        target = data.get(section)
        if target is None:
            target = data[section] = {}
        if not isinstance(target, dict):
            return  # the section's own error says it must be a mapping
    if key in target and target[key] != value:
        raise problem(f"{written}: {show(value)} and {path}: {show(target[key])} are two spellings of one "
                      f"setting with different values; keep one")
    target[key] = value


def _only_entry(value, key: str, why: str) -> dict:
    if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], dict):
        raise problem(f"{key}: expected a list of one mapping ({why}), got {show(value)}")
    return dict(value[0])


def read_flow_factory_spellings(data: dict) -> dict:
    """A copy of the raw config with Flow-Factory's spellings (``SPELLINGS``, a one-entry
    ``optimizers`` or ``data.datasets`` list, ``model.resume_training_state``) written as ours."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for written, ours in SPELLINGS.items():
        found, value = _pop(data, written)
        if found:
            _put(data, ours, value, written)
    for path, (value, why) in FIXED.items():
        found, given = _pop(data, path)
        if found and given != value:
            raise problem(f"{path}: {show(given)}; only {value} here: {why}")
    found, resume_state = _pop(data, "model.resume_training_state")
    if found and resume_state is True:
        _put(data, "model.resume_type", "state", "model.resume_training_state: true")
    found, optimizers = _pop(data, "optimizers")
    trainer_type = (data.get("train") or {}).get("trainer_type") if isinstance(data.get("train"), dict) else None
    # one entry per role, by name (checked with the trainer); a trainer of one role (diffusion-opd) has the one
    if found and trainer_type in DISTILLATION_TRAINER_TYPES and len(DISTILLATION_SPECS[trainer_type].roles) > 1:
        _put(data, "train.role_optimizers", optimizers, "optimizers")
    elif found:
        optimizer = _only_entry(optimizers, "optimizers", "one optimizer trains the transformer here; several, "
                                f"one per role by name, for {', '.join(DISTILLATION_TRAINER_TYPES)}")
        optimizer.pop("name", None)
        unknown = sorted(set(optimizer) - set(OPTIMIZER_KEYS))
        if unknown:
            raise problem(f"optimizers[0]: unknown keys {unknown}; valid: name, {', '.join(OPTIMIZER_KEYS)}")
        for key, value in optimizer.items():
            _put(data, f"train.{OPTIMIZER_KEYS[key]}", value, f"optimizers[0].{key}")
    found, size = _pop(data, "data.condition_image_size")
    if found:  # Flow-Factory's earlier layout: one size for both splits, which eval's own key overrides
        _put(data, "train.condition_image_size", size, "data.condition_image_size")
        if "condition_image_size" not in (data.get("eval") or {}):
            _put(data, "eval.condition_image_size", size, "data.condition_image_size")
    found, datasets = _pop(data, "data.datasets")
    if found and _upstream_layout(datasets) and len(datasets) == 1:
        _read_dataset(data, dict(datasets[0]))
    elif found and _upstream_layout(datasets):
        _put(data, "data.datasets", _read_datasets(datasets), "data.datasets")
    elif found:  # ours: [{name, dataset_dir, weight, ...}]
        data.setdefault("data", {})["datasets"] = datasets
    _read_ema_warmup(data)
    _read_frozen_dtypes(data)
    _read_acceleration(data)
    return data


def _read_acceleration(data: dict) -> None:
    """Flow-Factory's ``acceleration`` block: its ``shared`` accelerators are our model keys
    (``attention_backend`` -> ``model.attn_backend``, ``torch_compile`` -> ``model.torch_compile``, its
    mode auto / regional / full meaning the same); its lossy ``rollout`` feature caching (``diffusers_cache``)
    is ``train.rollout_cache`` with its policy's params."""
    found, block = _pop(data, "acceleration")
    if not found or block is None:
        return
    if not isinstance(block, dict) or set(block) - {"shared", "rollout"}:
        raise problem(f"acceleration: expected a mapping with shared and rollout lists, got {show(block)}")
    rollout = block.get("rollout") or []
    for i, entry in enumerate(rollout if isinstance(rollout, list) else [rollout]):
        where = f"acceleration.rollout[{i}]"
        if not isinstance(entry, dict) or entry.get("name") != "diffusers_cache" or i > 0:
            raise problem(f"{where}: {show(entry)}; one rollout accelerator is taken here, "
                          "{name: diffusers_cache, params: {policy, ...}}")
        params = dict(entry.get("params") or {})
        _put(data, "train.rollout_cache", params.pop("policy", "first_block"), f"{where}.params.policy")
        _put(data, "train.rollout_cache_params", params, f"{where}.params")
    shared = block.get("shared") or []
    for i, entry in enumerate(shared if isinstance(shared, list) else [shared]):
        where = f"acceleration.shared[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("params", {}), dict):
            raise problem(f"{where}: expected {{name, params}}, got {show(entry)}")
        name, params = entry.get("name"), dict(entry.get("params") or {})
        if name == "attention_backend":
            if "backend" not in params:
                raise problem(f"{where}.params.backend: attention_backend needs a backend (native, flash, sage, ...)")
            _put(data, "model.attn_backend", params.pop("backend"), f"{where}.params.backend")
        elif name == "torch_compile":
            _put(data, "model.torch_compile", params.pop("mode", "auto"), f"{where}.params.mode")
            kwargs = dict(params.pop("compile_kwargs", None) or {})
            if "mode" in kwargs:
                _put(data, "model.compile_mode", kwargs.pop("mode"), f"{where}.params.compile_kwargs.mode")
            if kwargs:
                raise problem(f"{where}.params.compile_kwargs: {sorted(kwargs)} not taken here; only mode "
                              "(model.compile_mode)")
        else:
            raise problem(f"{where}.name: {show(name)}; the shared accelerators here are attention_backend and "
                          "torch_compile")
        if params:
            raise problem(f"{where}.params: {sorted(params)} not taken by {name}")


def _read_ema_warmup(data: dict) -> None:
    """Flow-Factory's ``train.warmup_steps`` W: the warm-up of its EMA decay schedule (its
    ``ema/ema_utils.py``, with its default ``initial_decay`` 0), read as our key of the same meaning:

    - ``linear``: decay = ema_decay min(1, k / W), which is our ``piecewise_linear`` with
      flat_steps 0 and ramp_rate ema_decay / W (our ``linear`` ramps over max_epochs instead);
    - ``warmup_cosine``: decay 0 for the first W epochs, which is our ``flat_steps``;
    - ``power``: min(ema_decay, (1 + k) / (W + k)); the power schedule here is another curve
      (diffusers' 1 - (1 + k)^(-2/3)) with no length to set, so it stays refused;
    - ``constant``, ``piecewise_linear``, ``cosine`` read no W there either: the key stays, and
      is named by a note (``without_effect``), as it is with no EMA (ema_decay 0)."""
    train = data.get("train")
    if not isinstance(train, dict) or train.get("warmup_steps") is None:  # null: as written in a saved config
        return
    steps = train["warmup_steps"]
    schedule = train.get("ema_decay_schedule", "power")
    decay = train.get("ema_decay", 0.995)
    if schedule not in ("linear", "warmup_cosine", "power") or not _is_number(decay) or decay == 0:
        return  # no effect (without_effect names it), or a wrong ema_decay that its own check reports
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise problem(f"train.warmup_steps: {show(steps)}; expected a positive integer (epochs of the EMA "
                      f"decay's warm-up in ema_decay_schedule {schedule})")
    if schedule == "power":
        given = "" if "ema_decay_schedule" in train else " (the default)"
        raise problem(f"train.warmup_steps: with ema_decay_schedule power{given} Flow-Factory's EMA decay is "
                      f"min(ema_decay, (1 + k) / ({steps} + k)); the power schedule here is another curve (diffusers' "
                      f"1 - (1 + k)^(-2/3)) with no length to set; remove warmup_steps for that one, or set "
                      f"ema_decay_schedule linear (decay ema_decay min(1, k / {steps}))")
    train.pop("warmup_steps")
    if schedule == "warmup_cosine":
        _put(data, "train.flat_steps", steps, "train.warmup_steps")
    else:
        _put(data, "train.flat_steps", 0, "train.warmup_steps with ema_decay_schedule linear")
        _put(data, "train.ramp_rate", decay / steps, "train.warmup_steps with ema_decay_schedule linear")
        train["ema_decay_schedule"] = "piecewise_linear"


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _read_frozen_dtypes(data: dict) -> None:
    """Flow-Factory's per-component dtypes of the frozen networks: here they all take the
    mixed-precision dtype, so only that value (or null) is accepted."""
    found, dtypes = _pop(data, "model.frozen_parameters_dtype")
    if not found or dtypes is None:
        return
    precision = data.get("mixed_precision", "bf16")
    meant = {"bf16": "bfloat16", "fp16": "float16", "no": "float32"}.get(precision)
    values = dtypes.values() if isinstance(dtypes, dict) else [dtypes]
    other = [v for v in values if v is not None and DTYPE_NAMES.get(str(v).lower()) != meant]
    if other:
        raise problem(f"model.frozen_parameters_dtype: {show(dtypes)}; the frozen networks take mixed_precision's "
                      f"dtype here ({meant} with mixed_precision {precision}), so only that or null")


def _read_dataset(data: dict, dataset: dict) -> None:
    if "train" in dataset and _split_part(dataset, "train", "data.datasets[0]") is None:
        raise problem("data.datasets[0].train: the run's one dataset is evaluation-only (train null or enabled: "
                      "false), so there is none to train from; give it train: {weight: 1}")
    _route_to_the_one_dataset(data, dataset.pop("name", None))
    if _split_part(dataset, "eval", "data.datasets[0]") is None:  # upstream evaluates no dataset without eval: {...}
        evaluation = data.setdefault("eval", {})
        if isinstance(evaluation, dict):
            evaluation["eval_freq"] = 0
    for part in ("train", "eval"):
        inner = _split_part(dataset, part, "data.datasets[0]") or {}
        dataset.pop(part, None)
        inner.pop("weight", None)  # one dataset: its weight is the whole
        dataset.update({f"{part}.{k}": v for k, v in inner.items()})
    unknown = sorted(set(dataset) - set(DATASET_KEYS))
    if unknown:
        raise problem(f"data.datasets[0]: keys {unknown} are not taken here; valid: name, "
                      f"{', '.join(DATASET_KEYS)}, train.weight")
    for key, value in dataset.items():
        _put(data, DATASET_KEYS[key], value, f"data.datasets[0].{key}")


def _route_to_the_one_dataset(data: dict, name) -> None:
    """A reward (or diffusion-opd's teacher) routed to the run's one dataset by name (``applicable_datasets:
    [name]``, ``weight: {name: w}``) applies to every sample: read as unrouted, since the run here reads that dataset
    alone (``data.dataset_dir``). A routing that names another dataset is left for the config to refuse."""
    train = data.get("train") if isinstance(data.get("train"), dict) else {}
    teachers = train.get("teachers") if isinstance(train.get("teachers"), list) else []  # diffusion-opd's teachers
    for entries in (data.get("rewards") or [], data.get("eval_rewards") or [], teachers):
        for entry in entries:
            if not isinstance(entry, dict) or name is None:
                continue
            if entry.get("applicable_datasets") in ([name], name):
                del entry["applicable_datasets"]
            if isinstance(entry.get("weight"), dict) and set(entry["weight"]) == {name}:
                entry["weight"] = entry["weight"][name]


def _upstream_layout(datasets) -> bool:
    """Flow-Factory's ``data.datasets`` entries nest their split settings (``train: {weight}``, ``eval: {}``, or
    null for a split a dataset is not used for); ours say ``train`` / ``eval`` as true or false."""
    return isinstance(datasets, list) and any(
        isinstance(d, dict) and any(k in d and (d[k] is None or isinstance(d[k], dict)) for k in ("train", "eval"))
        for d in datasets)


# what one of several Flow-Factory datasets may set -> our data.datasets entry's key
SOURCE_KEYS = {"name": "name", "dataset_dir": "dataset_dir", "image_dir": "image_dir", "video_dir": "video_dir",
               "audio_dir": "audio_dir",
               "train.weight": "weight", "train.max_dataset_size": "max_dataset_size",
               "eval.max_dataset_size": "eval_max_dataset_size", "eval.num_inference_steps": "eval_num_inference_steps",
               "eval.guidance_scale": "eval_guidance_scale", "eval.resolution": "eval_resolution"}


def _split_part(dataset: dict, part: str, where: str) -> dict | None:
    """A dataset's ``train`` or ``eval`` block as upstream reads it: None when the dataset is not used for that
    split (the block null or absent, or ``enabled: false``), else its settings."""
    block = dataset.get(part)
    if block is None:
        return None
    if not isinstance(block, dict):
        raise problem(f"{where}.{part}: expected a mapping or null, got {show(block)}")
    block = dict(block)
    if block.pop("enabled", True) is False:
        return None
    split = block.pop("split", "train" if part == "train" else "test")
    if split != ("train" if part == "train" else "test"):
        raise problem(f"{where}.{part}.split: {show(split)}; here training reads the train split and evaluation "
                      "the test split (train.* / test.*)")
    return block


def _read_datasets(datasets: list) -> list[dict]:
    """Several Flow-Factory datasets as ours: a dataset whose ``train`` is null is evaluation-only (``train:
    false``), one whose ``eval`` is null or absent is not evaluated (``eval: false``); each keeps its own eval steps,
    guidance and resolution (its ``eval.resolution``, null: the eval section's, as upstream's)."""
    ours = []
    for i, dataset in enumerate(datasets):
        where = f"data.datasets[{i}]"
        if not isinstance(dataset, dict):
            raise problem(f"{where}: expected a mapping, got {show(dataset)}")
        train, evaluated = _split_part(dataset, "train", where), _split_part(dataset, "eval", where)
        flat = {k: v for k, v in dataset.items() if k not in ("train", "eval")}
        flat.update({f"train.{k}": v for k, v in (train or {}).items()})
        flat.update({f"eval.{k}": v for k, v in (evaluated or {}).items()})
        unknown = sorted(set(flat) - set(SOURCE_KEYS))
        if unknown:
            raise problem(f"{where}: keys {unknown} are not taken here; valid: {', '.join(SOURCE_KEYS)}, "
                          "train.enabled, eval.enabled")
        entry = {SOURCE_KEYS[k]: v for k, v in flat.items()}
        ours.append({**entry, **({} if train is not None else {"train": False}),
                     **({} if evaluated is not None else {"eval": False})})
    return ours


def without_effect(cfg) -> list[str]:
    """Keys the config sets that change nothing in this run, each with why: Flow-Factory accepts
    them, so a config written for it loads, but nobody should believe they act."""
    notes = []
    data, train = cfg.data, cfg.train
    if data.dataloader_num_workers and "dataloader_num_workers" in data.model_fields_set:
        notes.append("data.dataloader_num_workers: prompts are read into memory once; there is no loader to "
                     "give workers")
    audio_dirs = ["data.audio_dir"] if data.audio_dir is not None else []
    audio_dirs += [f"data.datasets[{i}].audio_dir" for i, d in enumerate(data.datasets or []) if d.audio_dir is not None]
    if audio_dirs:
        notes.append(f"{', '.join(audio_dirs)}: no model here reads a dataset row's audio / audios column (an sft or "
                     "offline-dpo record names its audio relative to dataset_dir), so it changes nothing")
    if data.sampler_type != "auto" or data.sampler_subgroup_size is not None:
        notes.append(f"data.sampler_type: {data.sampler_type} places samples on processes; here each process takes "
                     "a contiguous share of the epoch's group-ordered samples, dgpo its share of each global "
                     "micro-batch (advantages are computed over the gathered batch, so the placement changes which "
                     "process computes a sample, not its advantage)")
    if train.kl_weight is not None:
        notes.append(f"train.kl_weight: {show(train.kl_weight)} is not a key of Flow-Factory's either (its AWM "
                     "examples set it, its trainers never read it); the KL terms are weighted by kl_beta and "
                     "ema_kl_beta")
    if train.warmup_steps is not None:
        why = ("there is no EMA (ema_decay 0)" if train.ema_decay == 0 else
               f"ema_decay_schedule {train.ema_decay_schedule} has no warm-up, here as in Flow-Factory (only its "
               "power, linear and warmup_cosine schedules read warmup_steps)")
        notes.append(f"train.warmup_steps: {train.warmup_steps} changes nothing: {why}")
    notes += cfg.keys_without_effect
    if ("time_shift" in train.model_fields_set and train.time_shift != 1
            and ALGORITHM_SPECS[train.trainer_type].family == "decoupled"
            and train.time_sampling_strategy.startswith("discrete")):
        notes.append(f"train.time_shift: {train.time_shift:g} shifts continuous sigmas; time_sampling_strategy "
                     f"{train.time_sampling_strategy!r} trains on the rollout's own sigmas, which the model's "
                     "scheduler has shifted already")
    return notes
