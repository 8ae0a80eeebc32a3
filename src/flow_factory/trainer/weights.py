"""The trained weights' copies, and where a run's weights start from.

``WeightCopies`` are the copies of those weights a run keeps beside them (the EMA, the weights a
rollout sampled with, the algorithm's snapshots, a sharded full fine-tune's reference);
``RunStart`` is where the weights come from (a checkpoint resumed, or ``model.resume_type``'s
start weights) and loads them. ``ModelSetup`` holds these steps for a training backend
(``backends.py``), which orders them as its sharding requires.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import CheckpointError, check_fits, find_checkpoint, load_checkpoint
from .ema import EMA_FILE, WeightCopy, ema_decay_at, load_ema
from .optimizers import make_optimizer
from .policy import AdapterPolicy, PolicyWeights, frozen_reference

logger = logging.getLogger(__name__)
SCALER_FILE = "grad_scaler.pt"  # fp16's gradient scaler (its loss scale and growth tracker)


@dataclass
class WeightCopies:
    """Copies of the trained weights kept beside them, each swapped in place when used."""

    ema: WeightCopy | None  # train.ema_decay > 0
    rollout_weights: WeightCopy | None  # NFT / AWM on-policy: the weights the epoch's rollout sampled with
    # the algorithm's named copies: moved after each epoch (CRD's old and sampling models) or after each optimizer
    # step (DGPO's fast old-policy EMA, on ema_ref_device); name -> decay(step)
    snapshot_decays: dict[str, Callable] = field(default_factory=dict)
    step_snapshot_decays: dict[str, Callable] = field(default_factory=dict)
    snapshots: dict[str, WeightCopy] = field(default_factory=dict)
    # a full fine-tune's starting weights, for its KL: a WeightCopy of a sharded model's shards, else frozen copies
    # of the trained networks (policy.frozen_reference); None with LoRA, whose reference is the base model
    reference: WeightCopy | dict | None = None

    @classmethod
    def make(cls, params: list, train, algorithm, finetune_type: str, before_swap: Callable | None = None,
             sharded: bool = False) -> "WeightCopies":
        """``before_swap``: frees a sharded model's gathered weights, so that the next forward gathers the swapped
        ones; ``sharded``: the copies are of shards or partitions (no process holds a full copy)."""
        device = lambda key: None if key == "same" else key  # noqa: E731
        copy = lambda where: WeightCopy(params, device(where), before_swap=before_swap)  # noqa: E731
        on_policy_old = algorithm.uses_sampling_policy and not train.off_policy
        snapshots = {name: copy(train.ema_device) for name in algorithm.weight_snapshots}
        snapshots.update({name: copy(train.ema_ref_device) for name in algorithm.step_snapshots})
        # the reference is the starting weights, taken before any resume; LoRA's is the base model (no copy)
        reference = (copy(train.ref_param_device)
                     if algorithm.needs_reference and finetune_type == "full" and sharded else None)
        return cls(ema=copy(train.ema_device) if train.ema_decay > 0 else None,
                   rollout_weights=copy(train.ema_device) if on_policy_old else None,
                   snapshot_decays=algorithm.weight_snapshots, step_snapshot_decays=algorithm.step_snapshots,
                   snapshots=snapshots, reference=reference)

    def state_files(self) -> dict:
        """File name -> state, for a checkpoint: the EMA and the algorithm's snapshots."""
        files = {EMA_FILE: self.ema.state_dict()} if self.ema is not None else {}
        files.update({f"{name}.pt": snapshot.state_dict() for name, snapshot in self.snapshots.items()})
        return files

    def after_epoch(self, epoch: int, global_step: int, train) -> dict[str, float]:
        """The EMA's move (every ``ema_update_interval`` epochs, at ``ema_decay_at``'s decay) and the epoch
        snapshots'; their decays, as metrics."""
        metrics = {}
        if self.ema is not None and (epoch + 1) % train.ema_update_interval == 0:
            decay = ema_decay_at(train.ema_decay_schedule, epoch, train.ema_decay, train.max_epochs,
                                 train.flat_steps, train.ramp_rate)
            self.ema.update(decay)
            metrics["train/ema_decay"] = decay
        for name, decay_of in self.snapshot_decays.items():
            decay = decay_of(global_step)
            self.snapshots[name].update(decay)
            metrics[f"train/{name}_decay"] = decay
        return metrics

    def for_rollout(self, algorithm, global_step: int, off_policy: bool):
        """The weights an epoch's rollout samples with, swapped in while it runs: the EMA when ``off_policy``, the
        algorithm's sampling snapshot (CRD's sampling model; DGPO's fast EMA after switch_ema_ref steps), else the
        trained ones; NFT / AWM's old policy copies them first."""
        if self.rollout_weights is not None:
            self.rollout_weights.copy_from_params()
        snapshot = algorithm.sampling_snapshot(global_step)
        if snapshot is not None:
            return self.snapshots[snapshot].applied()
        return self.ema.applied() if off_policy else nullcontext()

    def policy(self, adapter, cfg, algorithm) -> AdapterPolicy:
        """What the algorithms call: the trained weights, their reference, and these copies."""
        train, model = cfg.train, cfg.model
        return AdapterPolicy(adapter, train.loss_guidance_scale, model.finetune_type,
                             keep_reference=algorithm.needs_reference, ref_param_device=train.ref_param_device,
                             weights=PolicyWeights(self.ema, self.ema if train.off_policy else self.rollout_weights,
                                                   self.snapshots, self.reference),
                             components=model.trained_components,
                             one_scale_for_experts=train.train_guidance_scale is not None)


