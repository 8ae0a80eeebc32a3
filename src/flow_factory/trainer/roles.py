"""A run's trainable roles: several copies of the transformer trained side by side (a few-step generator, the
online fake score of DMD2 and TDM), each with its own optimizer, over one frozen teacher.

With LoRA (``LoraRoles``) each role is a named LoRA adapter on the one transformer (peft's multiple adapters):
the generator is the adapter every other part of the trainer already knows (``models/lora.ADAPTER_NAME``: what
the rollouts and eval sample with, what the EMA copies, what the checkpoint saves for ``pipe.load_lora_weights``),
the others are added beside it with the same rank, alpha and targets, and peft's initialisation (``lora_B = 0``)
starts each one at the base model. The teacher is the base with every adapter disabled. Without LoRA
(``CopiedRoles``) each other role is a full copy of the transformer, and the teacher a frozen copy of the starting
weights, both taken before any checkpoint loads; a role runs by standing in for the transformer
(``FlowAdapter.swapped_transformers``).

One role is active at a time: ``active(role)`` makes it the one the model runs and the one with gradients, for
one phase of the optimisation loop (``optimize.optimize_epoch``); ``switched(role)`` runs another role for a
no-grad query inside it (the generator's loss reads the fake score). Outside the loop's phases the generator runs.

Each trainable role but the generator has its optimizer here (the generator's is the backend's, built from the
generator's entry: ``generator_optimizer``), its weights and optimizer state saved beside the checkpoint
(``<role>_lora.pt`` or ``<role>_transformer.pt``, ``<role>_optimizer.pt``) and restored on resume. A role whose
``optimizers:`` entry gives ``ema_decay`` keeps an EMA of its weights (``<role>_ema.pt``), moved after each epoch as
the generator's (``train.ema_*``: schedule, interval, device) but at its own decay; nothing samples with it, it is
the checkpoint's. The generator's EMA is the trainer's (``train.ema_decay``), as without roles.

The backends (``start``): under DDP the other roles run beside DDP's wrapper, their gradients averaged by the
optimisation loop. Under FSDP2 every role is sharded (LoRA: the adapters are parameters of the transformer the
backend shards; full: ``CopiedRoles._shard``), each role's optimizer over its shards, its files gathered for a
checkpoint. Under DeepSpeed ZeRO-1/2 (LoRA) the engine holds the generator's optimizer and the other roles train
beside it, whole, as under DDP (``_beside_engine``). Full copies under DeepSpeed and ZeRO-3 are refused.
"""

from __future__ import annotations

import copy
import logging
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

from ..checkpoint import CheckpointError
from ..config import ConfigError
from ..config.distillation import DISTILLATION_SPECS, GENERATOR, RoleOptimizerSettings, role_optimizers
from ..models.lora import ADAPTER_NAME, adapter_running, lora_disabled, run_adapter
from ..sharding import (full_optimizer_state, full_state_dict, load_full_optimizer_state, load_full_state_dict,
                        local, reshard_all, shard_on_cpu)
from ..algorithms.distillation.tdm_r1 import slow_surrogate_decay
from .ema import WeightCopy, ema_decay_at, load_ema
from .optimizers import make_role_optimizer
from .policy import frozen_copy
from .teachers import LoraTeachers

logger = logging.getLogger(__name__)


def optimizer_file(role: str) -> str:
    return f"{role}_optimizer.pt"


def slow_file(role: str) -> str:
    return f"{role}_slow.pt"


def ema_file(role: str) -> str:
    return f"{role}_ema.pt"


