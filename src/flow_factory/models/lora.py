"""LoRA on a diffusers transformer through peft: add, save, restore, disable.

Saved adapters use diffusers' own LoRA format (``Pipeline.save_lora_weights``),
so a user loads a trained adapter with ``pipe.load_lora_weights(dir)`` and
nothing from Flow-Factory. The peft config (rank, alpha, targets) is stored as
metadata beside the weights: without it diffusers assumes alpha = rank and a
LoRA trained with another alpha would load at the wrong scale.

Traps this file handles:
- peft's ``disable_adapters`` also sets ``requires_grad=False`` on the LoRA
  weights and ``enable_adapters`` sets it back to True, whatever it was;
  ``lora_disabled`` restores the flags it found.
- once LoRA is injected, a base weight ``x.weight`` lives at
  ``x.base_layer.weight``; a ``strict=False`` load of a plain state dict
  silently skips it. ``load_lora_state`` loads only LoRA tensors and fails
  loudly on any key that does not land.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from diffusers.loaders.lora_base import LoraBaseMixin
from peft import LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from ..config.sections import component_targets

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # the file name diffusers writes and reads
ADAPTER_NAME = "default"
# a LoRA on the hub: owner/name, then the folder inside the repo that holds it (Flow-Factory's path spec)
HUB_LORA = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(/[\w.-]+)*")


def lora_weight_name(component: str = "transformer") -> str:
    """The file of one component's LoRA in a checkpoint folder: diffusers' own name for the transformer,
    ``pytorch_lora_weights_<component>.safetensors`` for another expert (Wan2.2's transformer_2, which
    ``pipe.load_lora_weights(dir, weight_name=..., load_into_transformer_2=True)`` loads)."""
    return LORA_WEIGHT_NAME if component == "transformer" else f"pytorch_lora_weights_{component}.safetensors"


def _linear_names(transformer: nn.Module) -> list[str]:
    return [name for name, m in transformer.named_modules() if isinstance(m, nn.Linear) and name]


def _matches(module_name: str, target: str) -> bool:
    # peft's rule for a list of targets: the whole name, or a suffix starting at a dot
    return module_name == target or module_name.endswith("." + target)


def block_linear_names(transformer: nn.Module) -> list[str]:
    """Full names of every nn.Linear inside the transformer's block lists (``target_modules: all``).

    The blocks are the ModuleLists named ``*blocks`` (``transformer_blocks``,
    ``single_transformer_blocks``, Wan's ``blocks``); embedders and the output
    head stay frozen, as in the reference trainers.
    """
    names = []
    for child_name, child in transformer.named_children():
        if isinstance(child, nn.ModuleList) and child_name.endswith("blocks"):
            names += [f"{child_name}.{n}" for n, m in child.named_modules() if isinstance(m, nn.Linear)]
    if not names:
        raise ValueError(f"{type(transformer).__name__} has no ModuleList named '*blocks'; list target_modules explicitly")
    return names


def lora_target_names(transformer: nn.Module, target_modules, default_targets: list[str]) -> list[str]:
    """Resolve ``target_modules`` ("default", "all", a name or a list of names) to peft targets."""
    if target_modules == "all":
        return block_linear_names(transformer)
    linears = _linear_names(transformer)
    # a model family's defaults may name modules some checkpoints lack (SD3's last block
    # has no to_add_out, a 1-layer test model has only that block): keep those present
    defaults = [t for t in default_targets if any(_matches(n, t) for n in linears)]
    if target_modules == "default":
        targets = defaults
    elif isinstance(target_modules, str):
        targets = [target_modules]
    else:  # "default" inside a list: the defaults and the names beside it
        targets = list(dict.fromkeys(t for name in target_modules for t in (defaults if name == "default" else [name])))
    if not targets:
        raise ValueError(f"lora target_modules {target_modules!r} selects nothing in {type(transformer).__name__}; "
                         "use 'default', 'all' or a list of module names")
    unknown = [t for t in targets if not any(_matches(n, t) for n in linears)]
    if unknown:
        # names inside a block without the block's index ("attn.to_q", "ff.net.2") are what users write
        examples = sorted({re.sub(r"^\w*blocks\.\d+\.", "", n) for n in linears})
        raise ValueError(
            f"lora target_modules: no nn.Linear in {type(transformer).__name__} is named {unknown}; "
            f"examples of valid names: {examples[:24]} (or 'default' / 'all')"
        )
    return targets


def apply_lora(transformer: nn.Module, rank: int, alpha: float, target_modules="default",
               default_targets: list[str] | None = None) -> list[str]:
    """Add a LoRA adapter in place; only its weights are trainable afterwards.

    peft's default init sets ``lora_B = 0``, so the output is unchanged until the
    first update (the on-policy ratio is exactly 1). Returns the resolved targets.
    """
    targets = lora_target_names(transformer, target_modules, default_targets or [])
    config = LoraConfig(r=int(rank), lora_alpha=float(alpha), target_modules=targets, lora_dropout=0.0)
    transformer.requires_grad_(False)
    transformer.add_adapter(config, adapter_name=ADAPTER_NAME)
    return targets


def lora_state_dict(transformer: nn.Module, state_dict: dict | None = None) -> dict[str, torch.Tensor]:
    """The LoRA tensors under diffusers' key names (no adapter name), detached on CPU; of ``state_dict``
    (the transformer's full state, gathered from a sharded model) when given."""
    state = get_peft_model_state_dict(transformer, state_dict=state_dict, adapter_name=ADAPTER_NAME)
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def save_lora(pipeline_class, transformer: nn.Module, out_dir, weight_name: str = LORA_WEIGHT_NAME,
              state_dict: dict | None = None) -> Path:
    """Write ``out_dir/<weight_name>`` loadable by ``pipe.load_lora_weights(out_dir, weight_name=...)``;
    ``state_dict``: the transformer's full state, when its own parameters are shards.

    A pipeline class without diffusers' LoRA loader (``HunyuanVideo15Pipeline``) gets the same file, written by
    the loaders' common base; ``load_lora_into`` reads it with the transformer's own ``load_lora_adapter``."""
    out_dir = Path(out_dir)
    config = transformer.peft_config[ADAPTER_NAME].to_dict()
    layers = lora_state_dict(transformer, state_dict)
    if hasattr(pipeline_class, "save_lora_weights"):
        pipeline_class.save_lora_weights(
            out_dir, transformer_lora_layers=layers, transformer_lora_adapter_metadata=config, weight_name=weight_name,
        )
    else:
        LoraBaseMixin.write_lora_layers(
            state_dict=LoraBaseMixin.pack_weights(layers, "transformer"),
            save_directory=str(out_dir), is_main_process=True, weight_name=weight_name, save_function=None,
            safe_serialization=True, lora_adapter_metadata=LoraBaseMixin.pack_weights(config, "transformer"),
        )
    return out_dir


def load_lora_into(pipeline, component: str, lora_dir, weight_name: str = LORA_WEIGHT_NAME, **kwargs) -> None:
    """Load a ``save_lora`` file into ``pipeline.<component>`` the way a user would: the pipeline's
    ``load_lora_weights(lora_dir, weight_name=..., **kwargs)``, or, for a pipeline class without diffusers' LoRA
    loader, ``pipeline.<component>.load_lora_adapter(lora_dir, weight_name=..., prefix="transformer")``."""
    if hasattr(pipeline, "load_lora_weights"):
        pipeline.load_lora_weights(str(lora_dir), weight_name=weight_name, **kwargs)
    else:
        getattr(pipeline, component).load_lora_adapter(str(lora_dir), weight_name=weight_name, prefix="transformer")


def lora_file(path: str) -> Path | None:
    """The diffusers LoRA file ``path`` names on this machine: a ``.safetensors`` file, or a folder's
    ``pytorch_lora_weights.safetensors`` (what ``save_lora`` writes); None when nothing is at ``path`` (a hub id)."""
    local = Path(path).expanduser()
    if local.is_file():
        return local
    return local / LORA_WEIGHT_NAME if local.is_dir() else None


def lora_file_problem(path: str) -> str | None:
    """Why ``path`` is not a transformer LoRA saved in diffusers' format, or None (a hub id: its download's)."""
    found = lora_file(path)
    if found is None:
        return None if HUB_LORA.fullmatch(path) else "no such file or folder"
    if not found.is_file():
        return f"no {LORA_WEIGHT_NAME} in the folder (a LoRA saved by ff-train or pipe.save_lora_weights)"
    try:
        with safe_open(str(found), framework="pt") as f:
            keys = list(f.keys())
    except Exception as err:  # noqa: BLE001: safetensors raises its own error types for a damaged or foreign file
        return f"{found} is not a safetensors file ({type(err).__name__})"
    if not any(k.startswith("transformer.") for k in keys):
        return f"{found} holds no transformer LoRA weights (keys starting with 'transformer.')"
    return None


def fetch_lora(path: str) -> Path:
    """The LoRA file of ``path``: local (``lora_file``), or ``owner/name[/subfolder]`` from the hub (its cache)."""
    found = lora_file(path)
    if found is not None:
        return found
    from huggingface_hub import hf_hub_download

    owner, name, *sub = path.split("/")
    return Path(hf_hub_download(f"{owner}/{name}", "/".join([*sub, LORA_WEIGHT_NAME])))


def load_lora_state(transformer: nn.Module, lora_dir, weight_name: str = LORA_WEIGHT_NAME) -> None:
    """Restore weights saved by ``save_lora`` into a transformer that already has the same LoRA (resume)."""
    path = Path(lora_dir) / weight_name
    if not path.is_file():
        raise FileNotFoundError(f"no LoRA weights at {path}")
    prefix = "transformer."
    state = {k[len(prefix):]: v for k, v in load_file(str(path)).items() if k.startswith(prefix)}
    if not state:
        raise ValueError(f"{path} holds no transformer LoRA weights (keys must start with {prefix!r})")
    _check_same_config(transformer, path)
    result = set_peft_model_state_dict(transformer, state, adapter_name=ADAPTER_NAME)
    # another adapter beside this one (a distillation run's other roles, trainer/roles.py) is not this file's
    missing = [k for k in result.missing_keys if "lora_" in k and f".{ADAPTER_NAME}." in k]
    if result.unexpected_keys or missing:
        raise ValueError(f"LoRA in {path} does not fit this transformer: "
                         f"unexpected {result.unexpected_keys[:5]}, missing {missing[:5]}")


def lora_module_state(transformer: nn.Module, lora_dir, weight_name: str = LORA_WEIGHT_NAME) -> dict:
    """The LoRA tensors saved by ``save_lora``, under the transformer's own parameter names (with the
    adapter name peft inserts): what ``load_lora_state`` loads, for a sharded transformer's loader."""
    path = Path(lora_dir) / weight_name
    if not path.is_file():
        raise FileNotFoundError(f"no LoRA weights at {path}")
    _check_same_config(transformer, path)
    # this adapter's alone: a distillation run's other roles are adapters beside it (trainer/roles.py)
    names = {n.replace(f".{ADAPTER_NAME}", ""): n for n, _ in transformer.named_parameters()
             if "lora_" in n and f".{ADAPTER_NAME}." in n}
    prefix = "transformer."
    saved = {k[len(prefix):]: v for k, v in load_file(str(path)).items() if k.startswith(prefix)}
    unexpected, missing = sorted(set(saved) - set(names)), sorted(set(names) - set(saved))
    if unexpected or missing:
        raise ValueError(f"LoRA in {path} does not fit this transformer: unexpected {unexpected[:5]}, "
                         f"missing {missing[:5]}")
    return {names[k]: v for k, v in saved.items()}


def _check_same_config(transformer: nn.Module, path: Path) -> None:
    # a different alpha would load without error and silently change the output scale
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    raw = metadata.get("lora_adapter_metadata")  # diffusers' key; entries are "transformer.<field>"
    if raw is None:
        return
    saved, current = json.loads(raw), transformer.peft_config[ADAPTER_NAME]
    rank, alpha = saved.get("transformer.r"), saved.get("transformer.lora_alpha")
    if rank is None or alpha is None:
        return
    if int(rank) != current.r or float(alpha) != float(current.lora_alpha):
        raise ValueError(f"LoRA in {path} has rank {rank}, alpha {alpha}; "
                         f"this transformer has rank {current.r}, alpha {current.lora_alpha}")


def _lora_layers(transformer: nn.Module) -> list[BaseTunerLayer]:
    return [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]


def run_adapter(transformer: nn.Module, name: str) -> None:
    """Make adapter ``name`` the one ``transformer`` runs, every adapter's ``requires_grad`` left as it is (peft's
    ``set_adapter`` would reset them: the roles decide which one trains)."""
    for layer in _lora_layers(transformer):
        layer._active_adapter = name


@contextmanager
def adapter_running(transformer: nn.Module, name: str):
    """Adapter ``name`` runs inside (a query of another role or a teacher); the adapter that ran before, after."""
    before = _lora_layers(transformer)[0].active_adapter
    run_adapter(transformer, name)
    try:
        yield
    finally:
        run_adapter(transformer, before)


@contextmanager
def lora_disabled(transformer: nn.Module):
    """Run the base model (the reference policy): LoRA off inside, restored exactly on exit."""
    layers = _lora_layers(transformer)
    if not layers:
        raise ValueError("lora_disabled: the transformer has no LoRA adapter")
    if all(layer.disable_adapters for layer in layers):
        yield  # already disabled by an outer context
        return
    lora_params = [p for n, p in transformer.named_parameters() if "lora_" in n]
    flags = [p.requires_grad for p in lora_params]
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()
        for p, flag in zip(lora_params, flags):
            p.requires_grad_(flag)


def make_trainable(adapter, cfg, master_dtype: torch.dtype) -> dict[str, nn.Module]:
    """LoRA on, or every weight of, the networks ``model.trained_components`` names, by component; the others (a
    multi-expert model's frozen expert) get no adapter and no gradient. Trained weights keep ``master_dtype``
    (fp32 by default) under mixed precision."""
    model = cfg.model
    trained = {name: adapter.transformers[name] for name in model.trained_components}
    for name, transformer in trained.items():
        if model.finetune_type == "lora":
            apply_lora(transformer, model.lora_rank, model.lora_alpha,
                       component_targets(model.target_modules, name, model.target_components),
                       adapter.default_lora_targets)
        else:
            transformer.requires_grad_(True)
        if cfg.train.enable_gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
    for p in trainable_params(trained):
        p.data = p.data.to(master_dtype)
    return trained


def trainable_params(trained: dict[str, nn.Module]) -> list[nn.Parameter]:
    """What the optimizer steps: after FSDP2, each parameter is this process's shard (a DTensor)."""
    return [p for module in trained.values() for p in module.parameters() if p.requires_grad]
