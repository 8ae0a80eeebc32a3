"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``), model_type ``sd3-5``.

Everything model-specific is delegated to the pipeline itself (its
``encode_prompt``, its scheduler's ``set_timesteps``, its VAE factors), so an
ODE rollout through this adapter reproduces ``pipeline(...)`` step for step.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from diffusers import StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift
from torch import Tensor

from ..config.families import MODEL_FAMILIES
from .base import JOINT_ATTENTION_LORA_TARGETS, FlowAdapter
from .conditioning import Conditioning
from .vae import decode_image, encode_image


class SD3Adapter(FlowAdapter):
    model_type = "sd3-5"
    pipeline_class = StableDiffusion3Pipeline
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor
    default_lora_targets = JOINT_ATTENTION_LORA_TARGETS  # flow_grpo's SD3 targets
    max_sequence_length = 256  # T5 tokens, the pipeline's default
    # its last joint block returns no text stream, which FirstBlockCache and MagCache read; FasterCache's
    # attention hook does not take SD3's shapes
    cache_policies = ("pyramid", "taylorseer")

    @property
    def text_length(self) -> int:
        """T5 tokens per prompt: 256, or the T5 tokenizer's ``model_max_length`` if that is shorter.

        SD3's own T5 tokenizer declares 512, so real checkpoints keep the pipeline's default 256;
        a small pipeline whose saved tokenizer declares fewer (ShapeBench's: 16) is encoded at
        that length, as ``pipeline(..., max_sequence_length=tokenizer_3.model_max_length)`` does.
        """
        limit = getattr(getattr(self.pipeline, "tokenizer_3", None), "model_max_length", None)
        return min(self.max_sequence_length, int(limit)) if limit else self.max_sequence_length

    @staticmethod
    def pixel_factor_of(vae: Mapping, transformer: Mapping) -> int | None:
        # as StableDiffusion3Pipeline: the VAE halves the size at each block after the first, then the
        # transformer cuts the latents into patch_size x patch_size patches, so pixels divide by both
        if "block_out_channels" not in vae or "patch_size" not in transformer:
            return None
        return 2 ** (len(vae["block_out_channels"]) - 1) * transformer["patch_size"]

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None = None,
               guidance_scale: float = 1.0) -> Conditioning:
        cfg = guidance_scale > 1
        if negative_prompts is None:
            negative_prompts = [""] * len(prompts)
        pos, neg, pooled, neg_pooled = self.pipeline.encode_prompt(
            prompt=list(prompts), prompt_2=None, prompt_3=None, device=self.device,
            num_images_per_prompt=1, do_classifier_free_guidance=cfg,
            negative_prompt=list(negative_prompts) if cfg else None,
            max_sequence_length=self.text_length,
        )
        cond = {"prompt_embeds": pos, "pooled_prompt_embeds": pooled}
        if cfg:
            cond.update(negative_prompt_embeds=neg, negative_pooled_prompt_embeds=neg_pooled)
        return cond

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> Tensor:
        # a fresh scheduler from the same config: the pipeline's own keeps its state untouched
        scheduler = type(self.pipeline.scheduler).from_config(self.pipeline.scheduler.config)
        config = scheduler.config
        kwargs = {}
        if config.get("use_dynamic_shifting", False):
            _, h, w = self.latent_shape(height, width)
            patch = self.transformer.config.patch_size
            kwargs["mu"] = calculate_shift(
                (h // patch) * (w // patch),
                config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5), config.get("max_shift", 1.16),
            )
        scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
        return scheduler.sigmas.float().to(self.device)

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        n = latents.shape[0]
        x = latents.to(self.device, self.dtype)
        # a scalar sigma or one per sample; the model is trained on t = 1000 sigma
        t = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(n) * 1000
        cfg, x, t, (emb, pooled) = self.cfg_inputs(cond, guidance_scale, x, t,
                                                   ("prompt_embeds", "pooled_prompt_embeds"))
        out = self.denoiser(
            hidden_states=x, timestep=t, encoder_hidden_states=emb.to(self.device, self.dtype),
            pooled_projections=pooled.to(self.device, self.dtype), return_dict=False,
        )[0].float()
        return self.combine_cfg(out, guidance_scale) if cfg else out

    def decode(self, latents: Tensor) -> Tensor:
        return decode_image(self.pipeline.vae, latents, self.device)

    def encode_media(self, media: Tensor) -> Tensor:
        return encode_image(self.pipeline.vae, media, self.device)
