"""HunyuanVideo-1.5 text-to-video (``HunyuanVideo15Pipeline``), model_type ``hunyuanvideo15``.

Latents are (B, C, F', H/16, W/16) with F' = (F - 1) / 4 + 1 (C = 32 in the released VAE). The
transformer takes them with C zero channels and one zero mask channel appended (the place of an
image condition, empty in text-to-video) and zero image embeddings, as the pipeline does.

Text: two encoders, each prompt encoded once by the pipeline's ``encode_prompt``: Qwen2.5-VL hidden
states (a chat template, 1000 tokens after its system prompt is cropped) and ByT5 embeddings of the
quoted text in the prompt (256 tokens; all padding when nothing is quoted). The transformer masks
every padding token and the zero image tokens and moves them behind the real ones, so they change
nothing; the conditioning keeps each prompt's real tokens first (``pad_text``) and ``velocity`` cuts
the padding back to the batch's longest prompt and passes no image tokens: the pipeline's result,
without its ~2000 masked tokens a call.

Guidance is the pipeline's guider (``ClassifierFreeGuidance``) at ``guidance_scale``: its formulation,
its ``guidance_rescale`` and whether it is enabled are read from the checkpoint's guider config.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
from diffusers import HunyuanVideo15Pipeline
from diffusers.guiders.guider_utils import rescale_noise_cfg
from torch import Tensor

from ..config.families import MODEL_FAMILIES
from .base import JOINT_ATTENTION_LORA_TARGETS, FlowAdapter
from .conditioning import Conditioning
from .text import pad_text, trim_text
from .vae import decode_image, encode_image

TEXT_KEYS = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")


class HunyuanVideo15Adapter(FlowAdapter):
    model_type = "hunyuanvideo15"
    pipeline_class = HunyuanVideo15Pipeline
    is_video = True
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor
    # the dual-stream blocks' joint attention (the text refiner's self-attention shares the to_q / to_k /
    # to_v / to_out.0 names and is included)
    default_lora_targets = JOINT_ATTENTION_LORA_TARGETS
    # Qwen2.5-VL tokens after the system prompt, the pipeline's tokenizer_max_length (in the prompt cache's
    # fingerprint; the pipeline sets the length)
    max_sequence_length = 1000

    def __init__(self, pipeline, device="cpu", dtype: torch.dtype = torch.float32):
        problem = self.unsupported(pipeline.config)
        window = None if problem else (pipeline.guider.config.start, pipeline.guider.config.stop)
        if window not in (None, (0.0, 1.0)):
            problem = (f"hunyuanvideo15: the checkpoint's guider applies CFG only from step fraction {window[0]} to "
                       f"{window[1]}; a rollout step is known by its sigma, not its index, so only 0 to 1 is supported")
        if problem:
            raise ValueError(problem)
        super().__init__(pipeline, device, dtype)

    @staticmethod
    def unsupported(model_index: Mapping) -> str | None:
        guider = (model_index.get("guider") or (None, None))[1]
        if guider != "ClassifierFreeGuidance":
            return f"hunyuanvideo15 follows the ClassifierFreeGuidance guider; this checkpoint's guider is {guider}"
        return None

    @staticmethod
    def pixel_factor_of(vae: Mapping, transformer: Mapping) -> int | None:
        # as the pipeline: the VAE's spatial factor, then the transformer's patches
        if "spatial_compression_ratio" not in vae or "patch_size" not in transformer:
            return None
        return vae["spatial_compression_ratio"] * transformer["patch_size"]

    def uses_cfg(self, guidance_scale: float) -> bool:
        # ClassifierFreeGuidance runs the negative branch unless the scale makes it a no-op
        guider = self.pipeline.guider.config
        return guider.enabled and not math.isclose(guidance_scale, 0.0 if guider.use_original_formulation else 1.0)

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None = None,
               guidance_scale: float = 6.0) -> Conditioning:
        cond = self._encode_text(prompts)
        if self.uses_cfg(guidance_scale):  # the pipeline's negative prompt defaults to ""
            negatives = negative_prompts if negative_prompts is not None else [""] * len(prompts)
            cond.update({f"negative_{k}": v for k, v in self._encode_text(negatives).items()})
        return cond

    def _encode_text(self, prompts: list[str]) -> Conditioning:
        text, text_mask, glyphs, glyph_mask = self.pipeline.encode_prompt(
            prompt=list(prompts), device=self.device, batch_size=len(prompts))
        # each prompt's real tokens first, whatever side its tokenizer pads
        values = [v for embeds, mask in ((text, text_mask), (glyphs, glyph_mask))
                  for v in pad_text([e[m.bool()] for e, m in zip(embeds, mask)], embeds.shape[1])]
        return dict(zip(TEXT_KEYS, values))

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        temporal = self.pipeline.vae_scale_factor_temporal
        if num_frames is None or (num_frames - 1) % temporal:
            raise ValueError(f"hunyuanvideo15 is a video model: num_frames must be 1 + a multiple of {temporal} "
                             f"(e.g. 5, 61, 121), got {num_frames}")
        self.check_size(height, width)
        s = self.pipeline.vae_scale_factor_spatial
        return (self.pipeline.vae.config.latent_channels, (num_frames - 1) // temporal + 1, height // s, width // s)

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> Tensor:
        scheduler = type(self.pipeline.scheduler).from_config(self.pipeline.scheduler.config)
        # the pipeline's grid, shifted by its scheduler
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, num_steps + 1)[:-1], device="cpu")
        return scheduler.sigmas.float().to(self.device)

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        n = latents.shape[0]
        x = latents.to(self.device, self.dtype)
        x = torch.cat([x, torch.zeros_like(x), torch.zeros_like(x[:, :1])], dim=1)  # no image condition
        t = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(n) * 1000
        # the pipeline calls the transformer once per branch; one call on [uncond, cond] is the same arithmetic
        # per sample, and one forward per backward is what DDP needs
        cfg, x, t, (text, text_mask, glyphs, glyph_mask) = self.cfg_inputs(cond, guidance_scale, x, t, TEXT_KEYS)
        text, text_mask = trim_text(text.to(self.device, self.dtype), text_mask.to(self.device))
        glyphs, glyph_mask = trim_text(glyphs.to(self.device, self.dtype), glyph_mask.to(self.device))
        out = self.denoiser(
            hidden_states=x, timestep=t.to(self.dtype),
            encoder_hidden_states=text, encoder_attention_mask=text_mask.to(self.dtype),
            encoder_hidden_states_2=glyphs, encoder_attention_mask_2=glyph_mask.to(self.dtype),
            image_embeds=x.new_zeros(len(x), 0, self.transformer.config.image_embed_dim),
            return_dict=False,
        )[0].float()
        if not cfg:
            return out
        uncond, text_pred = out.chunk(2)
        guider = self.pipeline.guider.config  # ClassifierFreeGuidance.forward's arithmetic
        out = (text_pred if guider.use_original_formulation else uncond) + guidance_scale * (text_pred - uncond)
        return rescale_noise_cfg(out, text_pred, guider.guidance_rescale) if guider.guidance_rescale > 0 else out

    def decode(self, latents: Tensor) -> Tensor:
        # one video at a time: the VAE's causal attention breaks on a batch (diffusers 0.42, the pipeline's
        # vae.enable_slicing() does the same)
        videos = torch.cat([decode_image(self.pipeline.vae, z[None], self.device) for z in latents])
        return videos.permute(0, 2, 1, 3, 4)

    def encode_media(self, media: Tensor) -> Tensor:
        # one video at a time, as decode
        return torch.cat([encode_image(self.pipeline.vae, v[None], self.device) for v in media.permute(0, 2, 1, 3, 4)])
