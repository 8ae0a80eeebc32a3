"""Model adapters: one short file per model family, all behind ``FlowAdapter``."""

from .base import ConditionMedia, Conditioning, FlowAdapter, cat_cond, index_cond
from .flux import FluxAdapter
from .flux2 import Flux2Adapter, Flux2KleinAdapter
from .flux_kontext import FluxKontextAdapter
from .hunyuan_video15 import HunyuanVideo15Adapter
from .lora import (
    apply_lora, block_linear_names, load_lora_state, lora_disabled, lora_state_dict, lora_target_names, save_lora,
)
from .ltx2 import LTX2Adapter
from .qwen_image import QwenImageAdapter
from .qwen_image_edit import QwenImageEditPlusAdapter
from .registry import ADAPTERS, get_adapter_class, load_adapter
from .sd3 import SD3Adapter
from .wan import WanT2VAdapter
from .wan_i2v import WanI2VAdapter
from .wan_v2v import WanV2VAdapter
from .z_image import ZImageAdapter

__all__ = [
    "ADAPTERS", "ConditionMedia", "Conditioning", "FlowAdapter", "Flux2Adapter", "Flux2KleinAdapter", "FluxAdapter",
    "FluxKontextAdapter", "HunyuanVideo15Adapter", "LTX2Adapter", "QwenImageAdapter", "QwenImageEditPlusAdapter", "SD3Adapter", "WanI2VAdapter",
    "WanT2VAdapter", "WanV2VAdapter", "ZImageAdapter",
    "apply_lora", "block_linear_names", "cat_cond", "get_adapter_class", "index_cond", "load_adapter", "load_lora_state",
    "lora_disabled", "lora_state_dict", "lora_target_names", "save_lora",
]
