"""Model adapters: one short file per model family, all behind ``FlowAdapter``.

The adapter classes (``SD3Adapter``, ...) are imported from here on first use, as the registry does:
importing this package loads no diffusers pipeline.
"""

from .base import FlowAdapter
from .conditioning import ConditionMedia, Conditioning, cat_cond, index_cond
from .lora import (
    apply_lora, block_linear_names, load_lora_state, lora_disabled, lora_state_dict, lora_target_names, save_lora,
)
from .registry import ADAPTERS, BUILTIN_ADAPTERS, get_adapter_class, load_adapter

# class name -> model_type, for ``from flow_factory.models import SD3Adapter``
_ADAPTER_NAMES = {path.rpartition(":")[2]: model_type for model_type, path in BUILTIN_ADAPTERS.items()}


def __getattr__(name: str):
    if name in _ADAPTER_NAMES:
        return ADAPTERS[_ADAPTER_NAMES[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ADAPTERS", "ConditionMedia", "Conditioning", "FlowAdapter", *_ADAPTER_NAMES,
    "apply_lora", "block_linear_names", "cat_cond", "get_adapter_class", "index_cond", "load_adapter", "load_lora_state",
    "lora_disabled", "lora_state_dict", "lora_target_names", "save_lora",
]
