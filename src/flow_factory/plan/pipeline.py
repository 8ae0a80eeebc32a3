"""A pipeline's networks built on the meta device from their configs: sizes without weights.

The configs come from a local folder (its ``model_index.json`` and each component's ``config.json``) or,
for a hub id our examples name, from ``public_configs``. Every network is built by its own class under
``accelerate.init_empty_weights``, so its parameter count is the class's own arithmetic, not ours. The
adapter of ``model.model_type`` is then built around the meta pipeline: the planner calls its real
``velocity`` and ``decode`` (plan/measure.py).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..config import ConfigError
from ..models.registry import get_adapter_class
from ..precision import cast_as_loaded
from .public_configs import PUBLIC_MODELS, PUBLIC_PIPELINES

# what each component is, by the name the pipelines give it (for the memory phases)
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3", "connectors")
IMAGE_ENCODERS = ("image_encoder",)


@dataclass
class Component:
    name: str
    class_name: str
    module: nn.Module  # on the meta device, in its load dtype
    role: str  # transformer, text_encoder, image_encoder, vae

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    @property
    def bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.module.parameters())


@dataclass
class MetaPipeline:
    source: str  # where the configs came from
    components: dict[str, Component]
    index: dict  # model_index, each component as [library, class, config]
    pipeline: object = None  # the diffusers pipeline over the meta networks
    adapter: object = None  # model_type's adapter around it
    notes: list[str] = field(default_factory=list)

    def of_role(self, role: str) -> dict[str, Component]:
        return {n: c for n, c in self.components.items() if c.role == role}


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def folder_index(folder: Path) -> dict:
    """A pipeline folder's model_index with each component's config read in, as ``PUBLIC_PIPELINES`` holds it."""
    index = read_json(folder / "model_index.json")
    for name, value in list(index.items()):
        if name.startswith("_") or not (isinstance(value, list) and len(value) == 2 and value[0]):
            continue
        files = [folder / name / "config.json", folder / name / "scheduler_config.json",
                 folder / name / "guider_config.json"]
        found = next((f for f in files if f.is_file()), None)
        index[name] = [value[0], value[1], read_json(found) if found else None]
    return index


def pipeline_index(name_or_path: str) -> tuple[dict, str]:
    """(model_index with configs, where from) for ``model.model_name_or_path``."""
    folder = Path(name_or_path).expanduser()
    if (folder / "model_index.json").is_file():
        return folder_index(folder), str(folder)
    if name_or_path in PUBLIC_PIPELINES:
        return json.loads(json.dumps(PUBLIC_PIPELINES[name_or_path])), "flow_factory.plan.public_configs"
    known = ", ".join(sorted(PUBLIC_PIPELINES))
    raise ConfigError(f"model.model_name_or_path: {name_or_path!r} is neither a pipeline folder here nor a "
                      f"checkpoint whose configs the planner knows ({known}); download its config files "
                      "(model_index.json and each */config.json, no weights) to a folder and plan with that")


def component_class(library: str, class_name: str):
    if library in ("diffusers", "transformers"):
        return getattr(importlib.import_module(library), class_name)
    return getattr(importlib.import_module(f"diffusers.pipelines.{library}"), class_name)  # e.g. ltx2's connectors


def build_module(library: str, class_name: str, config: dict | None, dtype: torch.dtype):
    """One component from its config: a network on the meta device in ``dtype``, or a scheduler / guider."""
    from accelerate import init_empty_weights

    cls = component_class(library, class_name)
    config = dict(config or {})
    if not issubclass(cls, nn.Module):
        return cls.from_config(config) if hasattr(cls, "from_config") else None
    with init_empty_weights(include_buffers=True):
        if library == "transformers":
            module = cls(cls.config_class(**config))
        else:
            module = cls.from_config(config)
    return cast_as_loaded(module, dtype).eval().requires_grad_(False)


def role_of(name: str, adapter_cls) -> str:
    if name in adapter_cls.transformer_names:
        return "transformer"
    if name in TEXT_ENCODERS or name in adapter_cls.text_encoder_names:
        return "text_encoder"
    if name in IMAGE_ENCODERS:
        return "image_encoder"
    return "vae"  # the VAE and what decodes beside it (LTX-2's audio VAE and vocoder)


def build_pipeline(model_type: str, name_or_path: str, dtype: torch.dtype) -> MetaPipeline:
    """Every network of the pipeline on the meta device, and the adapter of ``model_type`` around them."""
    adapter_cls = get_adapter_class(model_type)
    index, source = pipeline_index(name_or_path)
    pipeline_cls = adapter_cls.pipeline_class
    expected, optional = pipeline_cls._get_signature_keys(pipeline_cls)
    parts, components = {}, {}
    for name in expected:
        entry = index.get(name)
        if not (isinstance(entry, list) and len(entry) == 3 and entry[0]):
            parts[name] = None
            continue
        if entry[2] is None and entry[1] not in ("FlowMatchEulerDiscreteScheduler",):
            parts[name] = None  # tokenizers and processors: no weights, and the planner tokenizes nothing
            continue
        module = build_module(entry[0], entry[1], entry[2], dtype)
        parts[name] = module
        if isinstance(module, nn.Module):
            components[name] = Component(name, entry[1], module, role_of(name, adapter_cls))
    parts.update({k: index[k] for k in optional if k in index})
    # a scheduler the pipeline needs but the table leaves to its defaults
    if parts.get("scheduler") is None:
        from diffusers import FlowMatchEulerDiscreteScheduler
        parts["scheduler"] = FlowMatchEulerDiscreteScheduler()
    plan = MetaPipeline(source, components, index)
    plan.pipeline = pipeline_cls(**parts)
    # built on "meta", the pipeline's .to() moves nothing; the planner's calls put the inputs there
    plan.adapter = adapter_cls(plan.pipeline, device="meta", dtype=dtype)
    return plan


def build_model(name_or_path: str, dtype: torch.dtype) -> nn.Module | None:
    """A reward's model (``models_to_load``' first entry) on the meta device: a folder's config.json or the
    table's; None when neither is known (its size is then not counted)."""
    folder = Path(name_or_path).expanduser()
    if (folder / "config.json").is_file():
        config = read_json(folder / "config.json")
        classes = config.get("architectures") or []
        if not classes:
            return None
        return build_module("transformers", classes[0], config, dtype)
    if name_or_path in PUBLIC_MODELS:
        library, class_name, config = PUBLIC_MODELS[name_or_path]
        return build_module(library, class_name, config, dtype)
    return None
