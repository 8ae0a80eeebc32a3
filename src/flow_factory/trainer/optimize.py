"""The optimisation phase of an epoch: one loop for every algorithm.

The algorithm says which samples train together (``training_units``) and what
micro-batches a chunk of them makes (``micro_batches``: one per trained SDE step for
GRPO, one per drawn training timestep for NFT / AWM / DPO); this loop shuffles,
accumulates gradients, clips, steps, and aggregates the metrics. A step whose gradient
norm is NaN or inf is skipped and counted by the ``NonFiniteGuard`` (``flow_factory/guards.py``). Under
fp16, a step whose every loss was finite but whose scaled gradients overflowed is the gradient
scaler's to skip (it lowers its scale and the weights stay as they were): counted as
``overflow_skipped_steps``, not held against the run.

Up to ``steps_per_call`` consecutive micro-batches of a chunk are merged into one
(``merge_batches``: one transformer call for several steps). A merged batch stands for its
``parts`` micro-steps: its loss, the mean of theirs, is backpropagated times ``parts``, so
the gradient is the sum the separate calls would give; merging never crosses an optimizer
step, so every step sees the same gradient either way.

Gradients sync across processes through the DDP wrapper ``Stepper.syncing_module``; a multi-expert model
is not wrapped (``backends.DataParallel``), so with ``syncing_module=None`` this loop
averages them itself before the optimizer step. FSDP2 reduce-scatters every backward into the
sharded gradients. DeepSpeed's engine accumulates, clips and steps
inside ``backward`` at the end of an accumulation; the optimizer's own step is then a no-op. The engine
skips a step whose reduced gradients hold NaN or inf itself (its overflow check, a flag reduced over the
processes; ``fill_deepspeed_config`` keeps it on under bf16), and this loop counts that skip as it counts
the other backends' (``engine.was_step_applied()``).
A lockstep algorithm (DGPO) shuffles and draws alike on every process, so the processes train
the parts of one global micro-batch together.

An algorithm with roles (``Algorithm.phases``: DMD2's fake score, then its generator) trains them in this same
loop: the chunks of one optimizer step are run once per pass of each phase in turn, with that role active
(``trainer/roles.Roles.active``: its adapter runs and alone has gradients), each role with its own optimizer,
accumulation count and ``max_grad_norm`` (one ``_EpochSteps`` per role); the generator's steps are the run's.

``Stepper.step_snapshots`` (name -> (``WeightCopy``, ``decay(k)``)) move after every optimizer step k of
the run (``steps_before`` + the steps of this epoch so far), as ``w <- d w + (1 - d) theta``.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from accelerate.utils import DistributedType

from ..algorithms.base import merge_batches
from ..config.distillation import GENERATOR
from ..guards import NonFiniteGuard
from ..sampling import on_device
from ..seeding import generator


@dataclass(frozen=True)
class OptimizeSettings:
    """How an epoch's rollouts are trained on (``from_config``: the run's ``train`` section)."""

    batch_size: int  # training units (samples; DPO: pairs) a micro-batch draws
    accumulation: int = 1  # micro-steps per optimizer step
    max_grad_norm: float = 1.0
    num_inner_epochs: int = 1  # passes over the rollouts
    shuffle: bool = True  # the units' order, reshuffled each pass
    steps_per_call: int | str = 1  # micro-batches merged into one transformer call
    seed: int = 0  # with the epoch, seeds the shuffles and the training draws: a resumed run repeats them

    @classmethod
    def from_config(cls, cfg) -> "OptimizeSettings":
        train = cfg.train
        return cls(batch_size=train.per_device_batch_size, accumulation=cfg.gradient_accumulation,
                   max_grad_norm=train.max_grad_norm, num_inner_epochs=train.num_inner_epochs,
                   shuffle=train.shuffle_samples, steps_per_call=train.steps_per_call,
                   seed=train.seed if train.seed is not None else cfg.seed)


@dataclass
class Stepper:
    """What steps the trained weights: the accelerator, the optimizer over ``params``, the non-finite ``guard``,
    and ``syncing_module``: the module whose backend syncs the gradients (DDP's wrapper, whose all-reduce this loop
    defers to the micro-step that steps; an FSDP2 root; DeepSpeed's engine), or None, when this loop averages them
    over the processes itself (a multi-expert model DDP cannot wrap: ``backends.Backend.syncing_module``).
    ``step_snapshots``: name -> (``WeightCopy``, ``decay(k)``), moved after every optimizer step k of the run."""

    accelerator: Any
    optimizer: Any
    params: list
    guard: NonFiniteGuard
    syncing_module: Any = None
    step_snapshots: dict = field(default_factory=dict)
    roles: Any = None  # trainer.roles.Roles (distillation): each phase's role trains with its own optimizer
    # a role trained beside DeepSpeed's engine (which holds the generator's optimizer alone): its backward, clipping
    # and step are this loop's, as without a backend that steps
    beside_engine: bool = False


def optimize_epoch(algorithm, policy, rollouts, advantages, settings: OptimizeSettings,
                   stepper: Stepper, *, epoch: int, steps_before: int = 0) -> tuple[dict[str, float], int]:
    """Returns the epoch's mean (``_min`` / ``_max``: extreme) metrics and the optimizer steps taken
    (``steps_before``: those of the run before this epoch).

    ``advantages``: (N,), or a ``trainer.overlap.StreamedAdvantages`` whose rewards are still being scored (each
    chunk then waits for its groups'; a NaN or inf among them stops the update there).
    Metrics that are NaN or inf are left out of the means; ``skipped_updates`` counts the
    optimizer steps skipped for a non-finite gradient."""
    acc = stepper.accelerator
    runs = _role_runs(stepper, settings, epoch, steps_before)
    # train.reward_optimization_overlap: a StreamedAdvantages, whose values are final group by group (overlap.py)
    streamed = None if isinstance(advantages, torch.Tensor) else advantages
    advantages = advantages if streamed is None else streamed.values
    units = algorithm.training_units(rollouts.group_ids, advantages)
    batch_size = algorithm.units_per_chunk(settings.batch_size)
    rank = 0 if algorithm.lockstep else acc.process_index  # which process's draws this one makes
    phases = getattr(algorithm, "phases", ((None, 1),))  # (role, passes) each; one phase without roles
    for inner in range(settings.num_inner_epochs):
        order = (torch.randperm(len(units), generator=generator("shuffle", settings.seed, epoch, inner, rank))
                 if settings.shuffle else torch.arange(len(units)))
        chunks = [units[order[start:start + batch_size]] for start in range(0, len(units), batch_size)]
        # several phases take turns over the chunks of one optimizer step (as many as its micro-steps hold)
        span = max(1, settings.accumulation // algorithm.micro_steps_per_chunk(rollouts)) if len(phases) > 1 else 0
        for p, role, turn in _phase_turns(phases, len(chunks), span):
            run = runs[role]
            with stepper.roles.active(role) if role is not None else nullcontext():
                for again, b in turn:
                    if streamed is not None and not streamed.ready(chunks[b]):  # waits for their rewards
                        run.abandon(f"epoch {epoch}: {streamed.problem}; the rest of the epoch's update is skipped")
                        return _results(runs)
                    # training noise / timesteps: seeded per micro-batch, so a resumed run draws the same ones;
                    # with roles per phase and pass, and by sample (not rank and micro-batch: the algorithm keys
                    # its draws by each sample's id), so several processes draw as one
                    draws = (generator("train", settings.seed, epoch, inner, rank, b) if role is None
                             else generator("train", settings.seed, epoch, inner, "roles", p, again))
                    run.train_chunk(algorithm, policy, algorithm.micro_batches(
                        rollouts, advantages, chunks[b], draws, **({} if role is None else {"role": role})))
    return _results(runs)


def _phase_turns(phases, num_chunks: int, span: int):
    """(phase index, role, [(pass, chunk index), ...]) in the order they train: several phases take turns over the
    ``span`` chunks of each optimizer step, each its passes over them; a single phase (``span`` 0) takes every chunk
    in one turn."""
    span = span or max(1, num_chunks)
    for first in range(0, num_chunks, span):
        for p, (role, passes) in enumerate(phases):
            yield p, role, [(again, b) for again in range(passes) for b in range(first, min(first + span, num_chunks))]


def _role_runs(stepper: Stepper, settings: OptimizeSettings, epoch: int, steps_before: int) -> dict:
    """Each phase's role -> its ``_EpochSteps``: None -> the one of an algorithm without roles; with roles, the
    generator's steps the stepper's optimizer (and its step snapshots), each other role its own optimizer, and
    each role clips at its own ``max_grad_norm``."""
    roles = stepper.roles
    if roles is None:
        return {None: _EpochSteps(stepper, settings, epoch, steps_before)}
    runs = {}
    for role in roles.names:
        own = settings if role not in roles.settings else replace(settings,
                                                                  max_grad_norm=roles.settings[role].max_grad_norm)
        # the other roles run outside DDP's wrapper (``Roles.active``): this loop averages their gradients; under
        # FSDP2 they are shards of the one sharded module, whose backward reduce-scatters every role's gradients
        syncing = stepper.syncing_module if roles.sharded else None
        mine = stepper if role == GENERATOR else replace(stepper, optimizer=roles.optimizers[role],
                                                          params=roles.params[role], syncing_module=syncing,
                                                          step_snapshots=roles.step_snapshots(role),
                                                          beside_engine=roles.beside_engine)
        runs[role] = _EpochSteps(mine, own, epoch, steps_before)
    return runs


def _results(runs: dict) -> tuple[dict[str, float], int]:
    """The generator's (or the one run's) metrics and optimizer steps, beside each other role's metrics under
    ``train/<role>/``."""
    main = GENERATOR if GENERATOR in runs else None
    metrics, steps = runs[main].results()
    for role, run in runs.items():
        if role != main:
            metrics.update({k.replace("train/", f"train/{role}/", 1): v for k, v in run.results()[0].items()})
    return metrics, steps


class _EpochSteps:
    """The micro-steps of one ``optimize_epoch``: each one's backward, the optimizer step at the end of an
    accumulation (or its skip), and the metrics' running sums."""

    def __init__(self, stepper: Stepper, settings: OptimizeSettings, epoch: int, steps_before: int):
        self.stepper, self.settings, self.epoch, self.steps_before = stepper, settings, epoch, steps_before
        acc = stepper.accelerator
        self.deepspeed = acc.distributed_type == DistributedType.DEEPSPEED and not stepper.beside_engine
        self.engine = acc.deepspeed_engine_wrapped.engine if self.deepspeed else None
        # fp16: a loss scaler skips overflows
        self.scaled = acc.scaler is not None or (self.deepspeed and self.engine.fp16_enabled())
        # DDP skips the all-reduce of micro-steps that do not step. FSDP2 reduce-scatters every backward
        # instead (deferring would keep whole gradients on every process); DeepSpeed knows its boundary itself
        self.defer_sync = isinstance(stepper.syncing_module, torch.nn.parallel.DistributedDataParallel)
        self.micro = self.steps = self.skipped = self.overflowed = 0
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        # fp16: whether a loss of the accumulation so far was NaN or inf (tells the data's inf from an overflow);
        # a tensor, read only when a step overflowed, so that no micro-step waits on the device for it
        self.bad_loss = torch.zeros((), dtype=torch.bool, device=acc.device)

    def abandon(self, why: str) -> None:
        """Stop the epoch's update here (a NaN or inf reward scored while it trained): the gradient accumulated
        since the last optimizer step is dropped, and the guard counts the skip."""
        self.stepper.optimizer.zero_grad(set_to_none=True)
        self.skipped += 1
        self.stepper.guard.skip(why)

    def room(self) -> int:
        """The micro-steps left before the next optimizer step."""
        accumulation = self.settings.accumulation
        return accumulation - self.micro % accumulation

    def train_chunk(self, algorithm, policy, batches) -> None:
        """The micro-batches of one chunk, merged ``steps_per_call`` at a time (never across an optimizer step)."""
        device = self.stepper.accelerator.device
        for batch in _merged(batches, self.settings.steps_per_call, self.room):
            self.train_on(algorithm, policy, on_device(batch, device))

    def train_on(self, algorithm, policy, batch) -> None:
        """One micro-step (a merged batch: ``batch.parts`` of them); the optimizer step if it ends an accumulation."""
        acc, parts = self.stepper.accelerator, batch.parts
        # gradients sync across processes only on the micro-step that steps the optimizer
        syncs = (self.micro + parts) % self.settings.accumulation == 0
        no_sync = not syncs and self.defer_sync
        with acc.no_sync(self.stepper.syncing_module) if no_sync else nullcontext(), acc.autocast():
            loss, metrics = algorithm.loss(policy, batch)
            self._backward(loss, parts, syncs)
        self.micro += parts
        metrics["loss"] = loss.detach()
        if self.scaled:
            self.bad_loss |= ~torch.isfinite(loss.detach()).to(self.bad_loss.device)
        if syncs:
            self._step(metrics, loss)
        self._record(metrics, parts)

    def _backward(self, loss: torch.Tensor, parts: int, syncs: bool) -> None:
        acc = self.stepper.accelerator
        # no gradient when only a frozen expert denoised the batch (Wan2.2 training one expert)
        if self.deepspeed:
            # DeepSpeed's engine divides by its gradient_accumulation_steps (= accumulation) and steps, clipping,
            # in the backward of the micro-step told it ends the accumulation; so a micro-step without a gradient
            # (on every process: the experts run in lockstep) backs a zero through the trained weights, and the
            # engine still counts and steps
            tied = loss if loss.requires_grad else loss + 0 * sum(p.sum() for p in self.stepper.params)
            _tell_deepspeed_the_boundary(acc, syncs)
            acc.backward(tied * parts)
        elif loss.requires_grad:
            scaled = loss * parts / self.settings.accumulation
            scaled.backward() if self.stepper.beside_engine else acc.backward(scaled)  # not through the engine

    def _step(self, metrics: dict, loss: torch.Tensor) -> None:
        """The optimizer step of an accumulation, or its skip: a non-finite gradient norm is the guard's (fp16's
        overflow of finite losses is the scaler's, not held against the run)."""
        s = self.stepper
        acc, optimizer = s.accelerator, s.optimizer
        if s.syncing_module is None and acc.num_processes > 1:
            average_gradients(s.params)
        clip = torch.nn.utils.clip_grad_norm_ if s.beside_engine else acc.clip_grad_norm_  # the engine's: its norm
        metrics["grad_norm"] = grad_norm = _norm(clip(s.params, self.settings.max_grad_norm))
        # DeepSpeed's engine has stepped already, unless its overflow check found the reduced
        # gradients (or their norm) NaN or inf: then it skipped the step, alike on every process
        stepped = self.engine.was_step_applied() if self.deepspeed else bool(torch.isfinite(grad_norm))
        if stepped:
            optimizer.step()  # a no-op under DeepSpeed
            for name, (snapshot, decay_of) in s.step_snapshots.items():
                metrics[f"{name}_decay"] = decay = decay_of(self.steps_before + self.steps)
                snapshot.update(decay)
            self.steps += 1
            s.guard.passed()
        elif self.scaled and _everywhere(acc, not bool(self.bad_loss)):
            # fp16: finite losses whose scaled gradients overflowed. The scaler skips the step (the weights are
            # untouched) and lowers its scale: not a lost update. (DeepSpeed's own scaler has skipped it already,
            # and lowers its scale for the data's NaN too)
            optimizer.step()
            self.overflowed += 1
        else:
            self.skipped += 1
            if acc.scaler is not None:  # the data's NaN or inf: skipped, the loss scale kept
                scale = acc.scaler.get_scale()
                optimizer.step()  # the scaler skips it, and must close its step to unscale again
                acc.scaler.update(scale)
            optimizer.zero_grad(set_to_none=True)  # before a raise, too
            s.guard.skip(f"epoch {self.epoch}: optimizer step with a non-finite gradient norm "
                         f"(loss {float(loss.detach()):.4g})")
        optimizer.zero_grad(set_to_none=True)
        self.bad_loss.zero_()

    def _record(self, metrics: dict, parts: int) -> None:
        for k, v in metrics.items():
            v = float(v)
            if not math.isfinite(v):
                continue
            if k.endswith("_min"):
                self.sums[k] = min(self.sums.get(k, v), v)
            elif k.endswith("_max"):
                self.sums[k] = max(self.sums.get(k, v), v)
            else:  # a merged batch's metric is the mean over its parts: it counts that many times
                weight = 1 if k == "grad_norm" else parts
                self.sums[k] = self.sums.get(k, 0.0) + v * weight
                self.counts[k] = self.counts.get(k, 0) + weight

    def results(self) -> tuple[dict[str, float], int]:
        acc = self.stepper.accelerator
        if self.deepspeed:
            _tell_deepspeed_the_boundary(acc, True)
        out = {f"train/{k}": (v / self.counts[k] if k in self.counts else v) for k, v in self.sums.items()}
        out["train/skipped_updates"] = self.skipped
        if self.scaled:
            out["train/overflow_skipped_steps"] = self.overflowed
        if acc.scaler is not None:
            out["train/loss_scale"] = float(acc.scaler.get_scale())
        return out, self.steps


def _tell_deepspeed_the_boundary(acc, steps: bool) -> None:
    """Whether DeepSpeed's engine ends its accumulation (reduces, clips, steps) in the next backward. accelerate
    has no public setter for it: it counts micro-steps itself, which a merged batch of several parts or a
    micro-step without a gradient would put out of step with this loop's count."""
    acc.gradient_state._set_sync_gradients(steps)


def _everywhere(acc, flag: bool) -> bool:
    """``flag`` on every process (all of them reach this together: the gradient norm is a global one)."""
    if acc.num_processes == 1:
        return flag
    return bool(acc.reduce(torch.tensor([float(not flag)], device=acc.device), "sum").item() == 0)


def _norm(grad_norm) -> torch.Tensor:
    """The gradient norm as a plain tensor: a DTensor's full value (FSDP), NaN when DeepSpeed reports none."""
    if grad_norm is None:
        return torch.tensor(float("nan"))
    return grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm


def _merged(batches, steps_per_call: int | str, room):
    """``batches`` merged ``steps_per_call`` at a time (``all``: as many as come), never more than
    ``room()``: the micro-steps left before the next optimizer step."""
    limit = math.inf if steps_per_call == "all" else steps_per_call
    pending = []
    for batch in batches:
        pending.append(batch)
        if len(pending) >= min(limit, room()):
            yield merge_batches(pending)
            pending = []
    if pending:
        yield merge_batches(pending)


def average_gradients(params: list) -> None:
    """What DDP does, for a model it cannot wrap: each gradient averaged over the processes. A tensor no
    process has a gradient for keeps none, so AdamW leaves it alone as it would in one process."""
    import torch.distributed as dist

    world = dist.get_world_size()
    device = params[0].device
    has = torch.tensor([float(p.grad is not None) for p in params], device=device)
    dist.all_reduce(has)
    for p, count in zip(params, has.tolist()):
        if count:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= world
