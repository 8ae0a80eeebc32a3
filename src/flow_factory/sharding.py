"""What each accelerate backend needs from the trainer: DDP, FSDP2 or DeepSpeed ZeRO.

DDP (and one process) keeps the trainer's original path: the optimizer and the transformer
are prepared apart, every process holds every weight. FSDP2 and DeepSpeed take the
transformer and its optimizer in one ``accelerator.prepare(model, optimizer)`` call, as
accelerate requires for both (FSDP2 shards the parameters and re-points the optimizer at the
shards; DeepSpeed builds its engine around both). DeepSpeed also needs the micro-batch size
before that call, since no dataloader is prepared: ``fill_deepspeed_config``.

accelerate never shards on CPU (an FSDP config runs as plain data parallel there), so on CPU
an FSDP launch is sharded here with torch's own ``fully_shard``, unit by unit as accelerate
would (each block of the ``*blocks`` lists, then the root): the same parameters end up as
DTensor shards, and everything after (saving, resuming, EMA) runs the code a GPU run runs.

After sharding, a parameter is a DTensor whose ``to_local()`` is this process's shard. The
full tensors a checkpoint holds are gathered with ``torch.distributed.checkpoint``'s full
state dicts (a collective: every process calls it, the main one writes), and a checkpoint
is loaded back by handing the full tensors to every process, which keeps its own shard.

DeepSpeed runs its own engine, on CPU too (over gloo: ``accelerator_kwargs``). ZeRO-1/2 keep
whole weights on every process; ZeRO-3's parameters are partitions (``ds_tensor``), gathered
one at a time for a checkpoint. A checkpoint loads into the plain model before the engine is
built (its fp32 master copies start from it), and the engine's own state (each process's
partition of the master weights and AdamW's moments) is saved and restored by DeepSpeed
itself: ``save_engine_state`` / ``load_engine_state``. DeepSpeed builds one engine per run, so a
model's several trained experts go into it as one network (``BundledExperts``), as Flow-Factory
bundles them; ZeRO-3 is refused for them (``trainer/backends.py``).
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from functools import partial

import torch
from torch import nn

DEEPSPEED_DIR = "deepspeed"  # a checkpoint's folder of DeepSpeed's own engine state
DEEPSPEED_TAG = "engine"


def accelerator_kwargs(on_cpu: bool) -> dict:
    """The ``Accelerator``'s device arguments. A DeepSpeed launch on CPU must not say ``cpu=True``:
    accelerate would then run plain data parallel (``MULTI_CPU``) and never build the engine; told
    the gloo backend instead, it lets DeepSpeed start its process group and runs ZeRO on CPU."""
    if on_cpu and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        from accelerate.utils import InitProcessGroupKwargs

        return {"cpu": False, "kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}
    return {"cpu": on_cpu}


def load_frozen_models_whole() -> None:
    """Under ZeRO-3, accelerate tells transformers to build every model it loads inside
    ``deepspeed.zero.Init``, partitioned over the processes. Only the trained transformer goes
    through DeepSpeed's engine (which partitions it when prepared); the text encoders and reward
    models stay frozen outside it and must hold their whole weights, so that request is withdrawn
    before anything loads. Nothing else reads it: the engine takes its config from the plugin."""
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def backend_of(accelerator) -> str:
    """``ddp`` (one process too), ``fsdp`` or ``deepspeed``: what the launch config asked for."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return "deepspeed"
    if kind == DistributedType.FSDP or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        version = accelerator.state.fsdp_plugin.fsdp_version if kind == DistributedType.FSDP else int(
            os.environ.get("FSDP_VERSION", "1"))
        if version != 2:
            from .config import ConfigError

            raise ConfigError(f"config_file: FSDP version {version}; ff-train shards with FSDP2 only: set "
                              "fsdp_version: 2 in fsdp_config, or use the shipped fsdp2 config")
        return "fsdp"
    return "ddp"