class RunStart:
    """Where the run's weights come from: a checkpoint resumed (``resume_from``, its trainer state ``resumed``),
    ``model.resume_type``'s start weights (a new run from them), or the pipeline's. Found and checked against the
    config before the model loads."""

    def __init__(self, cfg, run_dir: Path):
        self.cfg = cfg
        model = cfg.model
        self.resume_from, self.start_weights, self.resumed = None, None, {"epoch": 0}
        if not model.resume_path:
            return
        self.resume_from, self.resumed = find_checkpoint(model.resume_path, run_dir)
        check_fits(self.resume_from, self.resumed, model.finetune_type, model.trained_components)
        if model.resume_type in ("lora", "full"):  # Flow-Factory's: a new run from these weights
            self.start_weights, self.resume_from, self.resumed = self.resume_from, None, {"epoch": 0}
        elif self.resumed["epoch"] >= cfg.train.max_epochs:
            raise CheckpointError(f"model.resume_path: {self.resume_from} has {self.resumed['epoch']} epochs done "
                                  f"and train.max_epochs is {cfg.train.max_epochs}: nothing to train; set "
                                  f"train.max_epochs above {self.resumed['epoch']}")

    def load_weights(self, adapter, optimizer=None, scaler=None, say=print) -> None:
        """The start or resumed weights into ``adapter``'s trained networks; a resume's ``optimizer`` state and
        fp16 ``scaler`` too (None: DeepSpeed's engine reads its own, ``backends.py``)."""
        model = self.cfg.model
        if self.start_weights is not None:
            load_checkpoint(self.start_weights, adapter, model.finetune_type, components=model.trained_components)
            say(f"starting from the weights of {self.start_weights} (model.resume_type: {model.resume_type})")
        if self.resume_from is None:
            return
        if not load_checkpoint(self.resume_from, adapter, model.finetune_type, optimizer, model.trained_components) \
                and optimizer is not None:
            logger.warning("model.resume_path %s holds no optimizer state (saved with log.save_model_only); "
                           "the optimizer restarts", self.resume_from)
        scaler_state = Path(self.resume_from) / SCALER_FILE
        if scaler is not None and scaler_state.exists():
            scaler.load_state_dict(torch.load(scaler_state, map_location="cpu", weights_only=True))
        say(f"resumed from {self.resume_from}, epoch {self.resumed['epoch']} of {self.cfg.train.max_epochs} done")

    def load_copies(self, copies: WeightCopies) -> None:
        """The checkpoint's EMA and snapshots; a run from start weights starts its snapshots (CRD's, DGPO's) from
        them."""
        if self.resume_from is None:
            for snapshot in copies.snapshots.values() if self.start_weights is not None else ():
                snapshot.copy_from_params()
            return
        if copies.ema is not None and not load_ema(copies.ema, self.resume_from):
            logger.warning("model.resume_path %s holds no EMA state (ema.pt); the EMA restarts from the "
                           "resumed weights", self.resume_from)
        for name, snapshot in copies.snapshots.items():
            if not load_ema(snapshot, self.resume_from, f"{name}.pt"):
                snapshot.copy_from_params()
                logger.warning("model.resume_path %s holds no %s weights (%s.pt); they restart from the "
                               "resumed weights", self.resume_from, name, name)


@dataclass
class ModelSetup:
    """The steps a backend orders to build the trained model (``backends.py``)."""

    cfg: object
    adapter: object
    algorithm: object
    trained: dict[str, nn.Module]
    start: RunStart
    say: Callable[[str], None]
    roles: object = None  # trainer.roles.Roles of a distillation run: the generator's optimizer is its entry's

    def make_optimizer(self, params: list) -> torch.optim.Optimizer:
        if self.roles is not None:
            return self.roles.generator_optimizer(params)
        return make_optimizer(params, self.cfg.train)

    def compile(self) -> None:
        """``model.torch_compile``: after LoRA (the compiled graph holds its layers), before any wrapper."""
        model = self.cfg.model
        if model.torch_compile != "none":
            chosen = self.adapter.compile_transformers(model.torch_compile, mode=model.compile_mode)
            self.say("torch.compile: " + ", ".join(f"{k} {v}" for k, v in chosen.items()))

    def weight_copies(self, params: list, before_swap: Callable | None = None,
                      sharded: bool = False) -> WeightCopies:
        copies = WeightCopies.make(params, self.cfg.train, self.algorithm, self.cfg.model.finetune_type,
                                   before_swap, sharded)
        if not sharded and self.algorithm.needs_reference and self.cfg.model.finetune_type == "full":
            # each backend calls this before any checkpoint loads: the reference is the pipeline's weights
            copies.reference = frozen_reference(self.adapter, self.cfg.model.trained_components,
                                                self.cfg.train.ref_param_device)
        return copies
