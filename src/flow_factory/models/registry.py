"""Adapters by ``model.model_type``: the one place a new model is registered. A ``model_type``
that is a dotted path (``my_package.adapters.MyAdapter``) names a user's own adapter class instead."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

import torch

from ..class_path import import_class
from .base import FlowAdapter

# model_type -> "module:Class"; adding a model is adding its line here. A run imports only its own
# adapter's module (and the diffusers pipeline behind it): each of the others costs seconds and memory.
BUILTIN_ADAPTERS: dict[str, str] = {
    "sd3-5": "flow_factory.models.sd3:SD3Adapter",
    "flux1": "flow_factory.models.flux:FluxAdapter",
    "wan2_t2v": "flow_factory.models.wan:WanT2VAdapter",
    "qwen-image": "flow_factory.models.qwen_image:QwenImageAdapter",
    "z-image": "flow_factory.models.z_image:ZImageAdapter",
    "flux2": "flow_factory.models.flux2:Flux2Adapter",
    "flux2-klein": "flow_factory.models.flux2:Flux2KleinAdapter",
    "hunyuanvideo15": "flow_factory.models.hunyuan_video15:HunyuanVideo15Adapter",
    "ltx2_t2av": "flow_factory.models.ltx2:LTX2Adapter",
    "ltx2_i2av": "flow_factory.models.ltx2_i2av:LTX2I2AVAdapter",
    "flux1-kontext": "flow_factory.models.flux_kontext:FluxKontextAdapter",
    "wan2_i2v": "flow_factory.models.wan_i2v:WanI2VAdapter",
    "wan2_v2v": "flow_factory.models.wan_v2v:WanV2VAdapter",
    "qwen-image-edit-plus": "flow_factory.models.qwen_image_edit:QwenImageEditPlusAdapter",
}


class AdapterTable(MutableMapping):
    """model_type -> adapter class, each imported when first looked up (iterating the values imports all)."""

    def __init__(self, paths: dict[str, str]):
        self._paths: dict[str, str | None] = dict(paths)
        self._classes: dict[str, type[FlowAdapter]] = {}

    def __getitem__(self, model_type: str) -> type[FlowAdapter]:
        if model_type not in self._classes:
            self._classes[model_type] = import_class(self._paths[model_type], "adapter class path")
        return self._classes[model_type]

    def __setitem__(self, model_type: str, cls: type[FlowAdapter]) -> None:
        self._paths[model_type], self._classes[model_type] = None, cls

    def __delitem__(self, model_type: str) -> None:
        del self._paths[model_type]
        self._classes.pop(model_type, None)

    def __contains__(self, model_type) -> bool:
        return model_type in self._paths

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


ADAPTERS = AdapterTable(BUILTIN_ADAPTERS)


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
