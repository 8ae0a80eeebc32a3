"""The small sections: data, model, scheduler, eval, log. ``train`` has its own file.

Key names follow Flow-Factory's YAML so its users' files load; a few of its keys are
accepted for compatibility and documented as such.
"""

from __future__ import annotations

from typing import Literal

from pydantic import NonNegativeInt, PositiveInt, field_validator, model_validator

from .base import (DTYPE_NAMES, Section, as_list, canonical_choice, check_resolution, close_match, problem,
                   resolution_pair, setting, show)
from .families import MODEL_FAMILIES, model_family, model_type_aliases, model_type_description


# video-to-video's strength when train.strength is null: WanVideoToVideoPipeline's default
DEFAULT_STRENGTH = 0.8


def strength_steps(num_steps: int, strength: float) -> int:
    """The steps a video-to-video rollout runs: the last int(num_steps x strength) of the schedule, as the
    pipelines' ``get_timesteps`` keeps them."""
    return min(int(num_steps * strength), num_steps)


# Flow-Factory's sample placements, its legacy names and its newer ones
SAMPLER_TYPES = ("auto", "distributed_k_repeat", "group_contiguous", "group_distributed", "group_tiled",
                 "global_random", "contiguous_shard", "rank_local", "global_batch", "global_tile", "subgroup_tile")
# a diffusers pipeline's networks, as Flow-Factory prefixes module names with them
PIPELINE_COMPONENTS = ("transformer", "transformer_2", "text_encoder", "text_encoder_2", "text_encoder_3", "vae",
                       "image_encoder")
DYNAMICS_TYPES = ("Flow-SDE", "Dance-SDE", "CPS", "ODE", "DPM-Solver++2M")
DYNAMICS_ALIASES = {"flow-sde": "Flow-SDE", "flowsde": "Flow-SDE", "dance-sde": "Dance-SDE",
                    "dancesde": "Dance-SDE", "cps": "CPS", "ode": "ODE", "dpm-solver++2m": "DPM-Solver++2M",
                    "dpm-solver++": "DPM-Solver++2M", "dpmpp-2m": "DPM-Solver++2M", "dpm++2m": "DPM-Solver++2M"}


class DatasetSource(Section):
    """One of several datasets a run draws its groups from (``data.datasets``)."""

    name: str = setting(description="the dataset's name, in its metrics (source/<name>/...)", min_length=1)
    dataset_dir: str = setting(description="folder of prompts: train.txt / train.jsonl (and test.* for eval)")
    image_dir: str | None = setting(None, "folder its jsonl rows' image paths are relative to; null = "
                                    "dataset_dir/images")
    video_dir: str | None = setting(None, "folder its jsonl rows' video paths are relative to; null = "
                                    "dataset_dir/videos")
    audio_dir: str | None = setting(None, "Flow-Factory's folder for a jsonl row's audio / audios paths; no model "
                                    "here reads a row's audio, so it changes nothing (a note says so)")
    weight: PositiveInt = setting(1, "its share of each epoch's groups: weight / the sum of the training datasets' "
                                  "weights")
    train: bool = setting(True, "false: an evaluation-only dataset, no epoch's groups drawn from it, its test split "
                          "evaluated (Flow-Factory's train: null)")
    eval: bool = setting(True, "false: its test split is not evaluated (Flow-Factory's eval: null)")
    max_dataset_size: PositiveInt | None = setting(None, "use at most this many of its prompts per split; null = all")
    eval_max_dataset_size: PositiveInt | None = setting(
        None, "use at most this many of its test prompts; null = max_dataset_size")
    eval_num_inference_steps: PositiveInt | None = setting(
        None, "ODE steps its test prompts are evaluated with; null = eval.num_inference_steps")
    eval_guidance_scale: float | None = setting(
        None, "CFG / guidance scale its test prompts are evaluated with; null = eval.guidance_scale", ge=0)
    eval_resolution: int | list[int] | None = setting(
        None, "size its test prompts are evaluated at, an int or [height, width] (a video model's frames stay "
        "eval.num_frames); null = eval.resolution", expects="an integer, [height, width] or null")

    @field_validator("eval_resolution", mode="before")
    @classmethod
    def _eval_resolution(cls, value):
        return check_resolution(value)

    @model_validator(mode="after")
    def _read_by_the_run(self):
        if not self.train and not self.eval:
            raise problem(f"train: false and eval: false: the run never reads {self.name!r}; remove it")
        if not self.train and "weight" in self.model_fields_set:
            raise problem(f"weight: {self.name!r} is evaluation-only (train: false), never drawn for training; "
                          "remove its weight")
        given = [k for k in ("eval_max_dataset_size", "eval_num_inference_steps", "eval_guidance_scale",
                             "eval_resolution") if getattr(self, k) is not None]
        if not self.eval and given:
            raise problem(f"{given[0]}: {self.name!r} is not evaluated (eval: false); remove it")
        return self


