"""Adapters by ``model.model_type``: the one place a new model is registered. A ``model_type``
that is a dotted path (``my_package.adapters.MyAdapter``) names a user's own adapter class instead."""

from __future__ import annotations

import torch

from ..class_path import import_class
from .base import FlowAdapter
from .flux import FluxAdapter
from .flux2 import Flux2Adapter, Flux2KleinAdapter
from .flux_kontext import FluxKontextAdapter
from .hunyuan_video15 import HunyuanVideo15Adapter
from .ltx2 import LTX2Adapter
from .qwen_image import QwenImageAdapter
from .qwen_image_edit import QwenImageEditPlusAdapter
from .sd3 import SD3Adapter
from .wan import WanT2VAdapter
from .wan_i2v import WanI2VAdapter
from .wan_v2v import WanV2VAdapter
from .z_image import ZImageAdapter

ADAPTERS: dict[str, type[FlowAdapter]] = {cls.model_type: cls for cls in (
    SD3Adapter, FluxAdapter, WanT2VAdapter,
    QwenImageAdapter, ZImageAdapter,
    Flux2Adapter, Flux2KleinAdapter,
    HunyuanVideo15Adapter, LTX2Adapter, FluxKontextAdapter, WanI2VAdapter, WanV2VAdapter,
    QwenImageEditPlusAdapter,
)}


def get_adapter_class(model_type: str) -> type[FlowAdapter]:
    if model_type in ADAPTERS:
        return ADAPTERS[model_type]
    if "." not in model_type and ":" not in model_type:
        raise ValueError(f"model.model_type: unknown {model_type!r}; valid: {sorted(ADAPTERS)}, or the dotted path "
                         "of a FlowAdapter subclass")
    try:
        cls = import_class(model_type, "adapter class path")
    except (ImportError, ValueError) as e:
        raise ValueError(f"model.model_type: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, FlowAdapter)):
        raise ValueError(f"model.model_type: {model_type!r} is {cls!r}, not a subclass of FlowAdapter")
    return cls


def load_adapter(model_type: str, path, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> FlowAdapter:
    """Load the diffusers pipeline at ``path`` (a local folder or hub id) behind its adapter."""
    return get_adapter_class(model_type).from_pretrained(str(path), device=device, dtype=dtype)


def model_type_for_pipeline(class_name: str) -> str | None:
    """The ``model_type`` whose adapter loads a pipeline of ``class_name`` (model_index.json's
    ``_class_name``), or None when no adapter does."""
    return next((name for name, cls in ADAPTERS.items() if cls.pipeline_class.__name__ == class_name), None)
