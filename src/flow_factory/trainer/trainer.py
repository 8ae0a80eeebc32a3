"""The one training loop, on accelerate: sample, score, advantage, optimise, eval, save.

Everything model-specific is behind the adapter, everything algorithm-specific is
behind ``Algorithm.loss``, everything backend-specific (DDP, FSDP2, DeepSpeed) behind
``backends.Backend``; this file builds the run from small builders and orders the phases
of an epoch.
"""

from __future__ import annotations

import logging
import shutil
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from ..advantages import combine_advantages
from ..algorithms import make_algorithm
from ..checkpoint import RUN_CONFIG, CheckpointError, checkpoint_dir, read_state, save_checkpoint, write_atomic
from ..data import process_share, share_slice
from ..dynamics import make_dynamics
from ..dynamics.window import choose_sde_steps
from ..guards import NonFiniteError, NonFiniteGuard, all_finite, nonfinite_rewards
from ..media import VIDEO_FPS
from ..models import get_adapter_class
from ..models.preflight import check_before_loading, check_reward_inputs
from ..rewards import RewardSet
from ..rollout_cache import RolloutCache
from ..eval_sampling import eval_items, eval_parts, grid_samples, sample_eval
from ..sampling import Rollouts, SamplingServices, SamplingSettings, collect_rollouts, condition_size
from ..seeding import generator
from ..timer import PhaseTimer
from .backends import Backend, make_accelerator
from .caches import build_condition_cache, build_prompt_cache
from .interrupt import StopFlag, TrainingInterrupted
from .metrics import (advantage_metrics, eval_means, headline, memory_metrics, reward_metrics, save_eval_grid,
                      time_metrics, write_history)
from .offline import OfflineEpochs, offline_optimize_settings
from .optimize import OptimizeSettings, Stepper, optimize_epoch
from .overlap import StreamedAdvantages
from .run_data import load_run_data
from .roles import Roles
from .run_folder import RunFolder, from_main
from .tracking import check_backend, flat_hparams, log_media
from ..models.lora import make_trainable
from .model import check_trained_steps, load_model
from .weights import SCALER_FILE, ModelSetup, RunStart