class Roles:
    """The trainable roles of one run on ``adapter``'s transformer (see the module's docstring). Subclasses say
    how a role runs (``active``, ``switched``, ``teacher``) and what its weights are (``weights``, ``load_weights``)."""

    weights_file = "{role}.pt"
    backends: tuple[str, ...] = ("ddp",)  # the training backends these roles train under (``backends.py``'s names)

    def __init__(self, adapter, settings: dict[str, RoleOptimizerSettings]):
        self.adapter, self.transformer, self.settings = adapter, adapter.transformers["transformer"], settings
        self.names = tuple(settings)  # the generator first, then upstream's order
        self.params: dict[str, list] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}  # the roles' but the generator's (``start``)
        self.slow_decays: dict = {}  # role -> decay(step) of its slow copy (TDM-R1's surrogate)
        self.slow: dict[str, WeightCopy] = {}  # role -> its slow copy (``start``)
        self.emas: dict[str, WeightCopy] = {}  # role -> its EMA, where its entry asks (``start``)
        self.train = None  # the config's train section: the EMAs' schedule, interval and device
        self.teachers: LoraTeachers | None = None  # diffusion-opd's frozen LoRA teachers (trainer/teachers.py)
        self.sharded = False  # under FSDP2 (``start``): every role's weights are shards of the one sharded module
        self.beside_engine = False  # under DeepSpeed (``start``): the other roles train beside its engine

    @staticmethod
    def of(cfg, adapter, master_dtype: torch.dtype) -> "Roles | None":
        """The roles of ``train.trainer_type`` (None for a trainer without roles), beside the trained transformer
        ``models.lora.make_trainable`` made the generator."""
        name = cfg.train.trainer_type
        if name not in DISTILLATION_SPECS:
            return None
        settings = role_optimizers(name, cfg.train.role_optimizers, cfg.train)
        ordered = {GENERATOR: settings[GENERATOR], **{r: s for r, s in settings.items() if r != GENERATOR}}
        kind = LoraRoles if cfg.model.finetune_type == "lora" else CopiedRoles
        roles = kind(adapter, ordered, master_dtype)
        roles.train = cfg.train
        if cfg.train.teachers:  # diffusion-opd's, adapters beside the student's (the config asks for LoRA)
            roles.teachers = LoraTeachers(roles.transformer, cfg.train.teachers)
        if "surrogate" in roles.names:  # TDM-R1's trust region: a slow copy of the surrogate, moved after its steps
            low, high = cfg.train.surrogate_slow_decay_min, cfg.train.surrogate_slow_decay_max
            roles.slow_decays["surrogate"] = lambda step: slow_surrogate_decay(step, low, high)
        return roles

    @staticmethod
    def other_params(roles: "Roles | None") -> list:
        """The trained weights of every role but the generator (none without roles): the trainer checks them
        finite after each epoch's update, as it checks the generator's."""
        return [] if roles is None else [p for role in roles.names if role != GENERATOR for p in roles.params[role]]

    def active(self, role: str):
        raise NotImplementedError

    def switched(self, role: str):
        raise NotImplementedError

    def teacher(self):
        raise NotImplementedError

    def weights(self, role: str, full: dict | None = None) -> dict:
        """``role``'s weights (``full``: read from this full state dict of the transformer, under FSDP2)."""
        raise NotImplementedError

    def load_weights(self, role: str, weights: dict, path: Path) -> None:
        raise NotImplementedError

    def _collect(self) -> dict[str, list]:
        """Each role's trained parameters, as the modules hold them now."""
        raise NotImplementedError

    def module(self, role: str) -> torch.nn.Module:
        """The module that holds ``role``'s weights."""
        raise NotImplementedError

    def _shard(self) -> None:
        """Under FSDP2, shard what the backend did not (the backend sharded the transformer)."""

    def _beside_engine(self) -> None:
        """Under DeepSpeed ZeRO-1/2 the engine wraps the transformer, the other roles' adapters in it, and keeps fp32
        masters for its own optimizer's weights (the generator's) alone, having cast the rest to the run's precision:
        the other roles' weights go back to their master dtype, stepped by their own optimizers beside the engine
        (whole on every process, as ZeRO-1/2 keep every weight; their gradients averaged by the optimisation loop).
        ZeRO-3 partitions every weight it wraps, which the other roles' optimizers could not step."""
        if any(hasattr(p, "ds_id") for p in self.transformer.parameters()):
            raise ConfigError("config_file: DeepSpeed ZeRO-3 partitions the transformer, the other roles' adapters "
                              "with it, which their own optimizers cannot step; use zero1 or zero2, or fsdp2")
        for role in self.names:
            for p in self.params[role] if role != GENERATOR else ():
                p.data = p.data.to(self.master_dtype)

    # ------------------------------------------------------------------ optimizers and checkpoints
    def generator_optimizer(self, params: list) -> torch.optim.Optimizer:
        """The generator's optimizer over ``params`` (the backend's call: ``weights.ModelSetup``)."""
        return make_role_optimizer(params, self.settings[GENERATOR])

    @staticmethod
    def started(roles: "Roles | None", policy, backend: str, resume_from: Path | None):
        """The policy the algorithm calls: ``policy`` itself without roles; else, once ``roles`` have their other
        optimizers (and on resume their weights and state), a ``RolePolicy`` over it."""
        if roles is None:
            return policy
        roles.start(backend, resume_from)
        return RolePolicy(policy, roles)

    def start(self, backend: str, resume_from: Path | None) -> None:
        """The other roles' optimizers, and on resume their weights and state from the checkpoint. Under FSDP2
        (``backend`` fsdp) the backend has sharded the transformer, every role's adapters with it, and replaced
        each parameter with its shard: the roles' parameters are taken again, and their optimizers hold shards."""
        if backend not in self.backends:  # the config refuses these launches; this, a launch it could not read
            raise ConfigError(f"config_file: the {backend} backend does not train {type(self).__name__} (the roles "
                              f"{', '.join(self.names)}); use {' or '.join(self.backends)}")
        self.sharded, self.beside_engine = backend == "fsdp", backend == "deepspeed"
        if self.sharded:
            self._shard()
        self.params = self._collect()
        if self.beside_engine:
            self._beside_engine()
        if self.teachers is not None:  # diffusion-opd's, frozen: as they loaded, whatever the backend cast
            self.teachers.keep_as_loaded()
        self.optimizers = {role: make_role_optimizer(self.params[role], self.settings[role])
                           for role in self.names if role != GENERATOR}
        # a copy swapped into shards frees the weights FSDP2 gathered, so that the next forward gathers the swapped
        swap = {role: (lambda m=self.module(role): reshard_all([m])) if self.sharded else None for role in self.names}
        self.slow = {role: WeightCopy(self.params[role], before_swap=swap[role])  # from the starting weights
                     for role in self.slow_decays}
        device = None if self.train.ema_device == "same" else self.train.ema_device
        self.emas = {role: WeightCopy(self.params[role], device, before_swap=swap[role]) for role in self.names
                     if role != GENERATOR and self.settings[role].ema_decay > 0}
        if resume_from is not None:
            self.load(Path(resume_from))

    def held(self, accelerator) -> dict[str, list[int]]:
        """Each role's trained values on each process (all of them unless sharded), for the checkpoint's record;
        a collective."""
        counts = torch.tensor([sum(local(p).numel() for p in self.params[role]) for role in self.names],
                              device=accelerator.device)
        counts = accelerator.gather(counts).reshape(accelerator.num_processes, len(self.names))
        return dict(zip(self.names, counts.T.tolist()))

    def after_epoch(self, epoch: int) -> dict[str, float]:
        """Each role's EMA moved after ``epoch`` (every ``ema_update_interval`` epochs, ``ema_decay_at`` of its own
        decay); the decays, as metrics."""
        train, metrics = self.train, {}
        if (epoch + 1) % train.ema_update_interval:
            return metrics
        for role, ema in self.emas.items():
            decay = ema_decay_at(train.ema_decay_schedule, epoch, self.settings[role].ema_decay, train.max_epochs,
                                 train.flat_steps, train.ramp_rate)
            ema.update(decay)
            metrics[f"train/{role}/ema_decay"] = decay
        return metrics

    def state_files(self, with_optimizers: bool, full: dict | None = None) -> dict:
        """File name -> state, for a checkpoint: each other role's weights (and its optimizer's state), its slow
        copy and EMA. On every process: under FSDP2 each is gathered (a collective), the weights from ``full``,
        the transformer's full state dict the backend gathered for the generator's file."""
        files = {}
        for role, optimizer in self.optimizers.items():
            weights = self.weights(role, full if self.sharded else None)
            bad = [k for k, t in weights.items() if t.is_floating_point() and not torch.isfinite(t).all()]
            if bad:  # the loop skips non-finite steps: reaching here is a bug, never a checkpoint
                raise FloatingPointError(f"refusing to save the {role} role: {len(bad)} tensors hold NaN or inf")
            files[self.weights_file.format(role=role)] = {k: t.detach().cpu().clone() for k, t in weights.items()}
            if with_optimizers:
                files[optimizer_file(role)] = (full_optimizer_state(self.module(role), optimizer) if self.sharded
                                               else optimizer.state_dict())
        files.update({slow_file(role): slow.state_dict() for role, slow in self.slow.items()})
        files.update({ema_file(role): ema.state_dict() for role, ema in self.emas.items()})
        return files

    def step_snapshots(self, role: str) -> dict:
        """What moves after each of ``role``'s optimizer steps (``optimize.Stepper.step_snapshots``): its slow
        copy, ``w <- d w + (1 - d) theta``."""
        return {f"{role}_slow": (self.slow[role], self.slow_decays[role])} if role in self.slow else {}

    def load(self, checkpoint: Path) -> None:
        for role, optimizer in self.optimizers.items():
            path = checkpoint / self.weights_file.format(role=role)
            if not path.is_file():
                raise CheckpointError(f"model.resume_path: {checkpoint} holds no {path.name} (the {role} role's "
                                      "weights): not a checkpoint of this trainer and fine-tuning type")
            self.load_weights(role, torch.load(path, map_location="cpu", weights_only=True), path)
            state = checkpoint / optimizer_file(role)
            if not state.is_file():
                logger.warning("model.resume_path %s holds no %s (saved with log.save_model_only); the %s role's "
                               "optimizer restarts", checkpoint, state.name, role)
                continue
            state = torch.load(state, map_location="cpu", weights_only=True)
            if self.sharded:  # saved gathered, keyed by parameter name: each process keeps its shards' state
                with self.active(role):  # torch makes the state to fill by a step of the weights with gradients
                    load_full_optimizer_state(self.module(role), optimizer, state)
            else:
                optimizer.load_state_dict(state)
        for role, slow in self.slow.items():
            if not load_ema(slow, checkpoint, slow_file(role)):
                raise CheckpointError(f"model.resume_path: {checkpoint} holds no {slow_file(role)} (the {role} "
                                      "role's slow copy)")
        for role, ema in self.emas.items():
            if not load_ema(ema, checkpoint, ema_file(role)):  # a run that asked for it only now
                ema.copy_from_params()
                logger.warning("model.resume_path %s holds no %s; the %s role's EMA restarts from its resumed "
                               "weights", checkpoint, ema_file(role), role)


