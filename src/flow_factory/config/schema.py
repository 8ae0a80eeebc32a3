"""The whole run's config: top-level launcher keys, the sections, and what only the
sections together can check (trainer vs dynamics, batch geometry, SDE window).

The epoch arithmetic the trainer runs on is defined here once, as properties, so the
checks and the training loop cannot disagree:

  samples per epoch    = unique_sample_num_per_epoch * group_size
  batches per process  = samples per epoch / (num_processes * per_device_batch_size)
  trained steps        = coupled (grpo*): num_sde_steps, else len(sde_steps), else num_inference_steps
                         decoupled (nft, awm, dpo, dgpo, crd): num_train_timesteps (resolved)
  optimize batches     = batches per process; dpo: ceil(groups per process / per_device_batch_size)
                         (a dpo micro-batch holds per_device_batch_size best / worst pairs)
  micro-steps          = optimize batches * trained steps   (one backward each)
  accumulation         = micro-steps / gradient_step_per_epoch, or the explicit integer
"""

from __future__ import annotations

import math
import secrets
from datetime import datetime
from typing import Literal

import yaml
from pydantic import PositiveInt, PrivateAttr, ValidationError, field_validator, model_validator

from ..launch_configs import FOLDER as LAUNCH_FOLDER
from ..launch_configs import LaunchConfigError
from ..launch_configs import resolve as resolve_launch_config
from .base import Section, problem, setting, show, size_problem
from .compat import read_flow_factory_spellings, without_effect
from .errors import ConfigError
from .explain import explain
from .families import model_family
from .overlap import overlap_notes, overlap_problems
from .rewards import RewardConfig, as_entry_list, duplicate_names
from .sections import DEFAULT_STRENGTH, DataConfig, EvalConfig, LogConfig, ModelConfig, SchedulerConfig, strength_steps
from .distillation import DISTILLATION_SPECS, distillation_contradictions, micro_steps_per_sample
from .algorithms import ALGORITHM_SPECS, COUPLED_TRAINER_TYPES, DISTILLATION_TRAINER_TYPES, OFFLINE_TRAINER_TYPES
from .train import TrainConfig, fill_trainer_defaults, resolve_num_train_timesteps, trainer_problems