def fill_deepspeed_config(plugin, micro_batch_size: int, accumulation: int, max_grad_norm: float,
                          num_processes: int) -> None:
    """The DeepSpeed config's batch keys from the run's epoch arithmetic, its clipping from
    ``train.max_grad_norm``: DeepSpeed steps, accumulates and clips inside its engine. It also skips a
    step whose reduced gradients hold NaN or inf, the non-finite guard's skip (``trainer/optimize.py``
    counts it): under ZeRO-1/2 with bf16 only while ``bf16.check_grad_overflow`` is on, so it is set
    here, whatever the config file says (accelerate has written the ``bf16`` section by now)."""
    ds = plugin.deepspeed_config
    ds["train_micro_batch_size_per_gpu"] = micro_batch_size
    ds["gradient_accumulation_steps"] = accumulation
    ds["gradient_clipping"] = max_grad_norm
    ds["train_batch_size"] = micro_batch_size * accumulation * num_processes
    if isinstance(ds.get("bf16"), dict):
        ds["bf16"]["check_grad_overflow"] = True
    plugin.gradient_accumulation_steps = accumulation


def block_units(transformer: nn.Module) -> list[nn.Module]:
    """The transformer blocks, each one FSDP unit: the children of its ``*blocks`` ModuleLists."""
    return [block for name, child in transformer.named_children()
            if isinstance(child, nn.ModuleList) and name.endswith("blocks") for block in child]


def shard_on_cpu(transformer: nn.Module) -> nn.Module:
    """torch's ``fully_shard`` over the processes' gloo group, as accelerate's FSDP2 plugin does on
    GPUs: every block a unit, then the root; resharded after forward (full shard)."""
    from torch.distributed.fsdp import fully_shard

    reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() == "true"
    for block in block_units(transformer):
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(transformer, reshard_after_forward=reshard)
    return transformer


class BundledExperts(nn.Module):
    """A model's trained experts as the one network a DeepSpeed engine wraps: ``forward(..., expert=name)``
    runs the expert named, so each expert is still called alone, through the engine."""

    def __init__(self, experts: dict[str, nn.Module]):
        super().__init__()
        self.experts = nn.ModuleDict(experts)

    def forward(self, *args, expert: str, **kwargs):
        return self.experts[expert](*args, **kwargs)


def prepare_sharded(accelerator, backend: str, transformers: dict[str, nn.Module], make_optimizer):
    """The trained networks (a multi-expert model's experts, by component) and one optimizer over all of
    them (``make_optimizer(params)``), prepared for ``backend``; returns (what the forward calls, by
    component; the optimizer; DeepSpeed's engine, else None). Each network is its own FSDP2 root: the
    experts are called apart; DeepSpeed's one engine takes several experts bundled."""
    from accelerate.utils import DistributedType

    if backend == "fsdp" and accelerator.distributed_type != DistributedType.FSDP:  # CPU: accelerate will not
        for transformer in transformers.values():
            shard_on_cpu(transformer)
        return dict(transformers), make_optimizer([p for t in transformers.values() for p in trainable(t)]), None
    if backend == "deepspeed":
        network = next(iter(transformers.values())) if len(transformers) == 1 else BundledExperts(transformers)
        engine, optimizer = accelerator.prepare(network, make_optimizer(trainable(network)))
        if len(transformers) == 1:
            return {name: engine for name in transformers}, optimizer, engine
        return {name: partial(engine, expert=name) for name in transformers}, optimizer, engine
    # accelerate prepares one model per call, with an optimizer over its parameters (it re-points that
    # optimizer at the shards); the experts' optimizers then become param groups of the first one
    prepared, optimizers = {}, []
    for name, transformer in transformers.items():
        prepared[name], optimizer = accelerator.prepare(transformer, make_optimizer(trainable(transformer)))
        optimizers.append(optimizer)
    first = optimizers[0]
    for other in optimizers[1:]:  # no state yet: AdamW's groups move over as they are
        for group in other.optimizer.param_groups:
            first.optimizer.add_param_group(group)
        accelerator._optimizers.remove(other)
    return prepared, first, None


def optimized_model(trained: dict[str, nn.Module]) -> nn.Module:
    """The trained networks as the one module ``torch.distributed.checkpoint`` keys an optimizer's state by:
    the network itself (parameter names as its own), or several experts under their component names."""
    if len(trained) == 1:
        return next(iter(trained.values()))
    return nn.ModuleDict(trained)


def trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


# ------------------------------------------------------------------ shards and full tensors
def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's part of a parameter: the shard of a DTensor, ZeRO-3's partition (``ds_tensor``),
    the tensor itself otherwise."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.to_local()
    return getattr(tensor, "ds_tensor", tensor)


