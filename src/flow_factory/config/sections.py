"""The small sections: data, model, scheduler, eval, log. ``train`` has its own file.

Key names follow Flow-Factory's YAML so its users' files load; a few of its keys are
accepted for compatibility and documented as such.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import NonNegativeInt, PositiveInt, field_validator

from .base import Section, as_list, canonical_choice, check_resolution, resolution_pair, setting


@dataclass(frozen=True)
class ModelFamily:
    """What the config checks about a model family before anything loads.

    The adapters in models/ take these numbers as class attributes (``SD3Adapter.pixel_factor``),
    so config and adapter cannot disagree; they live here because config/ imports no torch.
    """

    pixel_factor: int  # height and width must be multiples of this in the released checkpoints
    why: str  # how that factor arises, for the error message
    frame_factor: int | None = None  # video only: num_frames must be 1 + a multiple of this


MODEL_FAMILIES = {
    "sd3-5": ModelFamily(16, "VAE x8, then 2x2 transformer patches"),
    "flux1": ModelFamily(16, "VAE x8, then 2x2 token packing"),
    "wan2_t2v": ModelFamily(16, "VAE x8, then 2x2 transformer patches", frame_factor=4),
}
MODEL_TYPES = tuple(MODEL_FAMILIES)
VIDEO_MODEL_TYPES = tuple(name for name, family in MODEL_FAMILIES.items() if family.frame_factor)
MODEL_TYPE_ALIASES = {
    "sd3-5": "sd3-5", "sd3_5": "sd3-5", "sd3": "sd3-5", "sd35": "sd3-5",
    "flux1": "flux1", "flux": "flux1", "flux-1": "flux1",
    "wan2_t2v": "wan2_t2v", "wan": "wan2_t2v", "wan2.1": "wan2_t2v", "wan21": "wan2_t2v",
    "wan21_t2v": "wan2_t2v", "wan2.1_t2v": "wan2_t2v",
}
DYNAMICS_TYPES = ("Flow-SDE", "Dance-SDE", "CPS", "ODE", "DPM-Solver++2M")
DYNAMICS_ALIASES = {"flow-sde": "Flow-SDE", "flowsde": "Flow-SDE", "dance-sde": "Dance-SDE",
                    "dancesde": "Dance-SDE", "cps": "CPS", "ode": "ODE", "dpm-solver++2m": "DPM-Solver++2M",
                    "dpm-solver++": "DPM-Solver++2M", "dpmpp-2m": "DPM-Solver++2M", "dpm++2m": "DPM-Solver++2M"}


class DataConfig(Section):
    dataset_dir: str = setting(description="folder of prompts: train.txt / train.jsonl (and test.* for eval)")
    max_dataset_size: PositiveInt | None = setting(None, "use at most this many prompts per split; null = all")
    preprocessing_batch_size: PositiveInt = setting(8, "batch size when encoding prompts ahead of training")
    dataloader_num_workers: NonNegativeInt = setting(0, "worker processes for data loading (0 = main process)")
    cache_dir: str | None = setting(None, "folder for the cached prompt conditioning; null = keep it in memory")
    force_reprocess: bool = setting(False, "re-encode prompts even when a cache exists")
    sampler_type: Literal["auto", "distributed_k_repeat", "group_contiguous"] = setting(
        "auto", "how a group's samples are spread over processes (Flow-Factory compatibility)")


class ModelConfig(Section):
    model_name_or_path: str = setting(description="Hugging Face hub id or local folder of a diffusers pipeline")
    model_type: Literal["sd3-5", "flux1", "wan2_t2v"] = setting(
        description="model family: sd3-5, flux1 or wan2_t2v (aliases such as sd3_5, flux, wan2.1 accepted)")
    finetune_type: Literal["lora", "full"] = setting("lora", "train LoRA adapters or every transformer weight")
    lora_rank: PositiveInt = setting(32, "LoRA rank r")
    lora_alpha: PositiveInt = setting(64, "LoRA alpha; the update is scaled by alpha / r")
    target_modules: Literal["default", "all"] | list[str] = setting(
        "default", "modules LoRA wraps: default (the model's attention projections), all, or a list of names",
        expects="'default', 'all' or a list of module names")
    target_components: Literal["transformer"] = setting(
        "transformer", "which network is trained (Flow-Factory compatibility; only transformer)")
    resume_path: str | None = setting(
        None, "resume from a checkpoint folder (checkpoints/epoch_N), a run folder (its newest complete "
        "checkpoint) or 'latest' (this run's newest); null = start fresh")
    resume_type: Literal["lora", "full", "state"] | None = setting(
        None, "what resume_path holds; null = infer from finetune_type")
    master_weight_dtype: Literal["float32", "float16", "bfloat16"] = setting(
        "float32", "dtype of the trainable weights (kept float32 under mixed precision)")

    @field_validator("model_type", mode="before")
    @classmethod
    def _model_type_alias(cls, value):
        return canonical_choice(value, MODEL_TYPE_ALIASES)

    @field_validator("target_modules", mode="before")
    @classmethod
    def _target_modules(cls, value):
        value = as_list(value)
        if isinstance(value, str):
            return value.lower()
        return value

    @field_validator("target_modules")
    @classmethod
    def _non_empty_list(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("an empty list trains nothing; use 'default' or name the modules")
        return value

    @property
    def is_video(self) -> bool:
        return self.model_type in VIDEO_MODEL_TYPES


class SchedulerConfig(Section):
    dynamics_type: Literal["Flow-SDE", "Dance-SDE", "CPS", "ODE", "DPM-Solver++2M"] = setting(
        "Flow-SDE", "sampling dynamics of the rollout: Flow-SDE, Dance-SDE, CPS (SDEs), ODE or DPM-Solver++2M "
        "(deterministic; decoupled algorithms only)")
    noise_level: float = setting(0.7, "SDE noise scale a (Flow-SDE / Dance-SDE std factor, CPS angle)", ge=0)
    sde_steps: list[int] | None = setting(
        None, "candidate step indices for the stochastic window; null = every step")
    num_sde_steps: PositiveInt | None = setting(
        None, "how many candidates are drawn (and trained) per epoch; null = all candidates")
    seed: int = setting(42, "seed of the per-epoch window draw")
    flow_shift: float | None = setting(None, "override the pipeline scheduler's shift; null = the model's own",
                                       gt=0)

    @field_validator("dynamics_type", mode="before")
    @classmethod
    def _dynamics_alias(cls, value):
        return canonical_choice(value, DYNAMICS_ALIASES)

    @field_validator("sde_steps", mode="before")
    @classmethod
    def _sde_steps_list(cls, value):
        return as_list(value)

    @field_validator("sde_steps")
    @classmethod
    def _sde_steps_distinct(cls, value):
        if value is None:
            return value
        if not value:
            raise ValueError("an empty list makes no step stochastic; use null for every step")
        negative = [s for s in value if s < 0]
        if negative:
            raise ValueError(f"step indices count from 0, got {negative}")
        repeated = sorted({s for s in value if value.count(s) > 1})
        if repeated:
            raise ValueError(f"steps {repeated} are listed more than once")
        return value


class EvalConfig(Section):
    resolution: int | list[int] | None = setting(
        None, "eval image size, an int or [height, width]; null = train.resolution",
        expects="an integer, [height, width] or null")
    num_frames: PositiveInt | None = setting(None, "video frames at eval; null = train.num_frames")
    num_inference_steps: PositiveInt | None = setting(None, "ODE steps at eval; null = train.num_inference_steps")
    guidance_scale: float | None = setting(None, "CFG / guidance scale at eval; null = train.guidance_scale", ge=0)
    eval_freq: NonNegativeInt = setting(0, "evaluate every this many epochs; 0 = never")
    per_device_batch_size: PositiveInt | None = setting(
        None, "eval batch size per process; null = train.per_device_batch_size")
    num_samples: PositiveInt | None = setting(None, "evaluate on at most this many test prompts; null = all")
    seed: int | None = setting(None, "seed of the eval noise; null = the training seed")

    @field_validator("resolution", mode="before")
    @classmethod
    def _resolution(cls, value):
        return check_resolution(value)

    @property
    def height_width(self) -> tuple[int, int]:
        return resolution_pair(self.resolution)


class LogConfig(Section):
    run_name: str | None = setting(
        None, "run folder name; null = {model_type}_{finetune_type}_{trainer_type}_{timestamp}_{4 random hex}")
    project: str = setting("Flow-Factory", "project name for the tracker")
    logging_backend: Literal["tensorboard", "wandb", "swanlab", "none"] = setting(
        "tensorboard", "where metrics go: tensorboard, wandb, swanlab or none")
    save_dir: str = setting("saves", "parent folder of run folders (checkpoints, samples, logs)")
    save_freq: NonNegativeInt = setting(0, "save a checkpoint every this many epochs; 0 = only at the end")
    save_model_only: bool = setting(False, "checkpoints hold the weights only, not the optimizer state")
    overwrite: bool = setting(False, "replace the run folder when it already holds another run "
                              "(its checkpoints are deleted); false = refuse")

    @field_validator("logging_backend", mode="before")
    @classmethod
    def _backend_case(cls, value):
        if value is None:
            return "none"
        return value.lower() if isinstance(value, str) else value
