"""The policy an algorithm trains: the adapter's velocity under the current weights,
and under the reference weights (the LoRA adapter disabled, or a frozen full copy).
Sampling and training both call ``adapter.velocity`` through here, so the
on-policy ratio is exactly 1 (DESIGN invariant 1).

The decoupled algorithms also ask for the velocity under the weights the rollout
sampled with (``sampling_velocity``: the EMA when ``off_policy``, else a copy taken at
rollout time) and under the EMA (``ema_velocity``): ``trainer/ema.WeightCopy`` objects
given at construction, swapped into the live parameters for the call. The reference of a
sharded full fine-tune (FSDP) is such a copy too, of this process's shards, given as
``reference``: a deep copy would hold the whole model on every process.
"""

from __future__ import annotations

import copy
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..models.base import FlowAdapter
from ..models.conditioning import Conditioning
from ..models.lora import lora_disabled
from ..precision import cast_as_loaded


@dataclass
class PolicyWeights:
    """The copies of the trained weights a loss may call the model with, each a ``WeightCopy`` swapped in for
    the call."""

    ema: Any = None  # the EMA weights, when train.ema_decay > 0
    sampling: Any = None  # the weights the rollout sampled with
    snapshots: dict = field(default_factory=dict)  # name -> the algorithm's weight / step snapshots
    # a full fine-tune's starting weights, taken before any checkpoint loads: a WeightCopy of a sharded model's
    # shards, or ``frozen_reference``'s copies (None: made at construction, for a policy built without a trainer)
    reference: Any = None


class AdapterPolicy:
    def __init__(self, adapter: FlowAdapter, guidance_scale: float, finetune_type: str,
                 keep_reference: bool, ref_param_device: str = "same", weights: PolicyWeights | None = None,
                 components: list[str] = ("transformer",), one_scale_for_experts: bool = False):
        weights = weights or PolicyWeights()
        ema, sampling_weights, snapshots, reference = weights.ema, weights.sampling, weights.snapshots, weights.reference
        self.adapter = adapter
        self.components = list(components)  # the trained networks (model.target_components)
        self.guidance_scale = guidance_scale
        # train.train_guidance_scale given: the loss's scale is a two-expert model's low-noise expert's too
        self.one_scale_for_experts = one_scale_for_experts
        self.finetune_type = finetune_type
        self.reference = None
        self.sampling_weights = sampling_weights  # WeightCopy of the weights the rollout used
        self.ema = ema  # WeightCopy of the EMA weights, when train.ema_decay > 0
        self.snapshots = snapshots or {}  # name -> WeightCopy: the algorithm's weight / step snapshots
        if keep_reference and finetune_type == "full":
            self.reference = reference if reference is not None else frozen_reference(adapter, self.components,
                                                                                       ref_param_device)

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor:
        return self._velocity(latents, sigma, cond, self.guidance_scale)

    def _velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, scale: float) -> Tensor:
        if not self.one_scale_for_experts:
            return self.adapter.velocity(latents, sigma, cond, scale)
        scale_2, self.adapter.guidance_scale_2 = self.adapter.guidance_scale_2, None
        try:
            return self.adapter.velocity(latents, sigma, cond, scale)
        finally:
            self.adapter.guidance_scale_2 = scale_2

    @torch.no_grad()
    def reference_velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning,
                           guidance_scale: float | None = None) -> Tensor:
        """The reference's velocity at ``guidance_scale`` (None: the policy's; DGPO's / CRD's ``kl_cfg``
        gives a guided teacher, whose negative branch ``cond`` must hold)."""
        with self._reference_weights():
            return self._velocity(latents, sigma, cond, self.guidance_scale if guidance_scale is None else guidance_scale)

    @torch.no_grad()
    def sampling_velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor:
        if self.sampling_weights is None:
            raise RuntimeError("sampling_velocity needs the rollout's weights: construct the policy with "
                               "sampling_weights for algorithms with uses_sampling_policy")
        with self.sampling_weights.applied():
            return self._velocity(latents, sigma, cond, self.guidance_scale)

    @torch.no_grad()
    def snapshot_velocity(self, name: str, latents: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor:
        if name not in self.snapshots:
            raise RuntimeError(f"snapshot_velocity: no weight snapshot {name!r}; the algorithm's weight_snapshots "
                               f"and step_snapshots name {sorted(self.snapshots)}")
        with self.snapshots[name].applied():
            return self._velocity(latents, sigma, cond, self.guidance_scale)

    @torch.no_grad()
    def ema_velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor:
        if self.ema is None:
            raise RuntimeError("ema_velocity needs the EMA: set train.ema_decay > 0")
        with self.ema.applied():
            return self._velocity(latents, sigma, cond, self.guidance_scale)

    @contextmanager
    def _reference_weights(self):
        if self.finetune_type == "lora":
            with ExitStack() as stack:
                for name in self.components:
                    stack.enter_context(lora_disabled(self.adapter.transformers[name]))
                yield
            return
        if self.reference is None:
            raise RuntimeError("reference_velocity needs a reference model: set train.kl_beta > 0")
        if not isinstance(self.reference, dict):  # the shards' WeightCopy
            with self.reference.applied():
                yield
            return
        stored_on = next(next(iter(self.reference.values())).parameters()).device
        try:
            with self.adapter.swapped_transformers({name: module.to(self.adapter.device)
                                                    for name, module in self.reference.items()}):
                yield
        finally:
            for module in self.reference.values():
                module.to(stored_on)


def frozen_reference(adapter: FlowAdapter, components: list[str], ref_param_device: str = "same") -> dict:
    """A frozen copy of each trained network as it is now, in the load dtype (the trained ones are kept float32);
    ``ref_param_device`` "cpu" keeps accelerator memory free. Taken before a checkpoint loads (``weights.py``):
    a copy taken after a resume would hold the resumed weights, not the ones the run started from."""
    device = adapter.device if ref_param_device == "same" else torch.device(ref_param_device)
    return {name: frozen_copy(adapter.transformers[name], device, adapter.dtype) for name in components}


def frozen_copy(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A frozen copy of ``module`` on ``device`` in ``dtype``, but for the parts its class keeps in float32
    (diffusers' ``_keep_in_fp32_modules``: Wan's norms and time embedder), as ``from_pretrained`` loads them."""
    return cast_as_loaded(copy.deepcopy(module).requires_grad_(False).eval(), dtype).to(device)
