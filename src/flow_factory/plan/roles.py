"""What a distillation run's roles (``train.trainer_type: dmd2``, ``tdm``, ``tdm-r1``, ``diffusion-opd``;
trainer/roles.py) add to its plan: memory and work that a run without roles does not have.

Memory, on each GPU through the rollout and the training phases (the roles are made after the prompt cache):
each other trainable role's weights (a LoRA adapter beside the generator's, of its size, or with full
fine-tuning a whole copy of the transformer, in ``master_weight_dtype``) and its optimizer's state (its own
``optimizers:`` entry's kind), TDM-R1's slow copy of the surrogate and a role's EMA where its entry asks (float32
copies, ``trainer/ema.WeightCopy``), and with full fine-tuning the teacher's frozen copy in the load dtype (with
LoRA the teacher is the base with the adapters off: nothing more). Gradients: one role's at a time, since each
role's optimizer step sets its gradients to None before the next phase (``optimize._EpochSteps._step``), so the
largest role's, which is the generator's size. Under fsdp2 a LoRA role's adapters are shards of the one sharded
transformer (full copies and the teacher are sharded too), each role's optimizer state, slow copy and EMA of its
shards: split as the generator's are. DeepSpeed refuses the roles: its columns count them split alike, for a run
that is refused.

Work: one optimizer step runs every phase (``Algorithm.phases``: DMD2's ``ttur_fake_updates`` fake-score passes,
then the generator's) over the same chunks, and each pass's loss calls the transformer several times (the
generator's loss reads the teacher and the fake score without gradients, DMD2's and TDM's fake passes the
generator). The calls are not listed here: they are what the algorithm's own ``micro_batches`` and ``loss`` ask
of the policy, recorded (``CallRecorder``) on rollouts of a one-element latent, then measured at the real size as
the plan measures every call.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from ..config.distillation import DISTILLATION_SPECS, GENERATOR, role_optimizers
from .measure import Measured
from .memory import OPTIMIZER_STATE


@dataclass(frozen=True)
class Call:
    """One transformer call of a loss: its rows, its guidance scale, whether it has gradients, and whether it is
    the teacher's (with LoRA the base, the adapters off: none of their matmuls)."""

    rows: int
    guidance: float
    grad: bool
    teacher: bool = False
    # which micro-batch of the pass made it (its backward ends that one's graphs: diffusion-opd's pass over a chunk
    # is one micro-batch per distilled step); not part of what is measured
    batch: int = field(default=0, compare=False)


class CallRecorder:
    """A policy that answers every velocity a loss asks for with zeros and records the call (``RolePolicy``'s
    methods: the active role's ``velocity`` with gradients, the others without)."""

    def __init__(self, guidance_scale: float):
        self.guidance_scale, self.calls, self.batch = guidance_scale, [], 0
        self._weight = torch.zeros((), requires_grad=True)  # so that a loss on the active role's output is trainable

    def _answer(self, latents, guidance, grad: bool, teacher: bool = False):
        self.calls.append(Call(len(latents), float(guidance), grad, teacher, self.batch))
        zeros = torch.zeros_like(latents, dtype=torch.float32)
        return zeros + self._weight if grad else zeros

    def velocity(self, latents, sigma, cond, guidance_scale=None):
        return self._answer(latents, self.guidance_scale if guidance_scale is None else guidance_scale, True)

    def reference_velocity(self, latents, sigma, cond, guidance_scale=None):
        return self._answer(latents, self.guidance_scale if guidance_scale is None else guidance_scale, False, True)

    def role_velocity(self, role, latents, sigma, cond, guidance_scale: float = 1.0):
        return self._answer(latents, guidance_scale, False)

    def slow_velocity(self, role, latents, sigma, cond, guidance_scale: float = 1.0):
        return self._answer(latents, guidance_scale, False)

    def teacher_velocity(self, teacher, latents, sigma, cond, guidance_scale: float):
        return self._answer(latents, guidance_scale, False)  # diffusion-opd's: the base with that teacher's LoRA


