"""The one training loop, on accelerate: sample, score, advantage, optimise, eval, save.

Everything model-specific is behind the adapter, everything algorithm-specific is
behind ``Algorithm.loss``; this file only orders the phases of an epoch.
"""

from __future__ import annotations

import json
import logging
from contextlib import nullcontext
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from ..advantages import combine_advantages
from ..algorithms import make_algorithm
from ..data import EpochSampler, load_prompts
from ..dynamics import make_dynamics
from ..dynamics.ode import ODE
from ..dynamics.window import choose_sde_steps
from ..models import load_adapter
from ..models.lora import apply_lora
from ..models.preflight import check_before_loading
from ..rewards import RewardSet
from .checkpoint import load_checkpoint, save_checkpoint
from .curves import plot_curves
from .ema import WeightCopy, ema_decay_at, load_ema, save_ema
from .grid import caption, sample_grid
from .optimize import optimize_epoch
from .policy import AdapterPolicy
from .sampling import Rollouts, collect_rollouts
from .seeding import generator
from .timer import PhaseTimer
from .tracking import check_backend, flat_hparams, log_image

logger = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        train, model = cfg.train, cfg.model
        self.backend = check_backend(cfg.log.logging_backend)
        self.run_dir = Path(cfg.log.save_dir).expanduser() / cfg.log.run_name
        on_cpu = not torch.cuda.is_available()
        precision = "no" if on_cpu else cfg.mixed_precision  # bf16 kernels crash some CPUs; fp32 there
        self.accelerator = Accelerator(mixed_precision=precision, log_with=self.backend,
                                       project_dir=str(self.run_dir), cpu=on_cpu)
        self.seed = train.seed if train.seed is not None else cfg.seed
        set_seed(self.seed)  # LoRA's initial A matrices come from the global generator
        self.timer = PhaseTimer()

        # cheap things first, so a bad dataset or reward fails before the model loads
        self.train_prompts = load_prompts(cfg.data.dataset_dir, "train", cfg.data.max_dataset_size)
        self.test_prompts = (load_prompts(cfg.data.dataset_dir, "test", cfg.data.max_dataset_size)
                             if cfg.eval.eval_freq else [])
        self.sampler = EpochSampler(len(self.train_prompts), train.unique_sample_num_per_epoch,
                                    train.group_size, self.seed)
        self.rewards = RewardSet.from_configs(cfg.rewards)
        self.eval_rewards = RewardSet.from_configs(cfg.eval_rewards) if cfg.eval_rewards else self.rewards
        check_before_loading(cfg)

        dtype = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
        self.adapter = load_adapter(model.model_type, model.model_name_or_path, self.accelerator.device, dtype)
        self.dynamics = make_dynamics(cfg.scheduler.dynamics_type, cfg.scheduler.noise_level)
        self.algorithm = make_algorithm(train.trainer_type, train, self.dynamics)
        # the reference is the starting weights: taken before any resume
        self.policy = AdapterPolicy(self.adapter, train.guidance_scale, model.finetune_type,
                                    keep_reference=self.algorithm.needs_reference,
                                    ref_param_device=train.ref_param_device)
        self.params = self._make_trainable()
        # EMA of the trained weights (train.ema_decay > 0), and for NFT / AWM the weights the
        # rollout sampled with: the EMA itself when off_policy, else a copy taken at sampling time
        ema_device = None if train.ema_device == "same" else train.ema_device
        self.ema = WeightCopy(self.params, ema_device) if train.ema_decay > 0 else None
        self.rollout_weights = (WeightCopy(self.params, ema_device)
                                if self.algorithm.uses_sampling_policy and not train.off_policy else None)
        self.policy.ema = self.ema
        self.policy.sampling_weights = self.ema if train.off_policy else self.rollout_weights
        self.optimizer = torch.optim.AdamW(
            self.params, lr=train.learning_rate, betas=(train.adam_beta1, train.adam_beta2),
            weight_decay=train.adam_weight_decay, eps=train.adam_epsilon)
        self.optimizer = self.accelerator.prepare(self.optimizer)
        self.adapter.wrap_transformer(self.accelerator.prepare)

        self.epoch, self.global_step = 0, 0
        self.history: list[dict] = []  # one record of training metrics per epoch
        self.eval_history: list[dict] = []  # eval rewards, keyed by epochs completed
        if model.resume_path:
            state = load_checkpoint(model.resume_path, self.adapter, model.finetune_type, self.optimizer)
            self.epoch, self.global_step = state["epoch"], state["global_step"]
            self.history, self.eval_history = state.get("history", []), state.get("eval_history", [])
            if self.ema is not None and not load_ema(self.ema, model.resume_path):
                logger.warning("model.resume_path %s holds no EMA state (ema.pt); the EMA restarts from the "
                               "resumed weights", model.resume_path)

    def _make_trainable(self) -> list[torch.nn.Parameter]:
        model, transformer = self.cfg.model, self.adapter.transformer
        if model.finetune_type == "lora":
            apply_lora(transformer, model.lora_rank, model.lora_alpha, model.target_modules,
                       self.adapter.default_lora_targets)
        else:
            transformer.requires_grad_(True)
        params = [p for p in transformer.parameters() if p.requires_grad]
        for p in params:  # trainable weights stay fp32 under mixed precision
            p.data = p.data.float()
        if self.cfg.train.enable_gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        return params

    # ------------------------------------------------------------------ phases
    def _local_share(self, n: int) -> slice:
        per_rank = n // self.accelerator.num_processes
        start = self.accelerator.process_index * per_rank
        return slice(start, start + per_rank)

    def sample_epoch(self, epoch: int) -> Rollouts:
        cfg, train = self.cfg, self.cfg.train
        indices, group_ids = self.sampler.draw(epoch)
        share = self._local_share(len(indices))
        sample_ids = list(range(len(indices)))[share]
        height, width = train.height_width
        sde_steps = None
        if self.dynamics.stochastic:
            sde_steps = choose_sde_steps(train.num_inference_steps, cfg.scheduler.sde_steps,
                                         cfg.scheduler.num_sde_steps, generator("window", cfg.scheduler.seed, epoch))
        if self.rollout_weights is not None:
            self.rollout_weights.copy_from_params()  # NFT / AWM's old policy: the weights sampled with
        # off_policy: the rollout samples with the EMA weights while the current policy trains
        sampling_weights = self.ema.applied() if train.off_policy else nullcontext()
        with sampling_weights:
            rollouts = collect_rollouts(
                self.adapter, self.dynamics, self.accelerator,
                [self.train_prompts[i] for i in indices[share]], group_ids[share], sample_ids,
                seed=self.seed, epoch=epoch, batch_size=train.per_device_batch_size, height=height, width=width,
                num_frames=train.num_frames, num_steps=train.num_inference_steps,
                guidance_scale=train.guidance_scale, sde_steps=sde_steps, same_latent=train.same_latent,
                timer=self.timer, record_means=self.algorithm.records_step_means, reward_set=self.rewards)
        return rollouts

    def compute_advantages(self, rollouts: Rollouts) -> torch.Tensor:
        """Over the global batch (all ranks), then this rank's share."""
        gather = self.accelerator.gather
        rewards = {k: gather(v) for k, v in rollouts.rewards.items()}
        group_ids = gather(rollouts.group_ids.to(self.accelerator.device))
        adv = combine_advantages(rewards, self.rewards.weights, group_ids,
                                 self.cfg.train.advantage_aggregation, self.cfg.train.global_std)
        return adv[self._local_share(len(adv))]

    def optimize(self, rollouts: Rollouts, advantages: torch.Tensor, epoch: int) -> dict[str, float]:
        train = self.cfg.train
        self.adapter.transformer.train()
        metrics, steps = optimize_epoch(
            self.algorithm, self.policy, rollouts, advantages, accelerator=self.accelerator,
            optimizer=self.optimizer, params=self.params, denoiser=self.adapter.denoiser,
            batch_size=train.per_device_batch_size, num_inner_epochs=train.num_inner_epochs,
            accumulation=self.cfg.gradient_accumulation, max_grad_norm=train.max_grad_norm,
            seed=self.seed, epoch=epoch)
        self.global_step += steps
        self.adapter.transformer.eval()
        if self.ema is not None and (epoch + 1) % train.ema_update_interval == 0:
            decay = ema_decay_at(train.ema_decay_schedule, epoch, train.ema_decay, train.max_epochs,
                                 train.flat_steps, train.ramp_rate)
            self.ema.update(decay)
            metrics["train/ema_decay"] = decay
        return metrics

    @torch.no_grad()
    def evaluate(self, epoch: int) -> dict[str, float]:
        """ODE samples of the test prompts at the eval resolution; rewards, and a grid saved as PNG."""
        cfg, ev = self.cfg, self.cfg.eval
        items = self.test_prompts[: ev.num_samples] if ev.num_samples else self.test_prompts
        share = self._local_share(len(items))
        height, width = ev.height_width
        ids = list(range(len(items)))[share]
        timer = PhaseTimer()
        rollouts = collect_rollouts(
            self.adapter, ODE(), self.accelerator, items[share], torch.tensor(ids), ids,
            seed=ev.seed, epoch=-1, batch_size=ev.per_device_batch_size, height=height, width=width,
            num_frames=ev.num_frames, num_steps=ev.num_inference_steps, guidance_scale=ev.guidance_scale,
            sde_steps=[], same_latent=False, timer=timer, keep_trajectory=False, reward_set=self.eval_rewards)
        scores = rollouts.rewards
        means = {f"eval/reward/{k}": self.accelerator.gather(v).mean().item() for k, v in scores.items()}
        self.eval_history.append({"epoch": epoch, **means})
        if self.accelerator.is_main_process:
            shown = min(16, len(rollouts.prompts))
            captions = [caption(rollouts.prompts[i], {k: v[i].item() for k, v in scores.items()})
                        for i in range(shown)]
            grid = sample_grid(rollouts.media[:shown], captions)
            path = self.run_dir / "samples" / f"eval_epoch_{epoch:04d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            grid.save(path)
            log_image(self.accelerator, self.backend, "eval/samples", grid, epoch)
            self.accelerator.log(means, step=epoch)
        return means

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        cfg, acc = self.cfg, self.accelerator
        if self.backend:
            acc.init_trackers(cfg.log.project, config=flat_hparams(cfg.model_dump(mode="json")))
        bar = tqdm(range(self.epoch, cfg.train.max_epochs), initial=self.epoch, total=cfg.train.max_epochs,
                   desc="epochs", disable=not acc.is_main_process)
        for epoch in bar:
            record = {"epoch": epoch}
            if cfg.eval.eval_freq and epoch % cfg.eval.eval_freq == 0:
                bar.set_postfix_str("eval")
                self.evaluate(epoch)
            self.timer.reset()
            with self.timer.phase("epoch"):
                bar.set_postfix_str("sampling")
                rollouts = self.sample_epoch(epoch)
                advantages = self.compute_advantages(rollouts)
                bar.set_postfix_str("training")
                with self.timer.phase("training"):
                    record.update(self.optimize(rollouts, advantages, epoch))
            record.update(self._epoch_metrics(rollouts, advantages))
            self.epoch = epoch + 1
            self.history.append(record)
            acc.log({k: v for k, v in record.items() if k != "epoch"}, step=epoch)
            bar.set_postfix_str(f"reward {self._headline(record):.4f}")
            if self._save_due():
                self.save()
        if cfg.eval.eval_freq and not any(e["epoch"] == self.epoch for e in self.eval_history):
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

    def _epoch_metrics(self, rollouts: Rollouts, advantages: torch.Tensor) -> dict[str, float]:
        metrics = {}
        for name, scores in rollouts.rewards.items():
            scores = self.accelerator.gather(scores)
            metrics[f"reward/{name}/mean"] = scores.mean().item()
            metrics[f"reward/{name}/std"] = scores.std(unbiased=False).item()
        adv = self.accelerator.gather(advantages)
        metrics.update({"advantage/mean": adv.mean().item(), "advantage/std": adv.std(unbiased=False).item(),
                        "advantage/abs_max": adv.abs().max().item()})
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
        if not self.accelerator.is_main_process:
            return None
        out = self.run_dir / "checkpoints" / f"epoch_{self.epoch}"
        state = {"epoch": self.epoch, "global_step": self.global_step,
                 "history": self.history, "eval_history": self.eval_history}
        save_checkpoint(out, self.adapter, self.cfg.model.finetune_type, self.optimizer, state)
        if self.ema is not None:
            save_ema(self.ema, out)
        self._plot_rewards()
        return out

    def _plot_rewards(self) -> None:
        series: dict[str, list] = {}
        for record in self.history + self.eval_history:
            for k, v in record.items():
                if k.startswith(("reward/", "eval/reward/")) and not k.endswith("/std"):
                    series.setdefault(k, []).append((record["epoch"], v))
        plot_curves(series, "reward per epoch").save(self.run_dir / "reward_curve.png")
        (self.run_dir / "history.json").write_text(
            json.dumps({"train": self.history, "eval": self.eval_history}, indent=1))