class LoraRoles(Roles):
    """Each role a LoRA adapter on the one transformer; the teacher the base, every adapter off."""

    weights_file = "{role}_lora.pt"
    # FSDP2 shards every role's adapters with the transformer they sit in; DeepSpeed ZeRO-1/2 keep them whole
    backends = ("ddp", "fsdp", "deepspeed")

    def __init__(self, adapter, settings: dict[str, RoleOptimizerSettings], master_dtype: torch.dtype):
        super().__init__(adapter, settings)
        transformer, self.master_dtype = self.transformer, master_dtype
        self.adapters = {role: ADAPTER_NAME if role == GENERATOR else role for role in self.names}
        config = transformer.peft_config[ADAPTER_NAME]
        for role, name in self.adapters.items():
            if name != ADAPTER_NAME:
                with warnings.catch_warnings():  # peft warns that a second adapter is added: that is the point
                    warnings.filterwarnings("ignore", message=".*multiple adapters.*")
                    transformer.add_adapter(config, adapter_name=name)  # same rank, alpha and targets
        self.params = self._collect()
        for params in self.params.values():
            for p in params:
                p.data = p.data.to(master_dtype)
        self._activate(GENERATOR)

    def _collect(self) -> dict[str, list]:
        return {role: [p for n, p in self.transformer.named_parameters() if _of_adapter(n, name)]
                for role, name in self.adapters.items()}

    def module(self, role: str) -> torch.nn.Module:
        return self.transformer

    def _activate(self, role: str) -> None:
        if self.sharded:  # FSDP2 copies a shard's requires_grad to its gathered weight when it gathers: free them
            reshard_all([self.transformer])
        run_adapter(self.transformer, self.adapters[role])
        for other, params in self.params.items():
            for p in params:
                p.requires_grad_(other == role)

    @contextmanager
    def active(self, role: str):
        """``role`` runs and trains (its weights alone have gradients); the generator again afterwards. Another
        role than the generator runs outside DDP's wrapper, which registered the generator's weights alone: the
        optimisation loop averages that role's gradients over the processes itself."""
        callers = self.adapter.callers
        self._activate(role)
        if role != GENERATOR:
            self.adapter.callers = {name: c for name, c in callers.items() if name != "transformer"}
        try:
            yield
        finally:
            self.adapter.callers = callers
            self._activate(GENERATOR)

    def switched(self, role: str):
        """``role`` runs, for a query without gradients, inside another role's phase."""
        return adapter_running(self.transformer, self.adapters[role])

    def teacher(self):
        return lora_disabled(self.transformer)

    def weights(self, role: str, full: dict | None = None) -> dict:
        return get_peft_model_state_dict(self.transformer, state_dict=full, adapter_name=self.adapters[role])

    def load_weights(self, role: str, weights: dict, path: Path) -> None:
        name = self.adapters[role]
        if self.sharded:  # full tensors (on every process) into the shards, under the parameters' own names
            names = {n.replace(f".{name}.", "."): n for n, _ in self.transformer.named_parameters()
                     if _of_adapter(n, name)}
            if set(weights) != set(names):
                raise CheckpointError(f"model.resume_path: {path} does not fit the {role} role: unexpected "
                                      f"{sorted(set(weights) - set(names))[:3]}, missing "
                                      f"{sorted(set(names) - set(weights))[:3]}")
            load_full_state_dict(self.transformer, {names[k]: v for k, v in weights.items()}, strict=False)
            return
        result = set_peft_model_state_dict(self.transformer, weights, adapter_name=name)
        missing = [k for k in result.missing_keys if f".{name}." in k]
        if result.unexpected_keys or missing:
            raise CheckpointError(f"model.resume_path: {path} does not fit the {role} role: unexpected "
                                  f"{result.unexpected_keys[:3]}, missing {missing[:3]}")


