"""FLUX.1 (``FluxPipeline``), model_type ``flux1``.

FLUX.1-dev is guidance-distilled: ``guidance_scale`` is fed to the transformer
as an embedding, with one forward pass and no negative branch. Latents stay in
the VAE layout (B, 16, H/8, W/8) everywhere outside this file; ``velocity``
packs them into 2x2 tokens and unpacks the prediction with the pipeline's own
static helpers, so the packing can never drift from diffusers'.
"""

from __future__ import annotations


import numpy as np
import torch
from diffusers import FluxPipeline
from torch import Tensor

from ..config.families import MODEL_FAMILIES
from .base import JOINT_ATTENTION_LORA_TARGETS, FlowAdapter
from .conditioning import Conditioning
from .schedule import shifted_sigmas
from .vae import decode_image, encode_image, packed_2x2_pixel_factor


class FluxAdapter(FlowAdapter):
    model_type = "flux1"
    pipeline_class = FluxPipeline
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor
    default_lora_targets = JOINT_ATTENTION_LORA_TARGETS
    max_sequence_length = 512  # T5 tokens, the pipeline's default
    latents_per_token = 4  # the pipeline packs 2x2 latents into one token

    # the transformer's own patch_size is 1: the pipeline packs 2x2 latents into one token
    pixel_factor_of = staticmethod(packed_2x2_pixel_factor)

    def uses_cfg(self, guidance_scale: float) -> bool:
        return False  # FLUX.1-dev's guidance is an embedding: no negative branch

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None = None,
               guidance_scale: float = 3.5) -> Conditioning:
        # negative prompts have no effect: the guidance is distilled into the embedding
        embeds, pooled, _text_ids = self.pipeline.encode_prompt(
            prompt=list(prompts), prompt_2=None, device=self.device, num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> Tensor:
        # as FluxPipeline: a linear grid ending at 1/n, shifted by mu, which grows with the
        # number of image tokens (resolution-dependent shift)
        flow_sigmas = self.pipeline.scheduler.config.get("use_flow_sigmas", False)
        grid = None if flow_sigmas else np.linspace(1.0, 1 / num_steps, num_steps)
        tokens = (height // self.loaded_pixel_factor) * (width // self.loaded_pixel_factor)
        return shifted_sigmas(self.pipeline, num_steps, tokens, grid, self.device)

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        pipe = type(self.pipeline)
        n, c, h, w = latents.shape
        packed = pipe._pack_latents(latents.to(self.device, self.dtype), n, c, h, w)
        image_ids = pipe._prepare_latent_image_ids(n, h // 2, w // 2, self.device, self.dtype)
        tokens, token_ids = self.with_condition_tokens(packed, image_ids, cond)
        embeds = cond["prompt_embeds"].to(self.device, self.dtype)
        text_ids = torch.zeros(embeds.shape[1], 3, device=self.device, dtype=self.dtype)
        t = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(n) * 1000
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((n,), float(guidance_scale), device=self.device, dtype=torch.float32)
        out = self.denoiser(
            hidden_states=tokens,
            # the pipeline's round trip 1000 sigma / 1000, kept so the result is bit-identical
            timestep=t.to(self.dtype) / 1000,
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"].to(self.device, self.dtype),
            encoder_hidden_states=embeds,
            txt_ids=text_ids,
            img_ids=token_ids,
            return_dict=False,
        )[0][:, :packed.shape[1]]  # the prediction for the latents' own tokens
        s = self.pipeline.vae_scale_factor
        return pipe._unpack_latents(out, h * s, w * s, s).float()

    def with_condition_tokens(self, packed: Tensor, ids: Tensor, cond: Conditioning) -> tuple[Tensor, Tensor]:
        """The transformer's image tokens and their position ids: FLUX.1's latents alone; FLUX.1 Kontext
        appends its condition image's (flux_kontext.py)."""
        return packed, ids

    def decode(self, latents: Tensor) -> Tensor:
        return decode_image(self.pipeline.vae, latents, self.device)

    def encode_media(self, media: Tensor) -> Tensor:
        return encode_image(self.pipeline.vae, media, self.device)