class DataConfig(Section):
    dataset_dir: str | None = setting(
        None, "folder of prompts: train.txt / train.jsonl (and test.* for eval); or give datasets")
    datasets: list[DatasetSource] | None = setting(
        None, "several datasets instead of dataset_dir, each group of an epoch drawn from one of them in "
        "proportion to its weight: [{name, dataset_dir, weight, ...}]")
    image_dir: str | None = setting(
        None, "folder the jsonl rows' image / images paths are relative to (condition images); null = "
        "dataset_dir/images")
    video_dir: str | None = setting(
        None, "folder the jsonl rows' video / videos paths are relative to (condition videos); null = "
        "dataset_dir/videos")
    audio_dir: str | None = setting(
        None, "Flow-Factory's folder for the jsonl rows' audio / audios paths; no model here reads a row's audio, so "
        "it changes nothing (a note says so)")
    max_dataset_size: PositiveInt | None = setting(None, "use at most this many prompts per split; null = all")
    enable_preprocess: bool = setting(True, "encode every train and test prompt (and a conditioned model's condition "
                                      "files) once before training, into the cache under cache_dir; false = encode "
                                      "them per rollout batch")
    preprocessing_batch_size: PositiveInt = setting(8, "prompts encoded at a time when building the cache")
    text_encoders_after_preprocess: Literal["cpu", "free"] = setting(
        "cpu", "where the text encoders go once every prompt is cached: cpu (as Flow-Factory), or free (dropped)")
    dataloader_num_workers: NonNegativeInt = setting(
        0, "worker processes for data loading (Flow-Factory compatibility: prompts are read into memory, so none)")
    cache_dir: str = setting("~/.cache/flow_factory/prompt_cache", "folder of the prompt cache (a subfolder per "
                             "text-encoder fingerprint, so a changed model never reads a stale entry)")
    force_reprocess: bool = setting(False, "encode every prompt again even when the cache holds it")
    preprocess_parallelism: Literal["local", "global"] = setting(
        "local", "who shares the prompt cache's work: the processes of each machine (local: cache_dir per machine) "
        "or all processes (global: cache_dir on a shared file system)")
    sampler_subgroup_size: PositiveInt | None = setting(
        None, "processes per tile of sampler_type subgroup_tile (Flow-Factory compatibility: see sampler_type)")
    sampler_type: Literal[SAMPLER_TYPES] = setting(
        "auto", "how a group's samples are spread over processes (Flow-Factory compatibility: here each process "
        "takes a contiguous share of the epoch's group-ordered samples, dgpo its share of each global micro-batch; "
        "advantages use the gathered batch)")


    @model_validator(mode="after")
    def _one_way_to_name_the_data(self):
        if (self.dataset_dir is None) == (self.datasets is None):
            raise problem("give dataset_dir (one dataset) or datasets (several: [{name, dataset_dir, weight}]), "
                          "not both" if self.dataset_dir else "dataset_dir is required: a folder of prompts "
                          "(train.txt / train.jsonl, and test.* for eval); or datasets, for several")
        if self.datasets is not None:
            if not self.datasets:
                raise problem("datasets: an empty list names no prompts")
            names = [d.name for d in self.datasets]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise problem(f"datasets: the names {twice} are used more than once; each names its metrics")
            if not any(d.train for d in self.datasets):
                raise problem("datasets: every dataset has train: false, so there is none to train from; give at "
                              "least one dataset train: true (the default)")
            shared = [k for k in ("image_dir", "video_dir", "audio_dir", "max_dataset_size")
                      if getattr(self, k) is not None]
            if shared:
                raise problem(f"{', '.join(shared)}: with datasets, set {'them' if len(shared) > 1 else 'it'} "
                              "per dataset")
        return self

    @property
    def sources(self) -> list[DatasetSource]:
        """The run's datasets: ``datasets``, or ``dataset_dir`` as the one source ``default``."""
        if self.datasets is not None:
            return list(self.datasets)
        return [DatasetSource(name="default", dataset_dir=self.dataset_dir, image_dir=self.image_dir,
                              video_dir=self.video_dir, audio_dir=self.audio_dir,
                              max_dataset_size=self.max_dataset_size)]

    def split_sources(self, split: str) -> list[DatasetSource]:
        """The datasets whose ``split`` (train / test) the run reads: those that train, those evaluated."""
        return [s for s in self.sources if (s.train if split == "train" else s.eval)]