class CopiedRoles(Roles):
    """Full fine-tuning: each other role a full copy of the transformer (its weights in ``master_dtype``, as the
    generator's), the teacher a frozen copy in the load dtype; both copied from the starting weights."""

    weights_file = "{role}_transformer.pt"
    backends = ("ddp", "fsdp")  # FSDP2: each copy, and the teacher, sharded as a frozen network is (``_shard``)

    def __init__(self, adapter, settings: dict[str, RoleOptimizerSettings], master_dtype: torch.dtype):
        super().__init__(adapter, settings)
        self.copies = {role: copy.deepcopy(self.transformer) for role in self.names if role != GENERATOR}
        self.frozen_teacher = frozen_copy(self.transformer, adapter.device, adapter.dtype)
        self.params = self._collect()

    def _running(self, role: str):
        return nullcontext() if role == GENERATOR and self.adapter.transformer is self.transformer else \
            self.adapter.swapped_transformers({"transformer": self.transformer if role == GENERATOR
                                               else self.copies[role]})

    def active(self, role: str):
        """``role``'s copy stands in for the transformer (each copy's weights have gradients of their own)."""
        return self._running(role)

    def switched(self, role: str):
        return self._running(role)

    def module(self, role: str) -> torch.nn.Module:
        return self.transformer if role == GENERATOR else self.copies[role]

    def _shard(self) -> None:
        """Each other role's copy and the frozen teacher sharded over the processes, every block a unit, as the
        backend shards a frozen network (``backends.FSDP2.shard_frozen``): each process holds 1/N of each. Their
        forwards are collectives, run alike on every process (the phases and their micro-batches are)."""
        for module in (*self.copies.values(), self.frozen_teacher):
            shard_on_cpu(module)

    def _collect(self) -> dict[str, list]:
        return {GENERATOR: [p for p in self.transformer.parameters() if p.requires_grad],
                **{role: [p for p in module.parameters() if p.requires_grad] for role, module in self.copies.items()}}

    def teacher(self):
        return self.adapter.swapped_transformers({"transformer": self.frozen_teacher})

    def weights(self, role: str, full: dict | None = None) -> dict:
        module = self.copies[role]
        return full_state_dict(module, None, "fsdp") if self.sharded else module.state_dict()  # gathered: collective

    def load_weights(self, role: str, weights: dict, path: Path) -> None:
        try:
            if self.sharded:  # full tensors (on every process) into the shards
                load_full_state_dict(self.copies[role], weights)
            else:
                self.copies[role].load_state_dict(weights)
        except RuntimeError as e:
            raise CheckpointError(f"model.resume_path: {path} does not fit the {role} role: {e}") from None