STOCHASTIC = ("Flow-SDE", "Dance-SDE", "CPS")
DEFAULT_LEARNING_RATE = {"lora": 1e-4, "full": 1e-5}
DEFAULT_NUM_FRAMES = 81  # video models, when train.num_frames is omitted (Flow-Factory's Wan default)
ENTRIES = "a list of reward entries (mappings with a reward_model key) or one such mapping"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Config(Section):
    launcher: Literal["accelerate"] = setting("accelerate", "how processes are started (accelerate)")
    config_file: str | None = setting(
        None, "accelerate launch config: a shipped one by name (single_gpu, multi_gpu, fsdp2, fsdp2_offload, zero1, "
              "zero2, zero2_offload, zero3, multi_node; Flow-Factory's config/deepspeed/... and "
              "config/accelerate_configs/... names too) or a file's path; null = DDP from the flags")
    num_processes: PositiveInt = setting(1, "number of training processes (GPUs), all machines together")
    num_machines: PositiveInt = setting(1, "number of machines (nodes) the processes run on")
    machine_rank: int = setting(0, "this machine's rank, 0 .. num_machines - 1", ge=0)
    main_process_ip: str | None = setting(None, "address of machine 0 (needed with num_machines > 1)")
    main_process_port: int = setting(29500, "port of the main process for distributed setup", ge=1, le=65535)
    mixed_precision: Literal["no", "fp16", "bf16"] = setting(
        "bf16", "autocast precision on a GPU: no, fp16 or bf16 (a CPU-only run computes in float32 unless "
        "FF_CPU_MIXED_PRECISION=1)")
    seed: int = setting(42, "global seed; train.seed overrides it when set")

    data: DataConfig = setting(description="prompt data")
    model: ModelConfig = setting(description="the pipeline and what of it is trained")
    scheduler: SchedulerConfig = setting(default_factory=SchedulerConfig, description="sampling dynamics")
    train: TrainConfig = setting(default_factory=TrainConfig, description="rollouts and optimisation")
    eval: EvalConfig = setting(default_factory=EvalConfig, description="periodic evaluation")
    log: LogConfig = setting(default_factory=LogConfig, description="run naming, tracking, checkpoints")
    rewards: list[RewardConfig] = setting(default_factory=list, description="reward entries (a list, or one "
                                          "mapping); sft and offline-dpo train without", expects=ENTRIES)
    eval_rewards: list[RewardConfig] | None = setting(None, "rewards at eval; null = the training rewards",
                                                      expects=f"{ENTRIES}, or null")
    # keys the config gave that were cleared because they mean nothing for this model, each with
    # why; ``notes`` names them (a key kept with no effect is named from its own value instead)
    _cleared: list[str] = PrivateAttr(default_factory=list)

    def __init__(self, **data):
        # pydantic routes model_validate through a custom __init__ too, wrapping this
        # ConfigError in a ValidationError there; from_dict is the path that keeps it clean
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise ConfigError(explain(err, type(self), data)) from None

    @classmethod
    def from_dict(cls, data: dict, source: str | None = None) -> "Config":
        """Validate a plain mapping (as read from YAML); all its problems become one ConfigError."""
        names = [k for k in data if not isinstance(k, str)]
        if names:
            raise ConfigError(f"top-level keys must be names, got {names}", source)
        try:
            return cls(**data)
        except ConfigError as err:
            raise ConfigError(err.problems, source) from None

    @model_validator(mode="before")
    @classmethod
    def _sections_may_be_empty(cls, data):
        # `data:` with nothing under it is YAML null; treat it as an empty section so the
        # error names the missing key inside it, not the section
        if isinstance(data, dict):
            data = read_flow_factory_spellings(data)
            for name in ("data", "model", "scheduler", "train", "eval", "log"):
                if data.get(name) is None and (name in data or name in ("data", "model")):
                    data[name] = {}
        return data

    @field_validator("config_file")
    @classmethod
    def _launch_config_exists(cls, value):
        if value is not None:
            try:
                resolve_launch_config(value)
            except LaunchConfigError as err:
                raise problem(str(err)) from None
        return value

    @field_validator("rewards", "eval_rewards", mode="before")
    @classmethod
    def _one_mapping_is_a_list(cls, value):
        return as_entry_list(value)

    @field_validator("rewards", "eval_rewards")
    @classmethod
    def _named_entries(cls, value, info):
        message = duplicate_names(value) if value else None
        if message:
            raise problem(message)
        return value

    @model_validator(mode="after")
    def _resolve_and_check(self):
        fill_trainer_defaults(self.train)
        self._clear_conditions_of_text_only_models()
        self._note_untrained_components()
        # checks next: they must see what the user wrote, not the filled-in defaults
        problems = (self._read_frame_rates() + self._contradictions() + self._size_problems()
                    + self._window_problems())
        if not problems:
            problems = self._geometry_problems()
        if problems:
            raise problem("\n".join(problems))
        self._fill_defaults()
        return self

    # ------------------------------------------------------------------ resolution
    def _fill_defaults(self) -> None:
        train, ev = self.train, self.eval
        if train.trainer_type not in COUPLED_TRAINER_TYPES and "dynamics_type" not in self.scheduler.model_fields_set:
            self.scheduler.dynamics_type = "ODE"  # decoupled algorithms need no log-probs: ODE by default
        if train.seed is None:
            train.seed = self.seed
        if train.num_frames is None and self.model.is_video:
            train.num_frames = DEFAULT_NUM_FRAMES  # Flow-Factory's Wan default
        if train.learning_rate is None:
            train.learning_rate = DEFAULT_LEARNING_RATE[self.model.finetune_type]
        for key in ("resolution", "num_frames", "num_inference_steps", "guidance_scale", "guidance_scale_2",
                    "per_device_batch_size", "seed", "condition_image_size", "auto_resize", "strength"):
            if getattr(ev, key) is None:
                setattr(ev, key, getattr(train, key))
        if self.log.run_name is None:
            # two runs started in the same second must not share a folder
            stamp = f"{datetime.now().strftime('%Y%m%d_%H%M%S')}_{secrets.token_hex(3)}"
            self.log.run_name = f"{self.model.model_type}_{self.model.finetune_type}_{train.trainer_type}_{stamp}"

    def _clear_conditions_of_text_only_models(self) -> None:
        """Flow-Factory's configs for text-only models may set the condition keys (its defaults for
        some families do); it ignores them there, so they are cleared here, with a note, and the run
        is the one without them."""
        name = self.model.model_type
        if model_family(name).conditions:
            return
        for part, section in (("train", self.train), ("eval", self.eval)):
            for key in ("condition_image_size", "auto_resize"):
                value = getattr(section, key)
                if value is not None:
                    self._cleared.append(f"{part}.{key}: {show(value)} changes nothing: {name} generates from text "
                                         "alone (the key is for conditioned models)")
                    setattr(section, key, None)

    def _reward_routing_problems(self) -> list[str]:
        """A reward routed to datasets (a weight per dataset, applicable_datasets) names datasets of the run's."""
        out, names = [], [s.name for s in self.data.sources]
        for part, entries in (("rewards", self.rewards), ("eval_rewards", self.eval_rewards or [])):
            for i, entry in enumerate(entries):
                named = {f"{part}[{i}].weight": list(entry.weight) if isinstance(entry.weight, dict) else [],
                         f"{part}[{i}].applicable_datasets": entry.applicable_datasets or []}
                for key, given in named.items():
                    if given and self.data.datasets is None:
                        out.append(f"{key}: routes a reward to datasets, but the run reads one (data.dataset_dir); "
                                   "name its datasets in data.datasets")
                    elif unknown := sorted(set(given) - set(names)):
                        out.append(f"{key}: {unknown} are not datasets of the run; data.datasets names {names}")
                    elif given:
                        out += self._routed_to_unread(key, part, given)
        return out + self._eval_only_problems() + self._eval_cap_problems()

    def _eval_cap_problems(self) -> list[str]:
        """eval.num_samples is split evenly over the evaluated datasets (``eval_sampling.eval_items``): a cap below
        their number would leave some out of the evaluation."""
        evaluated = [s.name for s in self.data.sources if s.eval] if self.data.datasets is not None else []
        cap = self.eval.num_samples
        if cap is None or cap >= len(evaluated):
            return []
        return [f"eval.num_samples: {cap} test prompts, split evenly over the {len(evaluated)} evaluated datasets "
                f"{evaluated}, would leave {evaluated[cap:]} out of the evaluation; make it at least "
                f"{len(evaluated)} or null (every test prompt), or cap each dataset with "
                "data.datasets[].eval_max_dataset_size"]

    def _routed_to_unread(self, key: str, part: str, given: list[str]) -> list[str]:
        """A reward routed to datasets whose samples it would never score: a training reward to evaluation-only
        datasets (when eval_rewards score the eval, or all it names are), an eval reward to datasets not
        evaluated."""
        sources = {s.name: s for s in self.data.sources}
        eval_only = [n for n in given if not sources[n].train]
        if part == "rewards" and eval_only and (self.eval_rewards or len(eval_only) == len(given)):
            return [f"{key}: {eval_only} are evaluation-only datasets (train: false), which training never draws"
                    f"{' and eval_rewards score' if self.eval_rewards else ''}; route it to training datasets, or "
                    "list it under eval_rewards"]
        scores_eval = part == "eval_rewards" or not self.eval_rewards
        unevaluated = [n for n in given if not sources[n].eval]
        if scores_eval and unevaluated and (part == "eval_rewards" or len(unevaluated) == len(given)):
            return [f"{key}: {unevaluated} are not evaluated (eval: false); route it to evaluated datasets"]
        return []

    def _eval_only_problems(self) -> list[str]:
        """An evaluation-only dataset needs an evaluation to read it: eval.eval_freq and a reward to score it."""
        eval_only = [(i, s.name) for i, s in enumerate(self.data.sources) if not s.train]
        if not eval_only:
            return []
        i, name = eval_only[0]
        if not self.eval.eval_freq:
            return [f"data.datasets[{i}].train: false makes {name!r} evaluation-only, and eval.eval_freq is 0 (no "
                    "evaluation), so the run would never read it; set eval.eval_freq, or remove the dataset"]
        if not (self.eval_rewards or self.rewards):
            return [f"data.datasets[{i}].train: false makes {name!r} evaluation-only, and the run names no "
                    "eval_rewards (nor rewards) to score its samples; add eval_rewards, or remove the dataset"]
        return []

    def _read_frame_rates(self) -> list[str]:
        """Flow-Factory's ``frame_rate``: LTX-2 samples at 24 fps only; another model writes videos at its own
        rate, so the key is cleared with a note, but for offline training of a video model, whose records' videos
        are read on that clock (``data/offline.py``)."""
        out = []
        for part, section in (("train", self.train), ("eval", self.eval)):
            rate = section.frame_rate
            if rate is None:
                continue
            own = model_family(self.model.model_type).audio_fps  # a family with sound: its one frame rate
            ltx2 = own is not None
            if ltx2 and rate != own:
                out.append(f"{part}.frame_rate: {show(rate)}; only {own:g} here: LTX-2's videos play at the "
                           f"pipeline's default {own:g} fps here (LTX2Adapter.frame_rate)")
            elif part == "train" and self.train.trainer_type in OFFLINE_TRAINER_TYPES and self.model.is_video:
                continue
            elif not ltx2:
                self._cleared.append(f"{part}.frame_rate: {show(rate)} changes nothing: {self.model.model_type} "
                                     "writes its videos at its own frame rate here")
                section.frame_rate = None
        return out

    def _note_untrained_components(self) -> None:
        """A network of ``target_components`` whose modules a LoRA ``target_modules`` never names trains
        nothing (Flow-Factory's Wan2.2 examples: ``transformer.default`` with both experts named)."""
        model = self.model
        untrained = [c for c in model.target_components if c not in model.trained_components]
        if untrained:
            self._cleared.append(
                f"model.target_components: {show(untrained)} trains nothing: model.target_modules "
                f"{show(model.target_modules)} names none of its modules (Flow-Factory then still shards it under "
                "FSDP with the trained networks to save memory; so does fsdp2 here, the network frozen; under DDP "
                "and ZeRO it stays whole on each process)")

    @property
    def keys_without_effect(self) -> list[str]:
        """Keys cleared because they mean nothing for this model, each with why."""
        return list(self._cleared)

    # ------------------------------------------------------------------ checks
    def _contradictions(self) -> list[str]:
        train, model = self.train, self.model
        out = self._launch_problems() + trainer_problems(train)
        free = OFFLINE_TRAINER_TYPES + tuple(n for n in DISTILLATION_TRAINER_TYPES  # train without rewards
                                             if not DISTILLATION_SPECS[n].rewards)
        out += distillation_contradictions(self)
        if not self.rewards and train.trainer_type not in free:
            out.append("rewards: at least one reward is needed, e.g. [{reward_model: PickScore}] (sft and "
                       "offline-dpo train from a dataset without)")
        out += self._algorithm_contradictions()
        out += self._reward_routing_problems()
        out += overlap_problems(self)
        # off_policy with grpo is allowed: the importance ratio corrects for sampling with the EMA
        if train.off_policy and train.ema_decay == 0:
            out.append("train.off_policy: true samples with the EMA weights, but train.ema_decay is 0 (no EMA); "
                       "set ema_decay > 0 (e.g. 0.9)")
        if train.group_size < 2 and train.trainer_type not in free:
            out.append(f"train.group_size: {train.trainer_type} compares samples of the same prompt, so a group "
                       f"needs at least 2, got {train.group_size}")
        if model.resume_type in ("lora", "full") and model.resume_type != model.finetune_type:
            out.append(f"model.resume_type: {model.resume_type!r} starts from {model.resume_type} weights, but "
                       f"model.finetune_type is {model.finetune_type!r}; make them agree, or use state")
        return out + self._model_shape_contradictions()

    def _algorithm_contradictions(self) -> list[str]:
        """What the trainer type refuses of the dynamics, the rollout cache and the guidance scale."""
        train, sched, out = self.train, self.scheduler, []
        spec = ALGORITHM_SPECS[train.trainer_type]
        coupled = spec.family == "coupled"
        if not coupled:
            out += self._decoupled_contradictions()
            if train.outside_kl_beta > 0:
                out.append(f"train.outside_kl_beta: the KL at the steps an SDE window does not train is the grpo "
                           f"family's; {train.trainer_type} has no window (use kl_beta)")
        elif sched.dynamics_type not in STOCHASTIC:
            out.append(f"train.trainer_type {train.trainer_type!r} needs a stochastic dynamics to have "
                       f"log-probabilities to train, but scheduler.dynamics_type is {sched.dynamics_type!r}; "
                       f"use one of {', '.join(STOCHASTIC)}")
        elif spec.dynamics and sched.dynamics_type not in spec.dynamics:
            why = f" {spec.dynamics_why} and" if spec.dynamics_why else ""
            out.append(f"train.trainer_type {train.trainer_type!r}{why} works only with scheduler.dynamics_type "
                       f"{' or '.join(map(repr, spec.dynamics))}, got {sched.dynamics_type!r}")
        elif sched.noise_level == 0:
            out.append(f"scheduler.noise_level: 0 makes {sched.dynamics_type} deterministic, so "
                       f"{train.trainer_type} has no log-probabilities to train; use a value > 0 (e.g. 0.7)")
        if coupled and train.rollout_cache != "none":
            out.append(f"train.rollout_cache: {train.rollout_cache} makes the rollout's steps differ from what the "
                       f"weights compute, and {train.trainer_type} trains those very steps' log-probabilities (the "
                       "ratio's old policy): every update would be biased. Use none, or a decoupled algorithm "
                       "(nft, awm, dpo, dgpo, crd)")
        if train.trainer_type in OFFLINE_TRAINER_TYPES and train.rollout_cache != "none":
            out.append(f"train.rollout_cache: {train.trainer_type} trains from a dataset's images or videos, with no rollout to "
                       "cache; use none")
        if coupled and train.train_guidance_scale not in (None, train.guidance_scale):
            out.append(f"train.train_guidance_scale: {train.trainer_type} trains the rollout's own steps, which ran "
                       f"at guidance_scale {train.guidance_scale:g}; another scale would make even the first update "
                       "off-policy. Remove it, or use a decoupled algorithm (nft, awm, dpo, dgpo, crd)")
        return out

    def _model_shape_contradictions(self) -> list[str]:
        """A second expert's guidance scale on a one-transformer model; frame counts the model cannot take."""
        train, model, out = self.train, self.model, []
        for path, scale in (("train.guidance_scale_2", train.guidance_scale_2),
                            ("eval.guidance_scale_2", self.eval.guidance_scale_2)):
            if scale is not None and len(model_family(model.model_type).components) == 1:
                out.append(f"{path}: the CFG scale of a two-expert model's low-noise expert (Wan2.2 A14B); "
                           f"{model.model_type} has one transformer; remove the key")
        frames = (("train.num_frames", train.num_frames), ("eval.num_frames", self.eval.num_frames))
        k = model_family(model.model_type).frame_factor
        if k is not None:
            for path, n in frames:
                if n is not None and (n - 1) % k:
                    out.append(f"{path}: {model.model_type} needs {k}k + 1 frames (the VAE packs {k} frames "
                               f"into one latent), got {n}; nearest: {k * ((n - 1) // k) + 1}")
        else:
            for path, n in frames:
                if n is not None:
                    out.append(f"{path}: {model.model_type} is an image model; remove num_frames")
        return out

    def _launch_problems(self) -> list[str]:
        out = []
        if self.machine_rank >= self.num_machines:
            out.append(f"machine_rank: {self.machine_rank} with num_machines = {self.num_machines}; ranks count "
                       f"from 0, so use 0 .. {self.num_machines - 1}")
        if self.num_processes % self.num_machines:
            out.append(f"num_processes: {self.num_processes} processes do not split evenly over num_machines = "
                       f"{self.num_machines} machines")
        # a file of the user's may hold machine 0's address; a shipped one does not
        own_file = self.config_file is not None and resolve_launch_config(self.config_file).parent != LAUNCH_FOLDER
        if self.num_machines > 1 and not self.main_process_ip and not own_file:
            out.append("main_process_ip: required with num_machines > 1 (machine 0's address); set it, pass "
                       "--main_process_ip, export MASTER_ADDR, or give your own accelerate config_file that holds it")
        return out

    def _size_problems(self) -> list[str]:
        """Sizes the model family cannot take; the pipeline folder's exact factor is checked again
        before loading (models/preflight.py), where its config files can be read."""
        name = self.model.model_type
        family = model_family(name)
        sizes = [("train.resolution", self.train.resolution), ("eval.resolution", self.eval.resolution)]
        sizes += [(f"data.datasets[{i}].eval_resolution", source.eval_resolution)
                  for i, source in enumerate(self.data.datasets or [])]
        conditioned = [(f"{part}.{key}", getattr(section, key)) for part, section in (("train", self.train),
                       ("eval", self.eval)) for key in ("condition_image_size", "auto_resize")
                       if getattr(section, key) is not None]
        if "images" not in family.conditions:  # video-to-video: the video is encoded at the size generated
            resized = [path for path, _ in conditioned if path.endswith("condition_image_size")]
            if resized:
                return [f"{path}: {name} takes condition videos, encoded at the size generated; the key is for "
                        "condition images; remove it" for path in resized]
        strengths = [f"{part}.strength" for part, section in (("train", self.train), ("eval", self.eval))
                     if section.strength is not None]
        if strengths and "videos" not in family.conditions:
            return [f"{path}: {name} does not start from a condition video; the key is for video-to-video "
                    "(wan2_v2v); remove it" for path in strengths]
        sizes += [(path, value) for path, value in conditioned if path.endswith("condition_image_size")]
        found = (size_problem(key, value, family.pixel_factor, name, family.why)
                 for key, value in sizes if value is not None)
        return [line for line in found if line]

    def _decoupled_contradictions(self) -> list[str]:
        train, out = self.train, []
        name, spec = train.trainer_type, ALGORITHM_SPECS[train.trainer_type]
        if "kl_type" in train.model_fields_set and train.kl_type == "x-based":
            out.append(f"train.kl_type: 'x-based' compares the sampler's Gaussian steps, which {name} does not "
                       "train (it trains on the forward process); use 'v-based'")
        if train.ema_kl_beta > 0 and not spec.ema_kl:
            users = " and ".join(n for n, a in ALGORITHM_SPECS.items() if a.ema_kl)
            out.append(f"train.ema_kl_beta: the KL to the EMA policy is {users}'s; {name} does not use it")
        elif train.ema_kl_beta > 0 and train.ema_decay == 0:
            out.append("train.ema_kl_beta > 0 needs an EMA policy; set train.ema_decay > 0")
        together = self.num_processes * train.per_device_batch_size
        if spec.whole_groups_why and together % train.group_size:
            smallest = train.group_size // math.gcd(self.num_processes, train.group_size)
            out.append(f"train.per_device_batch_size: {name} {spec.whole_groups_why}, so the "
                       f"micro-batch of all processes together (num_processes x per_device_batch_size = "
                       f"{self.num_processes} x {train.per_device_batch_size} = {together}) must hold whole groups, "
                       f"but group_size is {train.group_size}; use a multiple of {smallest}")
        if spec.pairs_per_group and train.unique_sample_num_per_epoch % self.num_processes:
            out.append(f"train.unique_sample_num_per_epoch: {name} pairs the best and worst sample of each group on "
                       f"one process, so the {train.unique_sample_num_per_epoch} groups must split evenly over "
                       f"num_processes = {self.num_processes}")
        return out

    def _window_problems(self) -> list[str]:
        sched, steps = self.scheduler, self.rollout_steps
        given = f"train.num_inference_steps = {self.train.num_inference_steps}"
        if steps != self.train.num_inference_steps:
            given += f" and train.strength = {self.train.strength or DEFAULT_STRENGTH} (a rollout of {steps} steps)"
        if steps == 0:
            return [f"train.strength: {given}: keeps no step; raise either"]
        out = []
        if sched.sde_steps is not None:
            outside = [s for s in sched.sde_steps if s >= steps]
            if outside:
                out.append(f"scheduler.sde_steps: {outside} outside [0, {steps}) with {given}")
        candidates = len(self.sde_step_candidates)
        coupled = self.train.trainer_type in COUPLED_TRAINER_TYPES
        if coupled and self.train.outside_kl_beta > 0 and min(sched.num_sde_steps or candidates, candidates) >= steps:
            out.append(f"train.outside_kl_beta: every one of the {steps} steps is trained, so no step is outside "
                       f"the SDE window; narrow it (scheduler.sde_steps or num_sde_steps) or set outside_kl_beta: 0")
        if sched.num_sde_steps is not None and sched.num_sde_steps > candidates:
            out.append(f"scheduler.num_sde_steps: {sched.num_sde_steps} is more than the {candidates} "
                       f"candidate steps (scheduler.sde_steps, or every step but the last when it is null)")
        return out

    def _geometry_problems(self) -> list[str]:
        train = self.train
        per_step = self.num_processes * train.per_device_batch_size
        if self.samples_per_epoch % per_step:
            return [f"train: unique_sample_num_per_epoch x group_size = {train.unique_sample_num_per_epoch} x "
                    f"{train.group_size} = {self.samples_per_epoch} samples per epoch do not split evenly into "
                    f"batches of num_processes x per_device_batch_size = {self.num_processes} x "
                    f"{train.per_device_batch_size} = {per_step}"]
        micro = self.micro_steps_per_epoch
        how = (f"{self.optimize_batches_per_epoch} batches per process x {self.trained_steps_per_sample} trained "
               f"steps per sample")
        if train.gradient_accumulation_steps == "auto":
            name, value = "gradient_step_per_epoch", train.gradient_step_per_epoch
        else:
            name, value = "gradient_accumulation_steps", train.gradient_accumulation_steps
        if micro % value:
            return [f"train.{name}: {value} does not divide the {micro} micro-steps per epoch ({how}); "
                    f"choose one of {divisors(micro)}"]
        return []

    # ------------------------------------------------------------------ arithmetic
    @property
    def sde_step_candidates(self) -> list[int]:
        """Step indices the window is drawn from, ascending: by default every step but the last, whose
        noise no later step would remove (Flow-Factory's default); a 1-step rollout has only step 0."""
        given = self.scheduler.sde_steps
        return sorted(given) if given is not None else list(range(max(1, self.rollout_steps - 1)))

    @property
    def rollout_steps(self) -> int:
        """Denoising steps of a training rollout: ``num_inference_steps``, or for a model that starts from its
        condition video (video-to-video) the last ``train.strength`` part of them."""
        steps = self.train.num_inference_steps
        if "videos" not in model_family(self.model.model_type).conditions:
            return steps
        return strength_steps(steps, self.train.strength or DEFAULT_STRENGTH)

    @property
    def trained_steps_per_sample(self) -> int:
        """Denoising steps (coupled) or training timesteps (decoupled) per micro-batch of samples,
        one loss term and backward each (distillation: its units per sample, ``config/distillation.py``)."""
        if self.train.trainer_type in DISTILLATION_SPECS:
            # of the rollout's own steps (video-to-video's: the last strength part of num_inference_steps)
            return micro_steps_per_sample(self.train.trainer_type, self.rollout_steps, self.train.timestep_range)
        if self.train.trainer_type not in COUPLED_TRAINER_TYPES:
            return resolve_num_train_timesteps(self.train)
        n = self.scheduler.num_sde_steps
        return n if n is not None else len(self.sde_step_candidates)

    @property
    def samples_per_epoch(self) -> int:
        return self.train.unique_sample_num_per_epoch * self.train.group_size

    @property
    def batches_per_epoch(self) -> int:
        """Sampling (and training) micro-batches each process runs per epoch."""
        return self.samples_per_epoch // (self.num_processes * self.train.per_device_batch_size)

    @property
    def optimize_batches_per_epoch(self) -> int:
        """Training micro-batches of samples per process; dpo's hold per_device_batch_size pairs, one per group."""
        if ALGORITHM_SPECS[self.train.trainer_type].pairs_per_group:
            groups = self.train.unique_sample_num_per_epoch // self.num_processes
            return -(-groups // self.train.per_device_batch_size)
        return self.batches_per_epoch

    @property
    def micro_steps_per_epoch(self) -> int:
        """Backward passes per process per inner epoch: batches x trained steps."""
        return self.optimize_batches_per_epoch * self.trained_steps_per_sample

    @property
    def gradient_accumulation(self) -> int:
        """Micro-steps per optimizer step."""
        explicit = self.train.gradient_accumulation_steps
        if explicit != "auto":
            return explicit
        return self.micro_steps_per_epoch // self.train.gradient_step_per_epoch

    @property
    def gradient_steps_per_epoch(self) -> int:
        """Optimizer steps per inner epoch."""
        return self.micro_steps_per_epoch // self.gradient_accumulation

    def notes(self) -> list[str]:
        """Settings given that change nothing in this run, with why (``compat.without_effect``)."""
        return without_effect(self) + overlap_notes(self)

    # ------------------------------------------------------------------ output
    def to_yaml(self) -> str:
        """The resolved config, every default filled; ``load_config`` reads it back unchanged."""
        return yaml.dump(self.model_dump(mode="json"), Dumper=ConfigDumper, sort_keys=False,
                         allow_unicode=True, width=100)


class ConfigDumper(yaml.SafeDumper):
    """Block mappings, but short lists of plain values inline: ``resolution: [512, 768]``."""

    def represent_list(self, data):
        flat = all(not isinstance(item, (dict, list)) for item in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


ConfigDumper.add_representer(list, ConfigDumper.represent_list)