def recorded_phases(cfg) -> list[tuple[str, int, list[Call]]]:
    """(role, passes, the transformer calls of one pass over one chunk, in order) for each phase of an optimizer
    step of ``cfg``'s distillation trainer: its ``micro_batches`` and ``loss`` run on a chunk of
    ``per_device_batch_size`` samples whose rollouts hold a one-element latent."""
    from ..algorithms import make_algorithm
    from ..dynamics import make_dynamics
    from ..sampling import Rollouts

    train, steps = cfg.train, cfg.rollout_steps
    algorithm = make_algorithm(train.trainer_type, train, make_dynamics(cfg.scheduler.dynamics_type,
                                                                        cfg.scheduler.noise_level))
    n, names = train.per_device_batch_size, [source.name for source in cfg.data.split_sources("train")]
    rollouts = Rollouts(prompts=[""] * n, group_ids=torch.arange(n) // train.group_size,
                        datasets=[names[i % len(names)] for i in range(n)],  # diffusion-opd's teachers take turns
                        latents=torch.zeros(n, steps + 1, 1), log_probs=torch.zeros(n, steps),
                        sigmas=torch.linspace(1.0, 0.0, steps + 1), sde_steps=[], cond={},
                        media=torch.zeros(n, 1), sample_ids=torch.arange(n))
    advantages = torch.zeros(n)
    units = algorithm.training_units(rollouts.group_ids, advantages)[:algorithm.units_per_chunk(n)]
    out = []
    for role, passes in algorithm.phases:
        recorder = CallRecorder(getattr(train, "loss_guidance_scale", train.guidance_scale))
        for recorder.batch, batch in enumerate(algorithm.micro_batches(
                rollouts, advantages, units, torch.Generator().manual_seed(0), role=role)):
            algorithm.loss(recorder, batch)
        out.append((role, passes, recorder.calls))
    return out


@dataclass
class RolePhases:
    """Each phase of an optimizer step: its role, passes, and the measured calls of one pass over one chunk."""

    phases: list[tuple[str, int, list[tuple[Call, Measured]]]] = field(default_factory=list)

    @property
    def flops_per_chunk(self) -> float:
        """FLOPs of one chunk through every phase of an optimizer step: every pass of each, every call of a pass."""
        return sum(passes * sum(m.flops for _, m in calls) for _, passes, calls in self.phases)

    def peak(self, role: str) -> int:
        """A bound on what one pass of ``role``'s phase holds at once: a call's own peak over the peaks of the
        calls with gradients before it in its micro-batch (their graphs are alive until its backward)."""
        calls = next(c for r, _, c in self.phases if r == role)
        held, worst, batch = 0, 0, 0
        for call, measured in calls:
            held, batch = (held, batch) if call.batch == batch else (0, call.batch)  # the last one's backward ran
            worst = max(worst, held + measured.peak)
            held += measured.peak if call.grad else 0
        return worst

    @property
    def activations(self) -> int:
        return max(self.peak(role) for role, _, _ in self.phases)

    def as_calls(self) -> dict[str, Measured]:
        """One entry per phase (``Plan.calls``): a pass's FLOPs and its bound on the peak."""
        return {f"{role} pass": Measured(sum(m.flops for _, m in calls), self.peak(role))
                for role, _, calls in self.phases}


def measured_phases(cfg, adapter, measure, known: dict[Call, Measured]) -> RolePhases:
    """``recorded_phases`` with each distinct call measured once by ``measure(rows, guidance, grad)`` on
    ``adapter`` (the teacher's with its LoRA adapters off), or taken from ``known``."""
    from ..models.lora import lora_disabled

    measured = dict(known)
    phases = []
    for role, passes, calls in recorded_phases(cfg):
        for call in calls:
            if call not in measured:
                base = call.teacher and cfg.model.finetune_type == "lora"
                with lora_disabled(adapter.transformers["transformer"]) if base else nullcontext():
                    measured[call] = measure(call.rows, call.guidance, call.grad)
        phases.append((role, passes, [(call, measured[call]) for call in calls]))
    return RolePhases(phases)


