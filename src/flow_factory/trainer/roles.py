"""A run's trainable roles: several copies of the transformer trained side by side (a few-step generator, the
online fake score of DMD2), each with its own optimizer, over one frozen teacher.

Each role is a named LoRA adapter on the one transformer (peft's multiple adapters): the generator is the adapter
every other part of the trainer already knows (``models/lora.ADAPTER_NAME``: what the rollouts and eval sample
with, what the EMA copies, what the checkpoint saves for ``pipe.load_lora_weights``), the others are added beside
it with the same rank, alpha and targets, and peft's initialisation (``lora_B = 0``) starts each one at the base
model. The teacher (``policy.reference_velocity``) is the base with every adapter disabled. One adapter is active
at a time: ``active(role)`` makes it the one the transformer runs and the only one with ``requires_grad``, for one
phase of the optimisation loop (``optimize.optimize_epoch``); ``switched(role)`` runs another role for a no-grad
query inside it (the generator's loss reads the fake score). Outside the loop's phases the generator is active.

Each trainable role but the generator has its optimizer here (the generator's is the backend's, built from the
generator's entry: ``optimizer_settings``), its LoRA weights and optimizer state saved beside the checkpoint
(``<role>_lora.pt``, ``<role>_optimizer.pt``) and restored on resume.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

from ..checkpoint import CheckpointError
from ..config import ConfigError
from ..config.distillation import DISTILLATION_SPECS, GENERATOR, RoleOptimizerSettings, role_optimizers
from ..models.lora import ADAPTER_NAME
from .optimizers import make_role_optimizer


def lora_file(role: str) -> str:
    return f"{role}_lora.pt"


def optimizer_file(role: str) -> str:
    return f"{role}_optimizer.pt"


class Roles:
    """The trainable roles of one run on ``transformer`` (see the module's docstring)."""

    def __init__(self, transformer: torch.nn.Module, settings: dict[str, RoleOptimizerSettings],
                 master_dtype: torch.dtype):
        self.transformer, self.settings = transformer, settings
        self.names = tuple(settings)  # the generator first, then upstream's order
        self.adapters = {role: ADAPTER_NAME if role == GENERATOR else role for role in self.names}
        config = transformer.peft_config[ADAPTER_NAME]
        for role, adapter in self.adapters.items():
            if adapter != ADAPTER_NAME:
                with warnings.catch_warnings():  # peft warns that a second adapter is added: that is the point
                    warnings.filterwarnings("ignore", message=".*multiple adapters.*")
                    transformer.add_adapter(config, adapter_name=adapter)  # same rank, alpha and targets
        self.params = {role: [p for n, p in transformer.named_parameters() if _of_adapter(n, adapter)]
                       for role, adapter in self.adapters.items()}
        for params in self.params.values():
            for p in params:
                p.data = p.data.to(master_dtype)
        self.optimizers: dict[str, torch.optim.Optimizer] = {}  # the roles' but the generator's (``start``)
        self._activate(GENERATOR)

    @classmethod
    def of(cls, cfg, trained: dict, master_dtype: torch.dtype) -> "Roles | None":
        """The roles of ``train.trainer_type`` (None for a trainer without roles), added to the trained transformer
        that ``models.lora.make_trainable`` gave the generator's adapter."""
        name = cfg.train.trainer_type
        if name not in DISTILLATION_SPECS:
            return None
        settings = role_optimizers(name, cfg.train.role_optimizers, cfg.train)
        ordered = {GENERATOR: settings[GENERATOR], **{r: s for r, s in settings.items() if r != GENERATOR}}
        return cls(trained["transformer"], ordered, master_dtype)

    # ------------------------------------------------------------------ which adapter runs
    def _layers(self) -> list[BaseTunerLayer]:
        return [m for m in self.transformer.modules() if isinstance(m, BaseTunerLayer)]

    def _run(self, role: str) -> None:
        """``role``'s adapter is the one the transformer runs (peft's ``set_adapter`` would also reset every
        adapter's ``requires_grad``, which ``_activate`` decides)."""
        for layer in self._layers():
            layer._active_adapter = self.adapters[role]

    def _activate(self, role: str) -> None:
        self._run(role)
        for other, params in self.params.items():
            for p in params:
                p.requires_grad_(other == role)

    @contextmanager
    def active(self, role: str):
        """``role`` runs and trains (its weights alone have gradients); the generator again afterwards."""
        self._activate(role)
        try:
            yield
        finally:
            self._activate(GENERATOR)

    @contextmanager
    def switched(self, role: str):
        """``role`` runs, for a query without gradients, inside another role's phase."""
        current = self._layers()[0].active_adapter
        self._run(role)
        try:
            yield
        finally:
            for layer in self._layers():
                layer._active_adapter = current

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
        """The other roles' optimizers, and on resume their weights and state from the checkpoint."""
        if backend != "ddp":  # the config refuses several processes; a one-process fsdp2 / DeepSpeed launch too
            raise ConfigError(f"config_file: the roles of {', '.join(self.names)} are LoRA adapters the {backend} "
                              "backend would neither shard nor gather; run it without fsdp2 or DeepSpeed")
        self.optimizers = {role: make_role_optimizer(self.params[role], self.settings[role])
                           for role in self.names if role != GENERATOR}
        if resume_from is not None:
            self.load(Path(resume_from))

    def state_files(self, with_optimizers: bool) -> dict:
        """File name -> state, for a checkpoint: each other role's LoRA (and its optimizer's state)."""
        files = {}
        for role, optimizer in self.optimizers.items():
            weights = get_peft_model_state_dict(self.transformer, adapter_name=self.adapters[role])
            bad = [k for k, t in weights.items() if not torch.isfinite(t).all()]
            if bad:  # the loop skips non-finite steps: reaching here is a bug, never a checkpoint
                raise FloatingPointError(f"refusing to save the {role} role: {len(bad)} tensors hold NaN or inf")
            files[lora_file(role)] = {k: t.detach().cpu() for k, t in weights.items()}
            if with_optimizers:
                files[optimizer_file(role)] = optimizer.state_dict()
        return files

    def load(self, checkpoint: Path) -> None:
        for role, optimizer in self.optimizers.items():
            path = checkpoint / lora_file(role)
            if not path.is_file():
                raise CheckpointError(f"model.resume_path: {checkpoint} holds no {lora_file(role)} (the {role} "
                                      "role's weights): not a checkpoint of this trainer")
            weights = torch.load(path, map_location="cpu", weights_only=True)
            result = set_peft_model_state_dict(self.transformer, weights, adapter_name=self.adapters[role])
            missing = [k for k in result.missing_keys if f".{self.adapters[role]}." in k]
            if result.unexpected_keys or missing:
                raise CheckpointError(f"model.resume_path: {path} does not fit the {role} role: unexpected "
                                      f"{result.unexpected_keys[:3]}, missing {missing[:3]}")
            state = checkpoint / optimizer_file(role)
            if state.is_file():
                optimizer.load_state_dict(torch.load(state, map_location="cpu", weights_only=True))


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

    def reference_velocity(self, latents, sigma, cond, guidance_scale=None):
        return self.policy.reference_velocity(latents, sigma, cond, guidance_scale)

    @torch.no_grad()
    def role_velocity(self, role: str, latents, sigma, cond, guidance_scale: float = 1.0):
        with self.roles.switched(role):
            return self.policy.adapter.velocity(latents, sigma, cond, guidance_scale)
