"""FLUX.1 Kontext (``FluxKontextPipeline``), model_type ``flux1-kontext``: image editing.

FLUX.1 with one condition image per sample: the pipeline VAE-encodes the image (the
distribution's mode, so the same image gives the same latents), packs it into 2x2 tokens
like the latents, and appends them to the latents' tokens, with position ids whose first
coordinate is 1 instead of 0; the prediction for the latents' own tokens is kept. Here the
image is encoded once per sample (``encode_conditions``) and ``velocity`` appends its tokens
at every step. Text, guidance embedding, sigmas and decoding are FLUX.1's (flux.py).

Sizes: the pipeline snaps the condition image to one of Kontext's preferred resolutions
(about a megapixel, ``_auto_resize``); here every condition of a split takes one size, so
that samples batch: ``condition_image_size`` (train / eval), or by default the size of the
images generated, as Flow-Factory's Kontext examples set it.
"""

from __future__ import annotations

import torch
from diffusers import FluxKontextPipeline
from torch import Tensor

from ..config.families import MODEL_FAMILIES
from .base import JOINT_ATTENTION_LORA_TARGETS
from .conditioning import ConditionMedia, Conditioning, resized_images
from .flux import FluxAdapter


class FluxKontextAdapter(FluxAdapter):
    model_type = "flux1-kontext"
    pipeline_class = FluxKontextPipeline
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor
    # Flow-Factory's Kontext targets: the joint attention and both streams' feed-forward layers
    default_lora_targets = [*JOINT_ATTENTION_LORA_TARGETS, "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                            "ff_context.net.2"]
    condition_inputs = ("images",)
    conditions_per_sample = (1, 1)

    def prepare_conditions(self, images, videos, height, width, num_frames, condition_size) -> ConditionMedia:
        h, w = condition_size or (height, width)
        self.check_size(h, w)  # the pipeline floors the size to this factor; here an odd size is an error
        return resized_images(self.pipeline.image_processor, images, h, w)

    @torch.no_grad()
    def encode_conditions(self, media: ConditionMedia, height, width, num_frames) -> Conditioning:
        pixels = torch.cat(media.images).to(self.device, self.pipeline.vae.dtype)
        latents = self.pipeline._encode_vae_image(pixels * 2 - 1, generator=None)  # its mode: deterministic
        return {"image_latents": latents}  # unpacked, in the VAE's layout like the sampled latents

    def with_condition_tokens(self, packed: Tensor, ids: Tensor, cond: Conditioning) -> tuple[Tensor, Tensor]:
        pipe = type(self.pipeline)
        image = cond["image_latents"].to(self.device, self.dtype)
        n, c, h, w = image.shape
        image_ids = pipe._prepare_latent_image_ids(n, h // 2, w // 2, self.device, self.dtype)
        image_ids[..., 0] = 1  # as the pipeline: the condition's tokens are told apart by the first coordinate
        return torch.cat([packed, pipe._pack_latents(image, n, c, h, w)], dim=1), torch.cat([ids, image_ids])