def add_phase_calls(cfg, adapter, measure, calls: dict[str, Measured], training: Call) -> None:
    """``calls`` gains a ``"<role> pass"`` entry per phase of a distillation run (``RolePhases.as_calls``), measured
    unless it holds them all; ``training``: the call ``calls["training"]`` measured."""
    if all(f"{role} pass" in calls for role, _ in phase_passes(cfg)):
        return
    calls.update(measured_phases(cfg, adapter, measure, {training: calls["training"]}).as_calls())


def training_peak(cfg, calls: dict[str, Measured]) -> int:
    """The training phase's activations: one micro-batch's, or a distillation run's largest pass's."""
    passes = phase_passes(cfg)
    return max(calls[f"{role} pass"].peak for role, _ in passes) if passes else calls["training"].peak


def role_memory(cfg, networks: list, precision, notes: list[str]) -> dict:
    """``plan.memory.Sizes``' ``roles`` (part -> (bytes, where: gpu or cpu, what it is split as: weights, optimizer
    or copies) the roles add beside the generator's trained transformer, in ``networks`` as
    ``plan.memory.Network``) and ``role_gradients`` (the largest other role's gradient bytes); nothing without
    roles."""
    train, lora = cfg.train, cfg.model.finetune_type == "lora"
    if train.trainer_type not in DISTILLATION_SPECS:
        return {"roles": {}, "role_gradients": 0}
    notes.append(f"{train.trainer_type}'s other roles under DeepSpeed train beside its engine, whole on every GPU "
                 "(zero1, zero2 columns; with LoRA only; zero3 is refused for them)")
    network = next(net for net in networks if net.trained)
    settings = role_optimizers(train.trainer_type, train.role_optimizers, train)
    weights = network.trained * network.master_bytes if lora else network.weight_bytes  # an adapter, or a copy
    parts, grads = {}, 0
    for role, setting in settings.items():
        if role == GENERATOR:
            continue
        parts[f"{role}: weights"] = (weights, "gpu", "weights")
        parts[f"{role}: optimizer state"] = (network.graded * OPTIMIZER_STATE[setting.optimizer] * 4, "gpu",
                                             "optimizer")
        if setting.ema_decay > 0:
            parts[f"{role}: EMA"] = (network.trained * 4, "cpu" if train.ema_device == "cpu" else "gpu", "copies")
        grads = max(grads, network.graded * network.master_bytes)
    if "surrogate" in settings:
        parts["surrogate: slow copy"] = (network.trained * 4, "gpu", "copies")
    if not lora:
        parts["teacher: frozen copy"] = (network.params * precision.load.itemsize, "gpu", "copies")
    if train.teachers:  # diffusion-opd's LoRA teachers, frozen adapters: each counted at the student's size
        parts["teachers: LoRA adapters"] = (len(train.teachers) * weights, "gpu", "weights")
        notes.append(f"its {len(train.teachers)} teachers are counted at the student's LoRA size (their files "
                     "are not read)")
    return {"roles": parts, "role_gradients": grads}


def phase_passes(cfg) -> list[tuple[str, int]]:
    """(role, passes) of each phase of an optimizer step of ``cfg``'s distillation trainer (its spec's, the
    ``ttur_fake_updates`` the config gives); empty for a trainer without roles."""
    spec = DISTILLATION_SPECS.get(cfg.train.trainer_type)
    if spec is None:
        return []
    return [(role, passes if isinstance(passes, int) else getattr(cfg.train, passes)) for role, passes in spec.phases]


def generator_optimizer(cfg) -> str:
    """The generator's optimizer kind: its ``optimizers:`` entry's, else the train section's."""
    train = cfg.train
    if train.trainer_type not in DISTILLATION_SPECS:
        return getattr(train, "optimizer", "adamw")
    return role_optimizers(train.trainer_type, train.role_optimizers, train)[GENERATOR].optimizer
