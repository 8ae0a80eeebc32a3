"""The one training loop, on accelerate: sample, score, advantage, optimise, eval, save.

Everything model-specific is behind the adapter, everything algorithm-specific is
behind ``Algorithm.loss``; this file only orders the phases of an epoch.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
import sys
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast_object_list, set_seed
from tqdm.auto import tqdm

from ..advantages import combine_advantages
from ..algorithms import make_algorithm
from ..checkpoint import (RUN_CONFIG, CheckpointError, check_fits, checkpoint_dir, find_checkpoint,
                          load_checkpoint, read_state, save_checkpoint, write_atomic)
from ..config import ConfigError
from ..config.sections import component_targets
from ..config.train import COUPLED_TRAINER_TYPES, OFFLINE_TRAINER_TYPES
from ..data import MissingPromptFile, epoch_sampler, process_share, share_slice
from ..data.offline import OFFLINE_KINDS, load_offline_sources
from ..data.sources import per_source_means, source_indices
from ..dynamics import make_dynamics
from ..dynamics.window import choose_sde_steps
from ..guards import NonFiniteError, NonFiniteGuard, all_finite, check_pipeline_finite, nonfinite_rewards
from ..media import VIDEO_FPS, caption, plot_curves, sample_grid, save_grid
from ..models import get_adapter_class, load_adapter
from ..models.lora import apply_lora
from ..models.preflight import check_before_loading, check_experts, check_reward_inputs
from ..precision import Precision, avoid_cudnn_attention, enable_cpu_fp16, run_mixed_precision
from ..prompt_cache import ConditionCache, PromptCache
from ..rewards import RewardSet
from ..rollout_cache import RolloutCache
from ..sampling import (Rollouts, SamplingSettings, collect_rollouts, condition_size, gather_scores, load_split,
                        sample_prompts, split_size)
from ..seeding import generator
from ..sharding import (accelerator_kwargs, all_finite_everywhere, backend_of, fill_deepspeed_config,
                        load_frozen_models_whole, local, prepare_sharded, release_gathered, reshard_all)
from ..start_checks import check_prompt_counts
from ..timer import PhaseTimer
from .ema import EMA_FILE, WeightCopy, ema_decay_at, load_ema
from .interrupt import StopFlag, TrainingInterrupted
from .offline import OfflineEpochs
from .optimize import OptimizeSettings, optimize_epoch
from .policy import AdapterPolicy
from .run_folder import RunFolder, RunFolderError
from .optimizers import make_optimizer
from .sharded import (check_experts_before_loading, check_optimizer_backend, check_shardable, gather_for_save,
                      resume_engine_state)
from .tracking import check_backend, flat_hparams, log_media

logger = logging.getLogger(__name__)
SCALER_FILE = "grad_scaler.pt"  # fp16's gradient scaler (its loss scale and growth tracker)


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        train, model = cfg.train, cfg.model
        check_before_loading(cfg)  # the pipeline folder fits model_type and resolution: reads JSON only
        self.backend = check_backend(cfg.log.logging_backend)
        on_cpu = not torch.cuda.is_available()
        mixed_precision = run_mixed_precision(cfg.mixed_precision)  # "no" on CPU unless FF_CPU_MIXED_PRECISION
        save_dir = Path(cfg.log.save_dir).expanduser()
        self.accelerator = Accelerator(mixed_precision=mixed_precision, log_with=self.backend,
                                       project_dir=str(save_dir / cfg.log.run_name), **accelerator_kwargs(on_cpu))
        if on_cpu and mixed_precision == "fp16":
            enable_cpu_fp16(self.accelerator)  # accelerate runs fp16 on GPUs only
        if not on_cpu:
            avoid_cudnn_attention()
        self.precision = Precision.of(mixed_precision, self.accelerator.device, model.master_weight_dtype,
                                      train.latent_storage_dtype)
        self._say(self.precision.describe())
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            load_frozen_models_whole()  # before the rewards and the pipeline load
        # a default run name holds a timestamp each process drew itself: the main process's wins
        self.run_dir = save_dir / self._from_main(lambda: cfg.log.run_name)
        project = self.accelerator.project_configuration
        project.project_dir = project.logging_dir = str(self.run_dir)
        self.seed = train.seed if train.seed is not None else cfg.seed
        set_seed(self.seed)  # LoRA's initial A matrices come from the global generator
        self.timer = PhaseTimer()
        self.stop = StopFlag()
        self.guard = NonFiniteGuard(train.max_nonfinite_in_a_row)

        # cheap things first, so a bad checkpoint, run folder, dataset or reward fails before the model loads
        self.resume_from, self.start_weights, resumed = None, None, {"epoch": 0}
        if model.resume_path:
            self.resume_from, resumed = find_checkpoint(model.resume_path, self.run_dir)
            check_fits(self.resume_from, resumed, model.finetune_type, model.trained_components)
            if model.resume_type in ("lora", "full"):  # Flow-Factory's: a new run from these weights
                self.start_weights, self.resume_from, resumed = self.resume_from, None, {"epoch": 0}
            elif resumed["epoch"] >= train.max_epochs:
                raise CheckpointError(f"model.resume_path: {self.resume_from} has {resumed['epoch']} epochs done "
                                      f"and train.max_epochs is {train.max_epochs}: nothing to train; set "
                                      f"train.max_epochs above {resumed['epoch']}")
        # the prompts and the condition files they name, checked against what the model takes
        adapter_cls = get_adapter_class(model.model_type)
        self.offline_records = None  # sft, offline-dpo: the dataset's records train instead of rollouts
        self.offline = None  # their epochs (OfflineEpochs), once the model has loaded
        if train.trainer_type in OFFLINE_TRAINER_TYPES:
            if not adapter_cls.trains_offline():
                raise ConfigError(f"train.trainer_type: {train.trainer_type} trains from images, which "
                                  f"{model.model_type} does not encode in this version (sd3-5, flux1, flux1-kontext do)")
            self.offline_records = load_offline_sources(cfg.data.sources, "train", OFFLINE_KINDS[train.trainer_type])
            if len(self.offline_records) < self.accelerator.num_processes:
                raise ConfigError(f"num_processes: {self.accelerator.num_processes} processes, and the dataset "
                                  f"holds {len(self.offline_records)} records: each process needs one")
            self.train_prompts = load_split(cfg, "train", adapter_cls, [r.item for r in self.offline_records])
        else:
            self.train_prompts = load_split(cfg, "train", adapter_cls)
            check_prompt_counts(cfg, self.train_prompts)
        self.test_prompts = self._test_prompts(adapter_cls)
        self.train_size = split_size(cfg, "train", self.train_prompts, adapter_cls)
        self.eval_size = split_size(cfg, "eval", self.test_prompts, adapter_cls)
        self.sampler = None if self.offline_records else epoch_sampler(cfg, self.train_prompts, self.seed)
        # several datasets: their names, and each training prompt's dataset (by position in the names)
        self.source_names = [s.name for s in cfg.data.datasets] if cfg.data.datasets is not None else []
        self.train_sources = source_indices(self.train_prompts, self.source_names) if self.source_names else None
        self.run_folder = RunFolder(self.run_dir)
        self._say(f"run folder {self.run_dir}")
        self._from_main(lambda: self.run_folder.claim(self.resume_from, resumed["epoch"], cfg.log.overwrite))
        try:
            self._build(resumed)
        except BaseException:
            self.run_folder.release()  # a run that never started must not keep its folder locked
            raise

    def _build(self, resumed: dict) -> None:
        """The rewards, the model and what trains it; the resumed state (``resumed``: its trainer state)."""
        cfg, train, model = self.cfg, self.cfg.train, self.cfg.model
        check_experts_before_loading(cfg, self.accelerator)
        check_optimizer_backend(cfg, backend_of(self.accelerator))
        self.rollout_cache = RolloutCache.of(train)  # its options checked before the model loads
        policies = get_adapter_class(model.model_type).cache_policies
        if self.rollout_cache is not None and train.rollout_cache not in policies:
            raise ConfigError(f"train.rollout_cache: {train.rollout_cache} does not work with {model.model_type}'s "
                              f"transformer; its policies: {', '.join(policies)}")
        self.rewards = RewardSet.from_configs(cfg.rewards, accelerator=self.accelerator)
        self.eval_rewards = (RewardSet.from_configs(cfg.eval_rewards, accelerator=self.accelerator)
                             if cfg.eval_rewards else self.rewards)
        check_reward_inputs(self.rewards, model.model_type, "rewards")
        check_reward_inputs(self.eval_rewards, model.model_type, "eval_rewards")

        self.adapter = load_adapter(model.model_type, model.model_name_or_path, self.accelerator.device,
                                    self.precision.load)
        # a hub id's experts are known only now (a folder's were checked before loading)
        check_experts(self.adapter.experts(self.adapter.pipeline.config), cfg, model.model_name_or_path)
        self.adapter.guidance_scale_2 = train.guidance_scale_2
        if train.strength is not None:  # video-to-video (the config allows it for no other model)
            self.adapter.strength = train.strength
        if cfg.scheduler.flow_shift is not None:
            self.adapter.set_flow_shift(cfg.scheduler.flow_shift)
        check_pipeline_finite(self.adapter.pipeline, f"model.model_name_or_path: {model.model_name_or_path}")
        if model.attn_backend is not None:  # the name is checked before loading (models/preflight.py)
            self.adapter.set_attention_backend(model.attn_backend)
        # a model whose text encoder reads the conditions caches its prompts with them (the condition cache)
        self.prompt_cache = (self._cache_prompts() if cfg.data.enable_preprocess and
                             not self.adapter.text_reads_conditions else None)
        self.condition_cache = (self._cache_conditions() if cfg.data.enable_preprocess and
                                self.adapter.condition_inputs else None)
        # as the model samples: LTX-2 keeps its audio on the ODE, whatever the SDE (models/ltx2.py)
        self.dynamics = self.adapter.sampling_dynamics(make_dynamics(cfg.scheduler.dynamics_type,
                                                                     cfg.scheduler.noise_level))
        self.algorithm = make_algorithm(train.trainer_type, train, self.dynamics)
        self.params = self._make_trainable()
        self._check_trained_steps()
        self.sharding = backend_of(self.accelerator)  # ddp (one process too), fsdp or deepspeed
        self.engine = None  # DeepSpeed's, once prepared
        self.epoch, self.global_step = 0, 0
        self.history: list[dict] = []  # one record of training metrics per epoch
        self.eval_history: list[dict] = []  # eval rewards, keyed by epochs completed
        if self.sharding == "ddp":
            self._make_weight_copies()  # before the wrapper and torch.compile, as always on this path
            self.optimizer = self.accelerator.prepare(self._make_optimizer(self.params))
            self._compile()  # after LoRA (the compiled graph holds its layers), before DDP's wrapper
            # False for a multi-expert model: optimize_epoch then averages the gradients across processes itself
            self.backend_syncs_gradients = self.adapter.wrap_transformer(self.accelerator.prepare)
            self._load_weights(resumed)
        elif self.sharding == "fsdp":
            self._compile()
            self._prepare_sharded()
            self._make_weight_copies()  # of the shards: no process holds a full copy
            self._load_weights(resumed)  # every process keeps its shard of the checkpoint's full tensors
        else:  # DeepSpeed keeps master copies of the weights inside its engine: they must start from the checkpoint
            check_shardable(cfg, self.accelerator, len(self.adapter.transformers))
            self._compile()
            self._load_weights(resumed, before_prepare=True)
            self._prepare_sharded()
            if self.resume_from is not None:
                resume_engine_state(self.engine, self.resume_from, resumed, self.accelerator.num_processes)
            self._make_weight_copies()
            self._load_copies()
        # what each process holds of the trained weights (the checkpoint records it): all of them unless sharded
        held = torch.tensor([sum(local(p).numel() for p in module.parameters() if p.requires_grad)
                             for module in self.trained.values()], device=self.accelerator.device)
        held = self.accelerator.gather(held).reshape(self.accelerator.num_processes, len(self.trained))
        self.held_per_process = held.sum(1).tolist()
        self.held_per_component = dict(zip(self.trained, held.T.tolist()))

    def _load_weights(self, resumed: dict, before_prepare: bool = False) -> None:
        """The weights of ``model.resume_type``'s start, or of the checkpoint resumed, with the optimizer
        state and the weight copies (unless ``before_prepare``: DeepSpeed's engine does not exist yet)."""
        model = self.cfg.model
        if self.start_weights is not None:
            load_checkpoint(self.start_weights, self.adapter, model.finetune_type, components=model.trained_components)
            self._say(f"starting from the weights of {self.start_weights} (model.resume_type: {model.resume_type})")
            if not before_prepare:
                for snapshot in self.snapshots.values():  # CRD's and DGPO's copies start from them too
                    snapshot.copy_from_params()
        if self.resume_from is None:
            return
        if before_prepare:  # the optimizer state comes with the engine's own (resume_engine_state)
            load_checkpoint(self.resume_from, self.adapter, model.finetune_type, None, model.trained_components)
        elif not load_checkpoint(self.resume_from, self.adapter, model.finetune_type, self.optimizer,
                                 model.trained_components):
            logger.warning("model.resume_path %s holds no optimizer state (saved with log.save_model_only); "
                           "the optimizer restarts", self.resume_from)
        scaler_state = Path(self.resume_from) / SCALER_FILE
        if self.accelerator.scaler is not None and scaler_state.exists():
            self.accelerator.scaler.load_state_dict(torch.load(scaler_state, map_location="cpu", weights_only=True))
        self.epoch, self.global_step = resumed["epoch"], resumed["global_step"]
        self.history, self.eval_history = resumed.get("history", []), resumed.get("eval_history", [])
        if not before_prepare:
            self._load_copies()
        self._say(f"resumed from {self.resume_from}, epoch {self.epoch} of {self.cfg.train.max_epochs} done")

    def _load_copies(self) -> None:
        """The EMA and the algorithm's snapshots of the checkpoint resumed (CRD's start from the start weights)."""
        if self.resume_from is None:
            for snapshot in self.snapshots.values() if self.start_weights is not None else ():
                snapshot.copy_from_params()
            return
        if self.ema is not None and not load_ema(self.ema, self.resume_from):
            logger.warning("model.resume_path %s holds no EMA state (ema.pt); the EMA restarts from the "
                           "resumed weights", self.resume_from)
        for name, snapshot in self.snapshots.items():
            if not load_ema(snapshot, self.resume_from, f"{name}.pt"):
                snapshot.copy_from_params()
                logger.warning("model.resume_path %s holds no %s weights (%s.pt); they restart from the "
                               "resumed weights", self.resume_from, name, name)

    def _make_optimizer(self, params: list) -> torch.optim.Optimizer:
        return make_optimizer(params, self.cfg.train)

    def _compile(self) -> None:
        model = self.cfg.model
        if model.torch_compile != "none":
            chosen = self.adapter.compile_transformers(model.torch_compile, mode=model.compile_mode)
            self._say("torch.compile: " + ", ".join(f"{k} {v}" for k, v in chosen.items()))

    def _make_weight_copies(self) -> None:
        """The EMA, the rollout's weights, the algorithm's snapshots and the policy with its reference."""
        train, model = self.cfg.train, self.cfg.model
        # EMA of the trained weights (train.ema_decay > 0), and for NFT / AWM the weights the
        # rollout sampled with: the EMA itself when off_policy, else a copy taken at sampling time
        ema_device = None if train.ema_device == "same" else train.ema_device
        # a sharded model's copies are of its shards or partitions, swapped in place: the gathered weights are
        # freed around a swap so that the next forward gathers the swapped ones
        reshard = None
        if self.sharding == "fsdp":
            reshard = lambda: reshard_all(self.trained.values())  # noqa: E731
        elif self.sharding == "deepspeed" and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            reshard = lambda: release_gathered(self.params)  # noqa: E731
        copy = lambda device: WeightCopy(self.params, device, before_swap=reshard)  # noqa: E731
        self.ema = copy(ema_device) if train.ema_decay > 0 else None
        self.rollout_weights = (copy(ema_device) if self.algorithm.uses_sampling_policy and not train.off_policy
                                else None)
        # the algorithm's own named copies of the weights: moved after each epoch (CRD's old and sampling
        # models) or after each optimizer step (DGPO's fast old-policy EMA, on ema_ref_device)
        self.snapshot_decays = self.algorithm.weight_snapshots
        self.step_snapshot_decays = self.algorithm.step_snapshots
        self.snapshots = {name: copy(ema_device) for name in self.snapshot_decays}
        ema_ref_device = None if train.ema_ref_device == "same" else train.ema_ref_device
        self.snapshots.update({name: copy(ema_ref_device) for name in self.step_snapshot_decays})
        # the reference is the starting weights: taken before any resume; of a sharded model, its shards
        reference = None
        if self.algorithm.needs_reference and model.finetune_type == "full" and self.sharding != "ddp":
            reference = copy(None if train.ref_param_device == "same" else train.ref_param_device)
        self.policy = AdapterPolicy(self.adapter, train.loss_guidance_scale, model.finetune_type,
                                    keep_reference=self.algorithm.needs_reference,
                                    ref_param_device=train.ref_param_device, ema=self.ema,
                                    sampling_weights=self.ema if train.off_policy else self.rollout_weights,
                                    snapshots=self.snapshots, components=model.trained_components,
                                    reference=reference, one_scale_for_experts=train.train_guidance_scale is not None)

    def _prepare_sharded(self) -> None:
        """The trained networks (each expert its own FSDP2 root) and one optimizer over them, prepared
        together (``sharding.py``)."""
        acc = self.accelerator
        if self.sharding == "deepspeed":
            fill_deepspeed_config(acc.state.deepspeed_plugin, self.cfg.train.per_device_batch_size,
                                  self.cfg.gradient_accumulation, self.cfg.train.max_grad_norm, acc.num_processes)
        prepared, self.optimizer, self.engine = prepare_sharded(acc, self.sharding, self.trained,
                                                                self._make_optimizer)
        self.adapter.use_prepared(prepared)
        self.backend_syncs_gradients = True  # FSDP2 / DeepSpeed: optimize_epoch must not average them again
        # FSDP2 replaced every parameter with its shard (a DTensor): what trains from here on
        self.params = [p for module in self.trained.values() for p in module.parameters() if p.requires_grad]

    def _test_prompts(self, adapter_cls) -> list:
        """The test split when evaluation is on; a dataset without one trains without evaluation,
        as in Flow-Factory (a broken test file is still an error)."""
        cfg = self.cfg
        if not cfg.eval.eval_freq or not (cfg.eval_rewards or cfg.rewards):  # an offline run may score nothing
            return []
        try:
            if self.offline_records is not None:  # its test split holds records too: their prompts
                kind = OFFLINE_KINDS[cfg.train.trainer_type]
                return load_split(cfg, "test", adapter_cls,
                                  [r.item for r in load_offline_sources(cfg.data.sources, "test", kind)])
            return load_split(cfg, "test", adapter_cls)
        except MissingPromptFile as missing:
            logger.warning("%s; evaluation is off for this run (eval.eval_freq: %d)", missing,
                           self.cfg.eval.eval_freq)
            return []

    def _cache_prompts(self) -> PromptCache:
        """Every train and test prompt encoded once (``prompt_cache.py``); then the text encoders
        leave the device (``data.text_encoders_after_preprocess``)."""
        cfg, acc = self.cfg, self.accelerator
        train_scale = cfg.train.conditioning_guidance_scale
        items = ([(it.prompt, it.negative_prompt, train_scale) for it in self.train_prompts]
                 + [(it.prompt, it.negative_prompt, cfg.eval.guidance_scale) for it in self.test_prompts])
        with acc.autocast():  # as the rollout would encode them
            cache = PromptCache.build(self.adapter, items, cfg.data.cache_dir, cfg.data.preprocessing_batch_size,
                                      **self._cache_share())
        self.adapter.release_text_encoders(cfg.data.text_encoders_after_preprocess)
        return cache

    def _cache_share(self) -> dict:
        """Who builds the caches: the processes of each machine into its own cache_dir (local), or all of them
        into a shared one (global); each encodes its share of what is missing."""
        cfg, acc = self.cfg, self.accelerator
        local = cfg.data.preprocess_parallelism == "local"
        share = ((acc.local_process_index, acc.num_processes // cfg.num_machines, acc.is_local_main_process)
                 if local else (acc.process_index, acc.num_processes, acc.is_main_process))
        return dict(force=cfg.data.force_reprocess, share=share, barrier=acc.wait_for_everyone)

    def _train_settings(self, **overrides) -> SamplingSettings:
        train = self.cfg.train
        height, width = self.train_size
        return SamplingSettings(height, width, train.num_frames, train.num_inference_steps, train.guidance_scale,
                                train.per_device_batch_size, self.seed, condition_size=condition_size(train),
                                **overrides)

    def _cache_conditions(self) -> ConditionCache:
        """A conditioned model's condition files encoded once, for the sizes train and eval prepare them at."""
        cfg, acc = self.cfg, self.accelerator
        train, test = self._train_settings().geometry, SamplingSettings.for_eval(cfg.eval, self.eval_size).geometry
        # the guidance scale each split's prompts are encoded at: what a model whose text encoder reads the
        # conditions encodes them with here
        requests = ([(it, train, cfg.train.conditioning_guidance_scale) for it in self.train_prompts]
                    + [(it, test, cfg.eval.guidance_scale) for it in self.test_prompts])
        with acc.autocast():  # as the rollout would encode them
            cache = ConditionCache.build(self.adapter, requests, cfg.data.cache_dir, cfg.data.preprocessing_batch_size,
                                         **self._cache_share())
        if self.adapter.text_reads_conditions:  # every prompt is encoded in it, with its conditions
            self.adapter.release_text_encoders(cfg.data.text_encoders_after_preprocess)
        return cache

    def _say(self, line: str) -> None:
        """A line for the user, once (the main process's)."""
        if self.accelerator.is_main_process:
            print(f"ff-train: {line}", file=sys.stderr, flush=True)

    def _from_main(self, fn):
        """``fn()`` on the main process, its result (or its RunFolderError) on every process."""
        result = error = None
        if self.accelerator.is_main_process:
            try:
                result = fn()
            except RunFolderError as e:
                error = str(e)
        if self.accelerator.num_processes > 1:
            result, error = broadcast_object_list([result, error])
        if error is not None:
            raise RunFolderError(error)
        return result

    def _make_trainable(self) -> list[torch.nn.Parameter]:
        """LoRA on, or every weight of, the networks ``model.trained_components`` names; the others (a
        multi-expert model's frozen expert) get no adapter and no gradient."""
        model = self.cfg.model
        self.trained = {name: self.adapter.transformers[name] for name in model.trained_components}
        params = []
        for name, transformer in self.trained.items():
            if model.finetune_type == "lora":
                apply_lora(transformer, model.lora_rank, model.lora_alpha,
                           component_targets(model.target_modules, name, model.target_components),
                           self.adapter.default_lora_targets)
            else:
                transformer.requires_grad_(True)
            params += [p for p in transformer.parameters() if p.requires_grad]
            if self.cfg.train.enable_gradient_checkpointing:
                transformer.enable_gradient_checkpointing()
        for p in params:  # trainable weights keep their own precision (fp32 by default) under mixed precision
            p.data = p.data.to(self.precision.master)
        return params

    def _check_trained_steps(self) -> None:
        """A step of the grpo family trains the expert that denoises it: a step of an expert that
        the run leaves frozen (``model.target_components``, ``target_modules``) trains nothing (Wan2.2 A14B)."""
        cfg = self.cfg
        if cfg.train.trainer_type not in COUPLED_TRAINER_TYPES or len(self.adapter.transformers) == 1:
            return
        height, width = self.train_size
        sigmas = self.adapter.sigmas(cfg.train.num_inference_steps, height, width, cfg.train.num_frames)
        experts = self.adapter.experts_at(sigmas[:-1])
        frozen = {s: experts[s] for s in cfg.sde_step_candidates if experts[s] not in cfg.model.trained_components}
        if not frozen:
            return
        message = (f"scheduler.sde_steps: steps {sorted(frozen)} are denoised by {sorted(set(frozen.values()))}, "
                   f"which the run does not train (it trains {cfg.model.trained_components}: model.target_components "
                   "and target_modules)")
        if len(frozen) == len(cfg.sde_step_candidates):
            raise ConfigError(f"{message}; no step of the window trains anything: choose steps of "
                              f"{cfg.model.trained_components} (sigmas {[round(float(x), 3) for x in sigmas[:-1]]})")
        logger.warning("%s; those steps train nothing", message)

    # ------------------------------------------------------------------ phases
    def _local_share(self, n: int) -> slice:
        """This process's contiguous share of ``n`` (``data.share_slice``, the rule ``ff-eval`` and the
        epoch's samples follow): every one of the ``n`` on one process, even when they do not split evenly."""
        return share_slice(n, self.accelerator.process_index, self.accelerator.num_processes)

    def sample_epoch(self, epoch: int) -> Rollouts:
        cfg, train, acc = self.cfg, self.cfg.train, self.accelerator
        if self.offline_records is not None:
            return self._offline_epoch(epoch)
        indices, group_ids = self.sampler.draw(epoch)
        # a lockstep algorithm (DGPO) takes its part of every global micro-batch, which holds whole groups
        share = process_share(len(indices), acc.process_index, acc.num_processes,
                              train.per_device_batch_size if self.algorithm.lockstep else None)
        sample_ids = share.tolist()
        if self.source_names:  # this process's samples' datasets, gathered beside their rewards
            self.epoch_sources = self.train_sources[indices[share]].to(acc.device)
            self.epoch_datasets = None  # gathered when first asked (_gathered_datasets)
        sde_steps = None
        if self.dynamics.stochastic:
            sde_steps = choose_sde_steps(cfg.rollout_steps, cfg.sde_step_candidates,
                                         cfg.scheduler.num_sde_steps, generator("window", cfg.scheduler.seed, epoch))
        settings = self._train_settings(sde_steps=sde_steps, same_latent=train.same_latent,
                                        record_means=self.algorithm.records_step_means,
                                        storage_dtype=self.precision.storage, offload=train.offload_samples_to_cpu,
                                        conditioning_guidance_scale=train.conditioning_guidance_scale,
                                        keep_states=tuple(self.algorithm.kept_states(cfg.rollout_steps,
                                                                                     sde_steps)))
        if self.rollout_weights is not None:
            self.rollout_weights.copy_from_params()  # NFT / AWM's old policy: the weights sampled with
        # off_policy: the rollout samples with the EMA weights while the current policy trains
        sampling_weights = self.ema.applied() if train.off_policy else nullcontext()
        snapshot = self.algorithm.sampling_snapshot(self.global_step)
        if snapshot is not None:  # CRD's sampling model; DGPO's fast EMA after switch_ema_ref steps
            sampling_weights = self.snapshots[snapshot].applied()
        # train.rollout_cache: the cache hooks for these rollouts only, gone before anything trains
        cached = self.rollout_cache.applied(self.adapter) if self.rollout_cache is not None else nullcontext()
        with sampling_weights, cached:
            rollouts = collect_rollouts(
                self.adapter, self.dynamics, [self.train_prompts[i] for i in indices[share]], group_ids[share],
                sample_ids, settings, epoch=epoch, reward_set=self.rewards, timer=self.timer,
                autocast=self.accelerator.autocast, prompt_cache=self.prompt_cache,
                condition_cache=self.condition_cache, cache=self.rollout_cache)
        return rollouts

    def _offline_epoch(self, epoch: int) -> Rollouts:
        """An offline run's epoch: the dataset's images in place of rollouts (``trainer/offline.py``)."""
        acc, train = self.accelerator, self.cfg.train
        if self.offline is None:
            settings = self._train_settings(conditioning_guidance_scale=train.conditioning_guidance_scale)
            self.offline = OfflineEpochs(self.offline_records, self.adapter, settings, self.seed)
        with self.timer.phase("sampling"):
            rollouts, self.offline_advantages = self.offline.epoch(
                epoch, acc.process_index, acc.num_processes, acc.autocast, self.prompt_cache, self.condition_cache)
        return rollouts

    def compute_advantages(self, rollouts: Rollouts, epoch: int) -> torch.Tensor | None:
        """Over the global batch (all ranks), then this rank's share; None (and a counted skip)
        when a reward or an advantage is NaN or inf. An offline run's are its records' (``_offline_epoch``)."""
        if self.offline_records is not None:
            return self.offline_advantages
        gather = self.accelerator.gather
        rewards = {k: gather(v) for k, v in rollouts.rewards.items()}
        datasets = self._gathered_datasets()
        # a reward routed to some datasets was not scored (NaN) on the others' samples, where it weighs 0
        scored = {k: v[self.rewards.scored_mask(k, datasets, len(v)).to(v.device)] for k, v in rewards.items()}
        problem = nonfinite_rewards(scored)
        if problem is None:
            group_ids = gather(rollouts.group_ids.to(self.accelerator.device))
            adv = combine_advantages(rewards, self.rewards.sample_weights(datasets), group_ids,
                                     self.cfg.train.advantage_aggregation, self.cfg.train.global_std)
            if all_finite([adv]):
                return adv[self._local_share(len(adv))]
            problem = "advantages are NaN or inf (rewards too large to normalise?)"
        self.guard.skip(f"epoch {epoch}: {problem}; the epoch's update is skipped")
        return None

    def optimize(self, rollouts: Rollouts, advantages: torch.Tensor, epoch: int) -> dict[str, float]:
        train = self.cfg.train
        for transformer in self.trained.values():
            transformer.train()
        metrics, steps = optimize_epoch(
            self.algorithm, self.policy, rollouts, advantages, self._optimize_settings(),
            accelerator=self.accelerator, optimizer=self.optimizer, params=self.params,
            syncing_module=self.adapter.denoiser if self.backend_syncs_gradients else None, guard=self.guard,
            seed=self.seed, epoch=epoch, steps_before=self.global_step,
            step_snapshots={name: (self.snapshots[name], decay) for name, decay in self.step_snapshot_decays.items()})
        self.global_step += steps
        finite = all_finite_everywhere(self.params) if self.sharding != "ddp" else all_finite(self.params)
        if not finite:  # finite gradients, yet a step overflowed: stop before it spreads
            raise NonFiniteError(f"epoch {epoch}: an optimizer step made trained weights NaN or inf (mean "
                                 f"gradient norm {metrics.get('train/grad_norm', float('nan')):.3g}); lower "
                                 "train.learning_rate. The last checkpoint is intact")
        for transformer in self.trained.values():
            transformer.eval()
        if self.ema is not None and (epoch + 1) % train.ema_update_interval == 0:
            decay = ema_decay_at(train.ema_decay_schedule, epoch, train.ema_decay, train.max_epochs,
                                 train.flat_steps, train.ramp_rate)
            self.ema.update(decay)
            metrics["train/ema_decay"] = decay
        for name, decay_of in self.snapshot_decays.items():
            decay = decay_of(self.global_step)
            self.snapshots[name].update(decay)
            metrics[f"train/{name}_decay"] = decay
        return metrics

    @torch.no_grad()
    def evaluate(self, epoch: int) -> dict[str, float]:
        """ODE samples of the test prompts at the eval resolution; rewards, and a grid saved as PNG."""
        ev = self.cfg.eval
        items = self.test_prompts[: ev.num_samples] if ev.num_samples else self.test_prompts
        share = self._local_share(len(items))
        self.adapter.guidance_scale_2 = ev.guidance_scale_2
        train_strength = getattr(self.adapter, "strength", None)  # video-to-video's
        if ev.strength is not None:
            self.adapter.strength = ev.strength
        try:  # what ff-eval samples for the same config: its numbers agree with these
            rollouts = sample_prompts(self.adapter, items[share], SamplingSettings.for_eval(ev, self.eval_size),
                                      sample_ids=list(range(len(items)))[share], reward_set=self.eval_rewards,
                                      autocast=self.accelerator.autocast, prompt_cache=self.prompt_cache,
                                      condition_cache=self.condition_cache)
        finally:
            self.adapter.guidance_scale_2 = self.cfg.train.guidance_scale_2
            if ev.strength is not None:
                self.adapter.strength = train_strength
        scores = rollouts.rewards
        # the mean over every test prompt once, whatever the shares' sizes
        every = gather_scores(scores)
        datasets = [it.dataset for it in items] if self.source_names else None
        means = {f"eval/reward/{k}": v[self.eval_rewards.scored_mask(k, datasets, len(v))].mean().item()
                 for k, v in every.items()}
        if self.source_names:
            means.update(per_source_means(every, source_indices(items, self.source_names), self.source_names,
                                          "eval/source/{source}/reward/{reward}"))
        self.eval_history.append({"epoch": epoch, **means})
        if self.accelerator.is_main_process:  # its grid: its own share, the first test prompts
            shown = min(16, len(rollouts.prompts))
            captions = [caption(rollouts.prompts[i], {k: v[i].item() for k, v in scores.items()})
                        for i in range(shown)]
            conditions = rollouts.conditions.per_sample()[:shown] if rollouts.conditions else None
            grid = sample_grid(rollouts.media[:shown], captions, conditions=conditions)
            # a PNG, or for a video model an mp4 or an animated GIF (log.video_format)
            fps = getattr(self.adapter, "frame_rate", VIDEO_FPS)  # LTX-2's 24; Wan's 16
            path = save_grid(grid, self.run_dir / "samples" / f"eval_epoch_{epoch:04d}", self.cfg.log.video_format, fps)
            log_media(self.accelerator, self.backend, "eval/samples", grid, epoch, path, fps)
            self.accelerator.log(means, step=epoch)
        return means

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        """Train to ``max_epochs``. SIGINT / SIGTERM end it with a checkpoint of the last finished
        epoch and ``TrainingInterrupted``; the run folder is released however it ends."""
        try:
            with self.stop.installed():
                return self._train()
        finally:
            self.close()

    def close(self) -> None:
        """Release the run folder and the rewards' thread pools (``train`` does it when it ends)."""
        self.rewards.close()
        self.eval_rewards.close()
        self.run_folder.release()

    def _train(self) -> list[dict]:
        cfg, acc = self.cfg, self.accelerator
        self.run_folder.started()  # built and starting: the run log.overwrite replaces goes now
        if self.backend:
            acc.init_trackers(cfg.log.project, config=flat_hparams(cfg.model_dump(mode="json")))
        bar = tqdm(range(self.epoch, cfg.train.max_epochs), initial=self.epoch, total=cfg.train.max_epochs,
                   desc="epochs", disable=not (acc.is_main_process and cfg.log.verbose))
        # the stop flag is read where the weights are those of a finished epoch
        for epoch in bar:
            record = {"epoch": epoch}
            if self.test_prompts and epoch % cfg.eval.eval_freq == 0:
                bar.set_postfix_str("eval")
                self.evaluate(epoch)
            if self.stop.raised(acc):
                break
            self.timer.reset()
            with self.timer.phase("epoch"):
                bar.set_postfix_str("sampling")
                rollouts = self.sample_epoch(epoch)
                if self.stop.raised(acc):
                    break
                advantages = self.compute_advantages(rollouts, epoch)
                bar.set_postfix_str("training")
                if advantages is not None:
                    with self.timer.phase("training"):
                        record.update(self.optimize(rollouts, advantages, epoch))
                else:
                    record["train/skipped_updates"] = cfg.gradient_steps_per_epoch * cfg.train.num_inner_epochs
            record.update(self._epoch_metrics(rollouts, advantages))
            self.epoch = epoch + 1
            self.history.append(record)
            acc.log({k: v for k, v in record.items() if k != "epoch"}, step=epoch)
            bar.set_postfix_str(f"reward {self._headline(record):.4f}")
            if self._save_due():
                self.save()
            if self.stop.raised(acc):
                break
        if self.stop.signum is not None:
            checkpoint = self.save()
            acc.wait_for_everyone()
            acc.end_training()
            raise TrainingInterrupted(self.stop.signum, checkpoint or checkpoint_dir(self.run_dir, self.epoch))
        if self.test_prompts and not any(e["epoch"] == self.epoch for e in self.eval_history):
            self.evaluate(self.epoch)  # the final weights are always evaluated
        if not self._save_due():
            self.save()  # the final weights are always saved
        elif acc.is_main_process:
            self._plot_rewards()  # with the final eval
        # no process may tear the process group down while another still works (gloo hangs)
        acc.wait_for_everyone()
        acc.end_training()
        return self.history

    def _save_due(self) -> bool:
        return bool(self.cfg.log.save_freq) and self.epoch % self.cfg.log.save_freq == 0

    def _optimize_settings(self) -> OptimizeSettings:
        """The config's; an offline run's accumulation counts its epoch: a pass over the dataset, this process's
        share of the records in micro-batches, ``gradient_step_per_epoch`` optimizer steps (or
        ``gradient_accumulation_steps`` micro-steps each)."""
        settings, train = OptimizeSettings.from_config(self.cfg), self.cfg.train
        if self.offline_records is None:
            return settings
        if isinstance(train.gradient_accumulation_steps, int):
            return replace(settings, accumulation=train.gradient_accumulation_steps)
        mine = len(self.offline_records) // self.accelerator.num_processes  # OfflineEpochs.epoch's share
        micro = -(-mine // train.per_device_batch_size) * self.algorithm.num_timesteps
        return replace(settings, accumulation=max(1, micro // train.gradient_step_per_epoch))

    def _gathered_datasets(self) -> list[str] | None:
        """The dataset of each of the epoch's samples, in the order of the gathered rewards (several datasets; an
        offline run scores nothing, so None)."""
        if not self.source_names or self.offline_records is not None:
            return None
        if self.epoch_datasets is None:  # gathered once an epoch: the advantages and the metrics read it
            self.epoch_datasets = [self.source_names[i] for i in self.accelerator.gather(self.epoch_sources).tolist()]
        return self.epoch_datasets

    def _epoch_metrics(self, rollouts: Rollouts, advantages: torch.Tensor | None) -> dict[str, float]:
        metrics = {}
        datasets = self._gathered_datasets()
        gathered = {name: self.accelerator.gather(scores) for name, scores in rollouts.rewards.items()}
        for name, scores in gathered.items():
            scores = scores[self.rewards.scored_mask(name, datasets, len(scores)).to(scores.device)]
            finite = scores[torch.isfinite(scores)]  # a skipped epoch still plots its finite rewards
            if len(finite):
                metrics[f"reward/{name}/mean"] = finite.mean().item()
                metrics[f"reward/{name}/std"] = finite.std(unbiased=False).item()
            if len(finite) < len(scores):
                metrics[f"reward/{name}/nonfinite"] = len(scores) - len(finite)
        if datasets is not None:  # several datasets: each one's rewards and groups apart
            sources = torch.tensor([self.source_names.index(d) for d in datasets])
            metrics.update(per_source_means(gathered, sources, self.source_names,
                                            "source/{source}/reward/{reward}/mean"))
            size = self.cfg.train.group_size
            metrics.update({f"source/{name}/groups": int((sources == s).sum()) // size
                            for s, name in enumerate(self.source_names)})
        if advantages is not None:
            adv = self.accelerator.gather(advantages)
            metrics.update({"advantage/mean": adv.mean().item(), "advantage/std": adv.std(unbiased=False).item(),
                            "advantage/abs_max": adv.abs().max().item()})
        if self.adapter.lockstep_experts:  # what running the experts in lockstep cost this epoch, all processes
            idle = torch.tensor([self.adapter.idle_passes], device=self.accelerator.device)
            metrics["sharding/idle_expert_passes"] = int(self.accelerator.gather(idle).sum())
            self.adapter.idle_passes = 0
        if self.accelerator.device.type == "cuda":  # what the epoch's busiest moment held, on this process
            metrics["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(self.accelerator.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.accelerator.device)
        seconds = dict(self.timer.seconds)
        total = seconds.pop("epoch")
        seconds["other"] = total - sum(seconds.values())
        metrics.update({f"time/{k}": v for k, v in seconds.items()})
        metrics["time/epoch"] = total
        return metrics

    def _headline(self, record: dict) -> float:
        return sum(v * self.rewards.weights[k.split("/")[1]] for k, v in record.items()
                   if k.startswith("reward/") and k.endswith("/mean"))

    def save(self) -> Path | None:
        """Checkpoint the weights after ``self.epoch`` epochs (atomic: see checkpoint.py). A sharded model's
        full tensors are gathered first, by every process; the main process writes."""
        gathered = gather_for_save(self) if self.sharding != "ddp" else None
        if not self.accelerator.is_main_process:
            return None
        out = checkpoint_dir(self.run_dir, self.epoch)
        try:
            read_state(out)  # this epoch is already saved (an interrupt right after a save): keep it
            for folder in (gathered.folders if gathered else {}).values():
                shutil.rmtree(folder, ignore_errors=True)
        except CheckpointError:
            state = {"epoch": self.epoch, "global_step": self.global_step, "model_type": self.cfg.model.model_type,
                     "history": self.history, "eval_history": self.eval_history,
                     "sharding": {"backend": self.sharding, "processes": self.accelerator.num_processes,
                                  "trained_values_per_process": self.held_per_process,
                                  "by_component": self.held_per_component}}
            if gathered is None:
                weights, folders = None, {}
                extra = {EMA_FILE: self.ema.state_dict()} if self.ema is not None else {}
                extra.update({f"{name}.pt": snapshot.state_dict() for name, snapshot in self.snapshots.items()})
                optimizer = None if self.cfg.log.save_model_only else self.optimizer
            else:
                weights, optimizer, folders = gathered.weights, gathered.optimizer, gathered.folders
                extra = gathered.extra
            if self.accelerator.scaler is not None and optimizer is not None:  # fp16: the loss scale resumes too
                extra[SCALER_FILE] = self.accelerator.scaler.state_dict()
            save_checkpoint(out, self.adapter, self.cfg.model.finetune_type, optimizer, state, extra,
                            self.cfg.model.trained_components, weights=weights, folders=folders)
        # what ff-sample and ff-eval read to sample a checkpoint as this run's eval did
        write_atomic(self.run_dir / RUN_CONFIG, self.cfg.to_yaml())
        self._plot_rewards()
        return out

    def _plot_rewards(self) -> None:
        series: dict[str, list] = {}
        for record in self.history + self.eval_history:
            for k, v in record.items():
                if k.startswith("eval/reward/") or (k.startswith("reward/") and k.endswith("/mean")):
                    series.setdefault(k, []).append((record["epoch"], v))
        png = io.BytesIO()
        plot_curves(series, "reward per epoch").save(png, format="PNG")
        write_atomic(self.run_dir / "reward_curve.png", png.getvalue())
        write_atomic(self.run_dir / "history.json",
                     json.dumps({"train": self.history, "eval": self.eval_history}, indent=1))