def component_targets(target_modules, component: str, components: list[str]):
    """The part of ``model.target_modules`` for one of the trained ``components``: 'default', 'all', or the
    names without a component prefix plus those prefixed '<component>.' (Flow-Factory's spelling)."""
    if isinstance(target_modules, str) or len(components) == 1:
        return target_modules
    names = []
    for name in target_modules:
        head, _, rest = name.partition(".")
        if head not in components:
            names.append(name)
        elif head == component:
            names.append(rest)
    if "all" in names:
        return "all"
    return "default" if names == ["default"] else names  # "transformer.default": that component's default modules



class ModelConfig(Section):
    model_name_or_path: str = setting(description="Hugging Face hub id or local folder of a diffusers pipeline")
    model_type: str = setting(description=model_type_description())
    finetune_type: Literal["lora", "full"] = setting("lora", "train LoRA adapters or every transformer weight")
    lora_rank: PositiveInt = setting(32, "LoRA rank r")
    lora_alpha: PositiveInt = setting(64, "LoRA alpha; the update is scaled by alpha / r")
    target_components: list[str] = setting(
        ["transformer"], "the networks trained, a name or a list: transformer, or a multi-expert model's experts "
        "(Wan2.2 A14B: transformer for high noise, transformer_2 for low noise, or both); the others stay frozen",
        expects="a component name or a list of them")
    target_modules: Literal["default", "all"] | list[str] = setting(
        "default", "modules LoRA wraps: default (the model's attention projections), all, or a list of names; "
        "with several target_components, 'transformer_2.to_q' names a module of one of them",
        expects="'default', 'all' or a list of module names")
    resume_path: str | None = setting(
        None, "resume from a checkpoint folder (checkpoints/epoch_N), a run folder (its newest complete "
        "checkpoint) or 'latest' (this run's newest); null = start fresh")
    resume_type: Literal["lora", "full", "state"] | None = setting(
        None, "how resume_path is used: null or state = continue that run (weights, optimizer, EMA, epoch); lora "
        "or full = start a new run from its weights (Flow-Factory's meaning)")
    attn_backend: str | None = setting(
        None, "diffusers attention backend of the transformer (set_attention_backend: native, flash, "
        "_native_cudnn, sage, xformers, ...); null = diffusers' default")
    torch_compile: Literal["none", "auto", "regional", "full"] = setting(
        "none", "torch.compile of the transformer(s), in place, after LoRA: regional = each repeated block "
        "(diffusers' compile_repeated_blocks: a short cold start), full = the whole network, auto = regional "
        "where the model declares repeated blocks (FLUX, Wan, Qwen-Image, ...), else full (SD3); true = auto. "
        "The first epoch pays the compilation (on a CPU inductor needs a C++ compiler)",
        expects="none, auto, regional, full, true or false")
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = setting(
        "default", "torch.compile's mode when torch_compile is on")
    master_weight_dtype: Literal["float32", "float16", "bfloat16"] = setting(
        "float32", "dtype of the trainable weights (fp32, bf16 or fp16; float32 keeps small updates under mixed "
        "precision)")

    @field_validator("model_type", mode="before")
    @classmethod
    def _model_type_alias(cls, value):
        return canonical_choice(value, model_type_aliases())  # the table as it is now

    @field_validator("model_type")
    @classmethod
    def _model_type_known(cls, value):
        if value not in MODEL_FAMILIES and "." not in value and ":" not in value:
            close = close_match(value, MODEL_FAMILIES)
            raise problem(f"unknown model family {value!r}" + (f"; did you mean {close!r}?" if close else "")
                          + f"; expected one of {', '.join(MODEL_FAMILIES)}, or the dotted path of a FlowAdapter "
                          "subclass (my_package.adapters.MyAdapter)")
        model_family(value)  # a class path: importable, an adapter, and what the checks need
        return value

    @field_validator("torch_compile", mode="before")
    @classmethod
    def _compile_switch(cls, value):
        return {True: "auto", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("master_weight_dtype", mode="before")
    @classmethod
    def _dtype_spelling(cls, value):
        return canonical_choice(value, DTYPE_NAMES)

    @field_validator("target_components", mode="before")
    @classmethod
    def _component_list(cls, value):
        value = as_list(value)
        return [value] if isinstance(value, str) else value

    @field_validator("target_components")
    @classmethod
    def _components_of_the_family(cls, value, info):
        if "model_type" not in info.data:
            return value  # model_type's own error says what is wrong
        name = info.data["model_type"]
        try:
            family = model_family(name).components
        except ValueError:
            return value  # model_type's own error says what is wrong
        unknown = [c for c in value if c not in family]
        if unknown or not value:
            valid = (f"{', '.join(family)} (its experts), or a list of them" if len(family) > 1
                     else f"{family[0]} only")
            raise problem(f"{show(unknown or value)}: not a network {name} trains; valid: {valid}")
        # the pipeline's order, once each: the order of the trained weights in the optimizer and the EMA
        return [c for c in family if c in value]

    @field_validator("target_modules", mode="before")
    @classmethod
    def _target_modules(cls, value, info):
        # Flow-Factory's "transformer.default" / "transformer_2.attn1.to_q": a module of one trained component.
        # With one trained component the prefix is dropped; with several it stays, for models/lora.py to split
        value = as_list(value)
        names = value if isinstance(value, list) else [value]
        trained = info.data.get("target_components") or ["transformer"]
        if all(isinstance(n, str) for n in names):
            foreign = [n for n in names if n.split(".")[0] in PIPELINE_COMPONENTS and n.split(".")[0] not in trained]
            if foreign:
                raise problem(f"{show(foreign)} name modules of components that are not trained (target_components: "
                              f"{show(trained)}); write '<component>.<module>' for a trained one, or the module alone")
            if len(trained) == 1:
                names = [n.removeprefix(f"{trained[0]}.") for n in names]
            value = names if isinstance(value, list) else names[0]
        if isinstance(value, str):
            value = value.lower()
            if value in ("default", "all"):
                return value
            value = [value]
        # a trained component whose modules the list never names gets no adapter (trained_components): Flow-Factory's
        # "transformer.default" with target_components [transformer, transformer_2] (its Wan2.2 examples)
        return value

    @field_validator("target_modules")
    @classmethod
    def _non_empty_list(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("an empty list trains nothing; use 'default' or name the modules")
        return value

    @property
    def trained_components(self) -> list[str]:
        """The networks of ``target_components`` that train: under LoRA, those ``target_modules`` names a module of."""
        if self.finetune_type != "lora":
            return list(self.target_components)
        return [c for c in self.target_components
                if component_targets(self.target_modules, c, self.target_components) != []]

    @property
    def is_video(self) -> bool:
        return model_family(self.model_type).frame_factor is not None


class SchedulerConfig(Section):
    dynamics_type: Literal["Flow-SDE", "Dance-SDE", "CPS", "ODE", "DPM-Solver++2M"] = setting(
        "Flow-SDE", "sampling dynamics of the rollout: Flow-SDE, Dance-SDE, CPS (SDEs), ODE or DPM-Solver++2M "
        "(deterministic; decoupled algorithms only)")
    noise_level: float = setting(0.7, "SDE noise scale a (Flow-SDE / Dance-SDE std factor, CPS angle)", ge=0)
    sde_steps: list[int] | None = setting(
        None, "candidate step indices (from 0) for the stochastic window; null = every step but the last")
    num_sde_steps: PositiveInt | None = setting(
        1, "how many candidates are drawn (and trained) per epoch; null = all candidates")
    seed: int = setting(42, "seed of the per-epoch window draw")
    flow_shift: float | None = setting(
        None, "a static shift of the sigma schedule, shift*s/(1+(shift-1)*s), in place of the pipeline scheduler's "
        "own (also of a resolution-dependent one: FLUX, Qwen-Image); null = the model's own", gt=0)

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
        None, "eval image size, an int or [height, width]; null = train.resolution (a dataset's own "
        "eval_resolution replaces it for that dataset's test prompts)",
        expects="an integer, [height, width] or null")
    num_frames: PositiveInt | None = setting(None, "video frames at eval; null = train.num_frames")
    frame_rate: float | None = setting(None, "Flow-Factory compatibility: as train.frame_rate", gt=0)
    num_inference_steps: PositiveInt | None = setting(None, "ODE steps at eval; null = train.num_inference_steps")
    guidance_scale: float | None = setting(None, "CFG / guidance scale at eval; null = train.guidance_scale", ge=0)
    guidance_scale_2: float | None = setting(
        None, "the low-noise expert's CFG scale at eval (Wan2.2 A14B); null = train.guidance_scale_2", ge=0)
    strength: float | None = setting(None, "video-to-video's strength at eval (wan2_v2v); null = train.strength",
                                     gt=0, le=1)
    condition_image_size: int | list[int] | None = setting(
        None, "size condition images are resized to at eval, an int or [height, width] (conditioned models); "
        "null = train.condition_image_size", expects="an integer, [height, width] or null")
    auto_resize: bool | None = setting(
        None, "at eval, generate at the aspect ratio of the condition images (conditioned models); null = "
        "train.auto_resize")
    eval_freq: NonNegativeInt = setting(10, "evaluate every this many epochs (and the final weights); 0 = never; "
                                        "a dataset without a test split is not evaluated")
    per_device_batch_size: PositiveInt | None = setting(
        None, "eval batch size per process; null = train.per_device_batch_size")
    num_samples: PositiveInt | None = setting(
        None, "evaluate on at most this many test prompts, split evenly over the evaluated datasets (each its first "
        "ones); null = all")
    seed: int | None = setting(None, "seed of the eval noise; null = the training seed")

    @field_validator("resolution", "condition_image_size", mode="before")
    @classmethod
    def _resolution(cls, value):
        return check_resolution(value)

    @property
    def height_width(self) -> tuple[int, int]:
        return resolution_pair(self.resolution)


class LogConfig(Section):
    run_name: str | None = setting(
        None, "run folder name; null = {model_type}_{finetune_type}_{trainer_type}_{timestamp}_{6 random hex}")
    project: str = setting("Flow-Factory", "project name for the tracker")
    logging_backend: Literal["tensorboard", "wandb", "swanlab", "none"] = setting(
        "tensorboard", "where metrics go: tensorboard, wandb, swanlab or none")
    save_dir: str = setting("save", "parent folder of run folders (checkpoints, samples, logs)")
    save_freq: NonNegativeInt = setting(10, "save a checkpoint every this many epochs; 0 = only at the end "
                                        "(the final weights are always saved)")
    save_model_only: bool = setting(False, "checkpoints hold the weights (and EMA) only, not the optimizer state; "
                                    "a resume from one restarts the optimizer")
    verbose: bool = setting(True, "show progress bars")
    video_format: Literal["mp4", "gif"] = setting(
        "mp4", "how a video model's sample grids are written in the run folder: mp4 (H.264) or gif; wandb and "
        "swanlab log that file, TensorBoard an animated GIF either way (it plays no mp4)")
    overwrite: bool = setting(False, "replace the run folder when it already holds another run "
                              "(its checkpoints are deleted); false = refuse")

    @field_validator("logging_backend", mode="before")
    @classmethod
    def _backend_case(cls, value):
        if value is None:
            return "none"
        return value.lower() if isinstance(value, str) else value
