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

Gradients sync across processes through the DDP wrapper ``syncing_module``; a multi-expert model
is not wrapped (``FlowAdapter.wrap_transformer``), so with ``syncing_module=None`` this loop
averages them itself before the optimizer step. FSDP2 reduce-scatters every backward into the
sharded gradients. DeepSpeed's engine accumulates, clips and steps
inside ``backward`` at the end of an accumulation; the optimizer's own step is then a no-op. The engine
skips a step whose reduced gradients hold NaN or inf itself (its overflow check, a flag reduced over the
processes; ``fill_deepspeed_config`` keeps it on under bf16), and this loop counts that skip as it counts
the other backends' (``engine.was_step_applied()``).
A lockstep algorithm (DGPO) shuffles and draws alike on every process, so the processes train
the parts of one global micro-batch together.

``step_snapshots`` (name -> (``WeightCopy``, ``decay(k)``)) move after every optimizer step k of
the run (``steps_before`` + the steps of this epoch so far), as ``w <- d w + (1 - d) theta``.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from accelerate.utils import DistributedType

from ..algorithms.base import merge_batches
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

    @classmethod
    def from_config(cls, cfg) -> "OptimizeSettings":
        train = cfg.train
        return cls(batch_size=train.per_device_batch_size, accumulation=cfg.gradient_accumulation,
                   max_grad_norm=train.max_grad_norm, num_inner_epochs=train.num_inner_epochs,
                   shuffle=train.shuffle_samples, steps_per_call=train.steps_per_call)