def _of_adapter(name: str, adapter: str) -> bool:
    """A LoRA parameter of ``adapter`` (peft names them ``...lora_A.<adapter>.weight``)."""
    return "lora_" in name and f".{adapter}." in name


class RolePolicy:
    """The policy of a run with roles: ``velocity`` is the active role's (with gradients), ``role_velocity``
    another role's (no gradients), ``reference_velocity`` the teacher's; the rest is the wrapped policy's."""

    def __init__(self, policy, roles: Roles):
        self.policy, self.roles = policy, roles

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def velocity(self, latents, sigma, cond, guidance_scale: float | None = None):
        """The active role's velocity, with gradients, at ``guidance_scale`` (None: the policy's)."""
        if guidance_scale is None:
            return self.policy.velocity(latents, sigma, cond)
        return self.policy.adapter.velocity(latents, sigma, cond, guidance_scale)

    @torch.no_grad()
    def reference_velocity(self, latents, sigma, cond, guidance_scale: float | None = None):
        """The frozen teacher's velocity at ``guidance_scale`` (None: the policy's)."""
        scale = self.policy.guidance_scale if guidance_scale is None else guidance_scale
        with self.roles.teacher():
            return self.policy.adapter.velocity(latents, sigma, cond, scale)

    @torch.no_grad()
    def teacher_velocity(self, teacher: str, latents, sigma, cond, guidance_scale: float):
        """diffusion-opd's teacher ``teacher`` (``train.teachers``' name): the base with its LoRA, at
        ``guidance_scale``."""
        with self.roles.teachers.running(teacher):
            return self.policy.adapter.velocity(latents, sigma, cond, guidance_scale)

    @torch.no_grad()
    def role_velocity(self, role: str, latents, sigma, cond, guidance_scale: float = 1.0):
        with self.roles.switched(role):
            return self.policy.adapter.velocity(latents, sigma, cond, guidance_scale)

    @torch.no_grad()
    def slow_velocity(self, role: str, latents, sigma, cond, guidance_scale: float = 1.0):
        """``role``'s velocity under its slow copy's weights (TDM-R1's surrogate trust region)."""
        with self.roles.switched(role), self.roles.slow[role].applied():
            return self.policy.adapter.velocity(latents, sigma, cond, guidance_scale)