def gather_full(shard: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The full tensor of which ``shard`` is this process's part, sharded as parameter ``like`` (collective)."""
    from torch.distributed.tensor import DTensor

    if hasattr(like, "ds_id"):  # ZeRO-3: equal flat partitions in rank order, the last one padded
        import torch.distributed as dist

        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, shard.contiguous())
        return torch.cat(parts)[:like.ds_numel].view(like.ds_shape)
    if not isinstance(like, DTensor):
        return shard
    spread = DTensor.from_local(shard.to(like.device), like.device_mesh, like.placements, shape=like.shape,
                                stride=like.stride())
    return spread.full_tensor()


def shard_of(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This process's part of ``full``, sharded as parameter ``like`` (every process holds ``full``)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if hasattr(like, "ds_id"):  # ZeRO-3: this rank's slice of the flat tensor, padded as the partitions are
        import torch.distributed as dist

        size = like.ds_tensor.numel()
        flat = torch.nn.functional.pad(full.reshape(-1), (0, size * dist.get_world_size() - full.numel()))
        return flat[dist.get_rank() * size:(dist.get_rank() + 1) * size].to(like.ds_tensor.device)
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()


def full_state_dict(module: nn.Module, accelerator, backend: str) -> dict[str, torch.Tensor]:
    """The module's full state dict on CPU, under its usual keys: on the main process; ``{}`` elsewhere.
    A collective for a sharded module: every process calls it."""
    if backend == "deepspeed":
        return _deepspeed_full_state_dict(accelerator.unwrap_model(module), accelerator.is_main_process)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _deepspeed_full_state_dict(module: nn.Module, main: bool) -> dict[str, torch.Tensor]:
    """ZeRO-1/2 keep whole weights on every process; ZeRO-3's parameters are partitions (``ds_id``), each
    gathered in turn (a collective), copied to CPU on the main process, and partitioned again."""
    import deepspeed

    state = {}
    for key, value in module.state_dict(keep_vars=True).items():
        with deepspeed.zero.GatheredParameters([value]) if hasattr(value, "ds_id") else nullcontext():
            if main:
                state[key] = value.detach().cpu().clone()
    return state


def save_engine_state(engine, folder) -> None:
    """DeepSpeed's own checkpoint of its engine under ``folder``: each process writes its partition of
    the fp32 master weights and AdamW's moments (the state a gathered ``optimizer.pt`` holds for the
    other backends), frozen weights left out. A collective; ``folder`` must be one all processes see."""
    engine.save_checkpoint(str(folder), tag=DEEPSPEED_TAG, save_latest=False, exclude_frozen_parameters=True)


def load_engine_state(engine, folder) -> bool:
    """The engine's partitions and optimizer state of ``save_engine_state``'s folder; every process
    reads its own (the same number of processes and ZeRO stage as the run that wrote it). False when
    DeepSpeed found nothing to load there."""
    path, _ = engine.load_checkpoint(str(folder), tag=DEEPSPEED_TAG, load_module_strict=False,
                                     load_optimizer_states=True, load_lr_scheduler_states=False)
    return path is not None


def load_full_state_dict(module: nn.Module, state: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Full tensors (every process holds them) into a sharded module: each process keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=strict))


def full_optimizer_state(module: nn.Module, optimizer) -> dict:
    """The optimizer state of a sharded module, gathered (keyed by parameter name); on the main process."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                cpu_offload=True))


def load_full_optimizer_state(module: nn.Module, optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))


def reshard_all(modules) -> None:
    """Free the weights FSDP gathered (the root keeps its own after a forward), so the next forward
    gathers the shards as they are now: after weights were swapped in place."""
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()


def release_gathered(params) -> None:
    """Free ZeRO-3's gathered weights of ``params`` (the small ones it keeps gathered, ``ds_persist``,
    included), so the next forward gathers the partitions as they are now: after weights were swapped
    into the partitions in place."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    available = [p for p in params if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE]
    if available:
        available[0].partition(param_list=available)


def all_finite_everywhere(params: list) -> bool:
    """Whether every process's shards of ``params`` are finite (the same answer on every process)."""
    import torch.distributed as dist

    shards = [local(p) for p in params]
    ok = torch.tensor(float(all(bool(torch.isfinite(s).all()) for s in shards if s.numel())),
                      device=shards[0].device if shards else None)
    if dist.is_initialized() and any(s is not p for s, p in zip(shards, params)):
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok)