def optimize_epoch(algorithm, policy, rollouts, advantages: torch.Tensor, settings: OptimizeSettings, *,
                   accelerator, optimizer, params: list, syncing_module, guard: NonFiniteGuard, seed: int,
                   epoch: int, step_snapshots: dict | None = None, steps_before: int = 0) -> tuple[dict[str, float], int]:
    """Returns the epoch's mean (``_min`` / ``_max``: extreme) metrics and the optimizer steps taken.

    ``syncing_module``: the module whose backend syncs the gradients (DDP's wrapper, whose all-reduce this
    loop defers to the micro-step that steps; an FSDP2 root; DeepSpeed's engine), or None, when this loop
    averages them over the processes itself (a multi-expert model DDP cannot wrap). ``seed`` and ``epoch``
    seed the shuffles and the training draws, so that a resumed run repeats them.

    Metrics that are NaN or inf are left out of the means; ``skipped_updates`` counts the
    optimizer steps skipped for a non-finite gradient."""
    acc = accelerator
    batch_size, accumulation, max_grad_norm = settings.batch_size, settings.accumulation, settings.max_grad_norm
    deepspeed = acc.distributed_type == DistributedType.DEEPSPEED
    engine = acc.deepspeed_engine_wrapped.engine if deepspeed else None
    scaled = acc.scaler is not None or (deepspeed and engine.fp16_enabled())  # fp16: a loss scaler skips overflows
    # DDP skips the all-reduce of micro-steps that do not step. FSDP2 reduce-scatters every backward
    # instead (deferring would keep whole gradients on every process); DeepSpeed knows its boundary itself
    defer_sync = isinstance(syncing_module, torch.nn.parallel.DistributedDataParallel)
    units = algorithm.training_units(rollouts.group_ids, advantages)
    batch_size = algorithm.units_per_chunk(batch_size)
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    micro, steps, skipped, overflowed = 0, 0, 0, 0
    # fp16: whether a loss of the accumulation so far was NaN or inf (tells the data's inf from an overflow);
    # a tensor, read only when a step overflowed, so that no micro-step waits on the device for it
    bad_loss = torch.zeros((), dtype=torch.bool, device=acc.device)
    rank = 0 if algorithm.lockstep else acc.process_index  # which process's draws this one makes
    for inner in range(settings.num_inner_epochs):
        order = (torch.randperm(len(units), generator=generator("shuffle", seed, epoch, inner, rank))
                 if settings.shuffle else torch.arange(len(units)))
        for b, start in enumerate(range(0, len(units), batch_size)):
            chosen = units[order[start:start + batch_size]]
            # training noise / timesteps of the decoupled algorithms: seeded per micro-batch, so a
            # resumed run draws the same ones
            draws = generator("train", seed, epoch, inner, rank, b)
            for batch in _merged(algorithm.micro_batches(rollouts, advantages, chosen, draws), settings.steps_per_call,
                                 lambda: accumulation - micro % accumulation):
                batch = on_device(batch, acc.device)
                parts = batch.parts
                # gradients sync across processes only on the micro-step that steps the optimizer
                syncs = (micro + parts) % accumulation == 0
                with nullcontext() if syncs or not defer_sync else acc.no_sync(syncing_module), acc.autocast():
                    loss, metrics = algorithm.loss(policy, batch)
                    # no gradient when only a frozen expert denoised the batch (Wan2.2 training one expert)
                    if deepspeed:
                        # DeepSpeed's engine divides by its gradient_accumulation_steps (= accumulation)
                        # and steps, clipping, in the backward of the micro-step told it ends the accumulation;
                        # so a micro-step without a gradient (on every process: the experts run in lockstep)
                        # backs a zero through the trained weights, and the engine still counts and steps
                        tied = loss if loss.requires_grad else loss + 0 * sum(p.sum() for p in params)
                        _tell_deepspeed_the_boundary(acc, syncs)
                        acc.backward(tied * parts)
                    elif loss.requires_grad:
                        acc.backward(loss * parts / accumulation)
                micro += parts
                metrics["loss"] = loss.detach()
                if scaled:
                    bad_loss |= ~torch.isfinite(loss.detach()).to(bad_loss.device)
                if syncs:
                    if syncing_module is None and acc.num_processes > 1:
                        average_gradients(params)
                    metrics["grad_norm"] = grad_norm = _norm(acc.clip_grad_norm_(params, max_grad_norm))
                    # DeepSpeed's engine has stepped already, unless its overflow check found the reduced
                    # gradients (or their norm) NaN or inf: then it skipped the step, alike on every process
                    stepped = engine.was_step_applied() if deepspeed else bool(torch.isfinite(grad_norm))
                    if stepped:
                        optimizer.step()  # a no-op under DeepSpeed
                        for name, (snapshot, decay_of) in (step_snapshots or {}).items():
                            metrics[f"{name}_decay"] = decay = decay_of(steps_before + steps)
                            snapshot.update(decay)
                        steps += 1
                        guard.passed()
                    elif scaled and _everywhere(acc, not bool(bad_loss)):
                        # fp16: finite losses whose scaled gradients overflowed. The scaler skips the step
                        # (the weights are untouched) and lowers its scale: not a lost update. (DeepSpeed's
                        # own scaler has skipped it already, and lowers its scale for the data's NaN too)
                        optimizer.step()
                        overflowed += 1
                    else:
                        skipped += 1
                        if acc.scaler is not None:  # the data's NaN or inf: skipped, the loss scale kept
                            scale = acc.scaler.get_scale()
                            optimizer.step()  # the scaler skips it, and must close its step to unscale again
                            acc.scaler.update(scale)
                        optimizer.zero_grad(set_to_none=True)  # before a raise, too
                        guard.skip(f"epoch {epoch}: optimizer step with a non-finite gradient norm "
                                   f"(loss {float(loss.detach()):.4g})")
                    optimizer.zero_grad(set_to_none=True)
                    bad_loss.zero_()
                for k, v in metrics.items():
                    v = float(v)
                    if not math.isfinite(v):
                        continue
                    if k.endswith("_min"):
                        sums[k] = min(sums.get(k, v), v)
                    elif k.endswith("_max"):
                        sums[k] = max(sums.get(k, v), v)
                    else:  # a merged batch's metric is the mean over its parts: it counts that many times
                        weight = 1 if k == "grad_norm" else parts
                        sums[k] = sums.get(k, 0.0) + v * weight
                        counts[k] = counts.get(k, 0) + weight
    if deepspeed:
        _tell_deepspeed_the_boundary(acc, True)
    out = {f"train/{k}": (v / counts[k] if k in counts else v) for k, v in sums.items()}
    out["train/skipped_updates"] = skipped
    if scaled:
        out["train/overflow_skipped_steps"] = overflowed
    if acc.scaler is not None:
        out["train/loss_scale"] = float(acc.scaler.get_scale())
    return out, steps


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
