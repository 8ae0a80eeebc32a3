"""What one transformer call reads besides the latents: the conditioning each adapter's ``encode`` (and
``encode_conditions``) would make, as tensors of the right shapes, without running a text encoder.

The shapes are each adapter's: its text length (``max_sequence_length``; SD3 adds CLIP's 77 tokens), the
width its transformer's config takes, the negative branch where ``uses_cfg``, a conditioned model's
latents. tests/test_plan.py checks every family's against its adapter's real ``encode`` on the tiny
pipelines. Models whose prompts keep their own lengths (Qwen-Image, Z-Image, HunyuanVideo-1.5,
Qwen-Image-Edit-Plus) pad them to that length and call the transformer on the real tokens only: the plan
takes them all real (an upper bound) unless told ``text_tokens``: one count for every mask, or a count per
mask key (HunyuanVideo-1.5's ByT5 glyphs, ``prompt_embeds_mask_2``, are a prompt's quoted text only: none
for most prompts, all 256 in the bound). Masks are real tensors with real values,
since those adapters read them (``trim_text``); everything else is zeros.
"""

from __future__ import annotations

import torch

from ..models.base import FlowAdapter
from ..models.conditioning import Conditioning

PADDED_TEXT = ("qwen-image", "qwen-image-edit-plus", "z-image", "z-image-omni", "hunyuanvideo15")


def _mask(n: int, length: int, real: int, dtype=torch.bool) -> torch.Tensor:
    mask = torch.zeros(n, length, dtype=dtype)
    mask[:, :real] = 1
    return mask


def _real(text_tokens: int | dict[str, int] | None, key: str, length: int) -> int:
    """The real tokens of mask ``key`` of ``length``: ``text_tokens``' (its entry for ``key``), or all."""
    tokens = text_tokens.get(key) if isinstance(text_tokens, dict) else text_tokens
    return length if tokens is None else min(tokens, length)


def _text(adapter: FlowAdapter, n: int, text_tokens: int | dict[str, int] | None) -> Conditioning:
    """The positive branch's text conditioning of ``n`` prompts."""
    config, kind = adapter.transformer.config, adapter.model_type
    length = adapter.max_sequence_length
    real = _real(text_tokens, "prompt_embeds_mask", length)
    if kind == "sd3-5":
        return {"prompt_embeds": torch.zeros(n, 77 + length, config.joint_attention_dim),
                "pooled_prompt_embeds": torch.zeros(n, config.pooled_projection_dim)}
    if kind in ("flux1", "flux1-kontext"):
        return {"prompt_embeds": torch.zeros(n, length, config.joint_attention_dim),
                "pooled_prompt_embeds": torch.zeros(n, config.pooled_projection_dim)}
    if kind in ("wan2_t2v", "wan2_i2v", "wan2_v2v"):
        return {"prompt_embeds": torch.zeros(n, length, config.text_dim)}
    if kind in ("flux2", "flux2-klein"):
        return {"prompt_embeds": torch.zeros(n, length, config.joint_attention_dim)}
    if kind in ("qwen-image", "qwen-image-edit-plus"):
        return {"prompt_embeds": torch.zeros(n, length, config.joint_attention_dim),
                "prompt_embeds_mask": _mask(n, length, real)}
    if kind == "z-image":
        return {"prompt_embeds": torch.zeros(n, length, config.cap_feat_dim), "prompt_embeds_mask": _mask(n, length, real)}
    if kind == "z-image-omni":  # padded to the longest prompt; one without condition images is one segment
        return {"prompt_embeds": torch.zeros(n, real, config.cap_feat_dim), "prompt_embeds_mask": _mask(n, real, real),
                "prompt_embeds_segments": torch.full((n, 1), real)}
    if kind == "hunyuanvideo15":
        glyphs = 256  # the pipeline's ByT5 length
        return {"prompt_embeds": torch.zeros(n, length, config.text_embed_dim),
                "prompt_embeds_mask": _mask(n, length, real),
                "prompt_embeds_2": torch.zeros(n, glyphs, config.text_embed_2_dim),
                "prompt_embeds_mask_2": _mask(n, glyphs, _real(text_tokens, "prompt_embeds_mask_2", glyphs))}
    if kind in ("ltx2_t2av", "ltx2_i2av"):
        width = adapter.pipeline.connectors.config.caption_channels  # the connectors' output, both modalities
        return {"prompt_embeds": torch.zeros(n, length, width), "audio_prompt_embeds": torch.zeros(n, length, width),
                "prompt_attention_mask": _mask(n, length, length, torch.int64)}
    raise NotImplementedError(f"the planner knows no conditioning of model_type {kind!r}")


def _conditions(adapter: FlowAdapter, n: int, height: int, width: int, num_frames: int | None,
                condition_size: tuple[int, int] | None) -> Conditioning:
    """A conditioned model's ``encode_conditions`` output for one condition image (or video) per sample."""
    kind = adapter.model_type
    if kind == "flux1-kontext":
        h, w = condition_size or (height, width)
        return {"image_latents": torch.zeros(n, *adapter.latent_shape(h, w))}
    if kind == "wan2_v2v":
        return {"video_latents": torch.zeros(n, *adapter.latent_shape(height, width, num_frames))}
    if kind == "wan2_i2v":
        config = adapter.transformer.config
        shape = adapter.latent_shape(height, width, num_frames)
        cond = {"image_condition": torch.zeros(n, config.in_channels - shape[0], *shape[1:])}
        if config.image_dim is not None:  # Wan2.1's CLIP states: (image_size / patch)^2 + 1 per image
            vision = adapter.pipeline.image_encoder.config
            states = ((vision.image_size // vision.patch_size) ** 2 + 1) * adapter.images_per_sample
            cond["image_embeds"] = torch.zeros(n, states, config.image_dim)
        return cond
    if kind == "ltx2_i2av":  # the first frame's latents, one VAE frame at the video's size (B, C, 1, h, w)
        pipe = adapter.pipeline
        s = pipe.vae_spatial_compression_ratio
        return {"image_latents": torch.zeros(n, pipe.vae.config.latent_channels, 1, height // s, width // s)}
    if kind == "qwen-image-edit-plus":
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus

        w, h = edit_plus.calculate_dimensions(edit_plus.VAE_IMAGE_SIZE, width / height)  # as the pipeline resizes
        c, lh, lw = adapter.latent_shape(h // 16 * 16, w // 16 * 16)
        tokens = (lh // 2) * (lw // 2)
        return {"image_latents": torch.zeros(n, tokens, adapter.transformer.config.in_channels),
                "image_shapes": torch.tensor([[lh // 2, lw // 2]]).expand(n, 1, 2).clone()}
    return {}


def conditioning(adapter: FlowAdapter, n: int, guidance_scale: float, height: int, width: int,
                 num_frames: int | None = None, condition_size: tuple[int, int] | None = None,
                 text_tokens: int | dict[str, int] | None = None) -> Conditioning:
    """The conditioning of ``n`` samples as ``encode`` (with the negative branch where ``uses_cfg``) and
    ``encode_conditions`` give it."""
    cond = _text(adapter, n, text_tokens)
    if adapter.uses_cfg(guidance_scale):
        cond.update({f"negative_{k}": v.clone() for k, v in cond.items()})
    return {**cond, **_conditions(adapter, n, height, width, num_frames, condition_size)}