logger = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        check_before_loading(cfg)  # the pipeline folder fits model_type and resolution: reads JSON only
        self.tracker = check_backend(cfg.log.logging_backend)
        self.accelerator, self.precision = make_accelerator(cfg, self.tracker)
        self._say(self.precision.describe())
        # a default run name holds a timestamp each process drew itself: the main process's wins
        save_dir = Path(cfg.log.save_dir).expanduser()
        self.run_dir = save_dir / from_main(self.accelerator, lambda: cfg.log.run_name)
        project = self.accelerator.project_configuration
        project.project_dir = project.logging_dir = str(self.run_dir)
        self.seed = cfg.train.seed if cfg.train.seed is not None else cfg.seed
        set_seed(self.seed)  # LoRA's initial A matrices come from the global generator
        self.timer, self.stop = PhaseTimer(), StopFlag()
        self.guard = NonFiniteGuard(cfg.train.max_nonfinite_in_a_row)

        # cheap things first, so a bad checkpoint, run folder, dataset or reward fails before the model loads
        self.start = RunStart(cfg, self.run_dir)
        self.data = load_run_data(cfg, get_adapter_class(cfg.model.model_type), self.accelerator.num_processes,
                                  self.seed)
        self.test_prompts = self.data.test_prompts
        self.offline = None  # an offline run's epochs (OfflineEpochs), once the model has loaded
        self.run_folder = RunFolder(self.run_dir)
        self._say(f"run folder {self.run_dir}")
        claim = lambda: self.run_folder.claim(self.start.resume_from, self.start.resumed["epoch"],  # noqa: E731
                                              cfg.log.overwrite)
        from_main(self.accelerator, claim)
        try:
            self._build()
        except BaseException:
            self.run_folder.release()  # a run that never started must not keep its folder locked
            raise

    def _build(self) -> None:
        """The rewards, the model and what trains it, in the backend's order (``backends.py``)."""
        cfg, train = self.cfg, self.cfg.train
        self.backend = Backend.of(self.accelerator, cfg)
        self.backend.check_before_loading()
        self.rollout_cache = RolloutCache.of(train, get_adapter_class(cfg.model.model_type))
        self.rewards, self.eval_rewards = self._setup_rewards()
        self.adapter = load_model(cfg, self.accelerator.device, self.precision.load)
        self.prompt_cache = build_prompt_cache(cfg, self.accelerator, self.adapter, self.data)
        self.condition_cache = build_condition_cache(cfg, self.accelerator, self.adapter, self.data,
                                                     self._train_settings())
        # as the model samples: LTX-2 keeps its audio on the ODE, whatever the SDE (models/ltx2.py)
        self.dynamics = self.adapter.sampling_dynamics(make_dynamics(cfg.scheduler.dynamics_type,
                                                                     cfg.scheduler.noise_level))
        self.algorithm = make_algorithm(train.trainer_type, train, self.dynamics)
        self.algorithm.bind_model(self.adapter)  # what it reads of the loaded model (TDM: the flow shift)
        self.trained = make_trainable(self.adapter, cfg, self.precision.master)
        self.roles = Roles.of(cfg, self.adapter, self.precision.master)  # distillation: roles beside the generator
        check_trained_steps(cfg, self.adapter, self.data.train_size)
        built = self.backend.build(ModelSetup(cfg, self.adapter, self.algorithm, self.trained, self.start, self._say,
                                              self.roles))
        self.params, self.optimizer, copies = built.params, built.optimizer, built.copies
        self.ema, self.snapshots, self.step_snapshot_decays = copies.ema, copies.snapshots, copies.step_snapshot_decays
        self.copies, self.policy = copies, copies.policy(self.adapter, cfg, self.algorithm)
        self.policy = Roles.started(self.roles, self.policy, self.backend.name, self.start.resume_from)
        resumed = self.start.resumed if self.start.resume_from is not None else {}
        self.epoch, self.global_step = resumed.get("epoch", 0), resumed.get("global_step", 0)
        self.history: list[dict] = resumed.get("history", [])  # one record of training metrics per epoch
        self.eval_history: list[dict] = resumed.get("eval_history", [])  # eval rewards, by epochs completed
        self.held_per_process, self.held_per_component = self.backend.held(self.trained)
        self.held_per_role = self.roles.held(self.accelerator) if self.roles is not None else {}

    def _setup_rewards(self) -> tuple[RewardSet, RewardSet]:
        cfg, model_type = self.cfg, self.cfg.model.model_type
        built = {}  # an eval reward that is a training reward's model shares it (not loaded twice)
        rewards = RewardSet.from_configs(cfg.rewards, accelerator=self.accelerator, built=built)
        eval_rewards = RewardSet.from_configs(cfg.eval_rewards, accelerator=self.accelerator, built=built) \
            if cfg.eval_rewards else rewards
        check_reward_inputs(rewards, model_type, "rewards")
        check_reward_inputs(eval_rewards, model_type, "eval_rewards")
        return rewards, eval_rewards

    def _train_settings(self, **overrides) -> SamplingSettings:
        train = self.cfg.train
        height, width = self.data.train_size
        return SamplingSettings(height, width, train.num_frames, train.num_inference_steps, train.guidance_scale,
                                train.per_device_batch_size, self.seed, condition_size=condition_size(train),
                                **overrides)

    def _say(self, line: str) -> None:
        """A line for the user, once (the main process's)."""
        if self.accelerator.is_main_process:
            print(f"ff-train: {line}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ phases
    def _local_share(self, n: int) -> slice:
        """This process's contiguous share of ``n`` (``data.share_slice``, the rule ``ff-eval`` and the
        epoch's samples follow): every one of the ``n`` on one process, even when they do not split evenly."""
        return share_slice(n, self.accelerator.process_index, self.accelerator.num_processes)

    def sample_epoch(self, epoch: int) -> Rollouts:
        cfg, train, acc = self.cfg, self.cfg.train, self.accelerator
        if self.data.offline_records is not None:
            return self._offline_epoch(epoch)
        indices, group_ids = self.data.sampler.draw(epoch)
        # a lockstep algorithm (DGPO) takes its part of every global micro-batch, which holds whole groups
        share = process_share(len(indices), acc.process_index, acc.num_processes,
                              train.per_device_batch_size if self.algorithm.lockstep else None)
        sample_ids = share.tolist()
        if self.data.source_names:  # this process's samples' datasets, gathered beside their rewards
            self.epoch_sources = self.data.train_sources[indices[share]].to(acc.device)
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
        sampling_weights = self.copies.for_rollout(self.algorithm, self.global_step, train.off_policy)
        # train.rollout_cache: the cache hooks for these rollouts only, gone before anything trains
        cached = self.rollout_cache.applied(self.adapter) if self.rollout_cache is not None else nullcontext()
        with sampling_weights, cached:
            rollouts = collect_rollouts(
                self.adapter, self.dynamics, [self.data.train_prompts[i] for i in indices[share]], group_ids[share],
                sample_ids, settings, epoch=epoch, services=SamplingServices(
                    self.rewards, self.timer, self.accelerator.autocast, self.prompt_cache, self.condition_cache,
                    self.rollout_cache, rewards_pending=train.reward_optimization_overlap))
        return rollouts

    def _offline_epoch(self, epoch: int) -> Rollouts:
        """An offline run's epoch: the dataset's images in place of rollouts (``trainer/offline.py``)."""
        acc, train = self.accelerator, self.cfg.train
        if self.offline is None:
            settings = self._train_settings(conditioning_guidance_scale=train.conditioning_guidance_scale)
            self.offline = OfflineEpochs(self.data.offline_records, self.adapter, settings, self.seed)
        with self.timer.phase("sampling"):
            rollouts, self.offline_advantages = self.offline.epoch(
                epoch, acc.process_index, acc.num_processes, acc.autocast, self.prompt_cache, self.condition_cache)
        return rollouts

    def compute_advantages(self, rollouts: Rollouts, epoch: int) -> torch.Tensor | StreamedAdvantages | None:
        """Over the global batch (all ranks), then this rank's share; None (and a counted skip)
        when a reward or an advantage is NaN or inf. An offline run's are its records' (``_offline_epoch``); with
        rewards still being scored (``train.reward_optimization_overlap``, one process), group by group as they come."""
        offline = self.data.offline_records is not None
        if offline or not self.rewards.names:  # an offline run's are its records'; a distillation run trains on none
            return self.offline_advantages if offline else torch.zeros(len(rollouts.group_ids))
        datasets = self._gathered_datasets()
        if rollouts.pending_rewards is not None:
            n = len(rollouts.group_ids)
            return StreamedAdvantages(rollouts.pending_rewards, rollouts.group_ids, self.rewards.sample_weights(datasets),
                                      {k: self.rewards.scored_mask(k, datasets, n) for k in self.rewards.names},
                                      self.timer, self.accelerator.device)
        gather = self.accelerator.gather
        rewards = {k: gather(v) for k, v in rollouts.rewards.items()}
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
        for transformer in self.trained.values():
            transformer.train()
        stepper = Stepper(self.accelerator, self.optimizer, self.params, self.guard,
                          syncing_module=self.backend.syncing_module(self.adapter),
                          step_snapshots={name: (self.snapshots[name], decay)
                                          for name, decay in self.step_snapshot_decays.items()}, roles=self.roles)
        metrics, steps = optimize_epoch(self.algorithm, self.policy, rollouts, advantages, self._optimize_settings(),
                                        stepper, epoch=epoch, steps_before=self.global_step)
        self.global_step += steps
        if not self.backend.all_finite(self.params + Roles.other_params(self.roles)):  # a step overflowed: stop
            raise NonFiniteError(f"epoch {epoch}: an optimizer step made trained weights NaN or inf (mean "
                                 f"gradient norm {metrics.get('train/grad_norm', float('nan')):.3g}); lower "
                                 "train.learning_rate. The last checkpoint is intact")
        for transformer in self.trained.values():
            transformer.eval()
        metrics.update(self.copies.after_epoch(epoch, self.global_step, self.cfg.train))
        metrics.update(self.roles.after_epoch(epoch) if self.roles else {})  # the other roles' EMAs
        return metrics

    @torch.no_grad()
    def evaluate(self, epoch: int) -> dict[str, float]:
        """ODE samples of the test prompts, each dataset's at its own eval resolution, steps and guidance; rewards,
        and a grid saved as PNG."""
        ev = self.cfg.eval
        items = eval_items(self.test_prompts, ev.num_samples)
        self.adapter.guidance_scale_2 = ev.guidance_scale_2
        train_strength = getattr(self.adapter, "strength", None)  # video-to-video's
        if ev.strength is not None:
            self.adapter.strength = ev.strength
        try:  # what ff-eval samples for the same config: its numbers agree with these
            scores, parts = sample_eval(self.adapter, items, eval_parts(self.cfg, items, self.data.eval_sizes),
                                        self._local_share, reward_set=self.eval_rewards,
                                        autocast=self.accelerator.autocast, prompt_cache=self.prompt_cache,
                                        condition_cache=self.condition_cache)
        finally:
            self.adapter.guidance_scale_2 = self.cfg.train.guidance_scale_2
            if ev.strength is not None:
                self.adapter.strength = train_strength
        # the mean over every test prompt once, whatever the shares' sizes
        means = eval_means(scores, items, self.eval_rewards, self.data.eval_source_names)
        self.eval_history.append({"epoch": epoch, **means})
        shown = grid_samples(parts, [it.dataset for it in items])  # each dataset's, from every process
        if self.accelerator.is_main_process:
            fps = getattr(self.adapter, "frame_rate", VIDEO_FPS)  # LTX-2's 24; Wan's 16
            grid, path = save_eval_grid(shown, self.run_dir / "samples" / f"eval_epoch_{epoch:04d}",
                                        self.cfg.log.video_format, fps)
            log_media(self.accelerator, self.tracker, "eval/samples", grid, epoch, path, fps)
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
        if self.tracker:
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
            # the epoch's rollouts go now: not held through a checkpoint's gathering, the next eval and sampling
            del rollouts, advantages
            self.epoch = epoch + 1
            self.history.append(record)
            acc.log({k: v for k, v in record.items() if k != "epoch"}, step=epoch)
            bar.set_postfix_str(f"reward {headline(record, self.rewards.weights):.4f}")
            if self._save_due():
                self.save()
            if self.stop.raised(acc):
                break
        if self.stop.signum is not None:
            checkpoint = self.save()
            self._end_trackers()
            raise TrainingInterrupted(self.stop.signum, checkpoint or checkpoint_dir(self.run_dir, self.epoch))
        if self.test_prompts and not any(e["epoch"] == self.epoch for e in self.eval_history):
            self.evaluate(self.epoch)  # the final weights are always evaluated
        if not self._save_due():
            self.save()  # the final weights are always saved
        elif acc.is_main_process:
            write_history(self.run_dir, self.history, self.eval_history)  # with the final eval
        self._end_trackers()
        return self.history

    def _end_trackers(self) -> None:
        """Every process done, the trackers end; the process group outlives this trainer (end_process_group)."""
        self.accelerator.wait_for_everyone()  # no process may tear the group down while another still works
        for tracker in self.accelerator.trackers:
            tracker.finish()

    def _save_due(self) -> bool:
        return bool(self.cfg.log.save_freq) and self.epoch % self.cfg.log.save_freq == 0

    def _optimize_settings(self) -> OptimizeSettings:
        settings, records = OptimizeSettings.from_config(self.cfg), self.data.offline_records
        if records is None:
            return settings
        return offline_optimize_settings(settings, self.cfg.train, len(records), self.accelerator.num_processes,
                                         self.algorithm.num_timesteps)

    def _gathered_datasets(self) -> list[str] | None:
        """The dataset of each of the epoch's samples, in the order of the gathered rewards (several datasets; an
        offline run scores nothing, so None)."""
        names = self.data.source_names
        if not names or self.data.offline_records is not None:
            return None
        if self.epoch_datasets is None:  # gathered once an epoch: the advantages and the metrics read it
            self.epoch_datasets = [names[i] for i in self.accelerator.gather(self.epoch_sources).tolist()]
        return self.epoch_datasets

    def _epoch_metrics(self, rollouts: Rollouts, advantages) -> dict[str, float]:
        acc = self.accelerator
        if isinstance(advantages, StreamedAdvantages):  # overlap: every reward is in by now
            advantages = advantages.finish(rollouts)
        gathered = {name: acc.gather(scores) for name, scores in rollouts.rewards.items()}
        metrics = reward_metrics(gathered, self.rewards, self._gathered_datasets(), self.data.source_names,
                                 self.cfg.train.group_size)
        if advantages is not None:
            metrics.update(advantage_metrics(acc.gather(advantages)))
        idle = self.backend.idle_expert_passes()
        if idle is not None:  # what running the experts in lockstep cost this epoch, all processes
            metrics["sharding/idle_expert_passes"] = idle
        metrics.update(memory_metrics(acc.device))
        metrics.update(time_metrics(self.timer))
        return metrics

    def save(self) -> Path | None:
        """Checkpoint the weights after ``self.epoch`` epochs (atomic: see checkpoint.py). A sharded model's
        full tensors are gathered first, by every process; the main process writes."""
        acc = self.accelerator
        contents = self.backend.checkpoint_contents(self.trained, self.optimizer, self.copies, self.run_dir,
                                                    self.epoch)
        # the other roles' files: gathered under FSDP2 by every process; else the main process's alone (a full copy's
        # weights on the CPU of every process would cost each the copy's size)
        if self.roles is not None and (self.roles.sharded or acc.is_main_process):
            # (their optimizers' state too, unless log.save_model_only: DeepSpeed's engine holds the generator's alone)
            contents.extra.update(self.roles.state_files(not self.cfg.log.save_model_only,
                                                         (contents.weights or {}).get("transformer")))
        if not acc.is_main_process:
            return None
        out = checkpoint_dir(self.run_dir, self.epoch)
        try:
            read_state(out)  # this epoch is already saved (an interrupt right after a save): keep it
            for folder in contents.folders.values():
                shutil.rmtree(folder, ignore_errors=True)
        except CheckpointError:
            state = {"epoch": self.epoch, "global_step": self.global_step, "model_type": self.cfg.model.model_type,
                     "history": self.history, "eval_history": self.eval_history,
                     "sharding": {"backend": self.backend.name, "processes": acc.num_processes,
                                  "trained_values_per_process": self.held_per_process,
                                  "by_component": self.held_per_component, **self.backend.record}}
            if self.held_per_role:  # each role's trained values on each process (a part of each, sharded)
                state["sharding"]["by_role"] = self.held_per_role
            if acc.scaler is not None and contents.optimizer is not None:  # fp16: the loss scale resumes too
                contents.extra[SCALER_FILE] = acc.scaler.state_dict()
            save_checkpoint(out, self.adapter, self.cfg.model.finetune_type, state, contents,
                            self.cfg.model.trained_components)
        # what ff-sample and ff-eval read to sample a checkpoint as this run's eval did
        write_atomic(self.run_dir / RUN_CONFIG, self.cfg.to_yaml())
        write_history(self.run_dir, self.history, self.eval_history)
        return out
