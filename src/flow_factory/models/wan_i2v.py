"""Wan2.1 and Wan2.2 image-to-video (``WanImageToVideoPipeline``), model_type ``wan2_i2v``.

Text-to-video's adapter (wan.py: text, sigmas, the two experts of Wan2.2 A14B with
``guidance_scale_2``, decoding) with one condition image per sample, the video's first frame.
As the pipeline does, the image is VAE-encoded as a video (the image, then black frames), and
a 4-channel mask marks the first frame as given: these 20 channels are concatenated to the 16
of the noisy latents at every step (the transformer's ``in_channels`` 36). Wan2.1 also feeds
its CLIP image encoder's penultimate states to the transformer's image attention; Wan2.2 I2V
has no image encoder. Both are computed once per sample (``encode_conditions``).

Sizes: the condition is given to the model as ``condition_image_size`` (default: the size
generated), which the CLIP encoder sees; the VAE sees it resized to the video's size, as the
pipeline resizes its ``image``. So the rollout equals ``pipeline(image=<the condition at that
size>)``. Wan2.2 TI2V-5B's image-to-video (``expand_timesteps``: the first latent frame
replaced by the image's instead of concatenated) is not supported.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from diffusers import WanImageToVideoPipeline
from torch import Tensor

from ..config.sections import MODEL_FAMILIES
from .base import ConditionMedia, Conditioning, as_pil, resized_images
from .wan import WanT2VAdapter


class WanI2VAdapter(WanT2VAdapter):
    model_type = "wan2_i2v"
    pipeline_class = WanImageToVideoPipeline
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor
    transformer_names = MODEL_FAMILIES[model_type].components
    condition_inputs = ("images",)
    conditions_per_sample = (1, 1)

    def __init__(self, pipeline, device="cpu", dtype: torch.dtype = torch.float32):
        super().__init__(pipeline, device, dtype)
        if pipeline.transformer.config.image_dim is not None and pipeline.image_encoder is None:
            raise ValueError("wan2_i2v: this transformer takes CLIP image states (image_dim is set; Wan2.1 I2V) but "
                             "the pipeline has no image_encoder")

    @classmethod
    def unsupported(cls, model_index: Mapping) -> str | None:
        if model_index.get("expand_timesteps"):
            return ("wan2_i2v: this checkpoint generates from an image by replacing the first latent frame "
                    "(expand_timesteps, Wan2.2 TI2V-5B), which is not supported; Wan2.1 I2V and Wan2.2 I2V A14B are")
        return super().unsupported(model_index)

    def prepare_conditions(self, images, videos, height, width, num_frames, condition_size) -> ConditionMedia:
        h, w = condition_size or (height, width)
        return resized_images(self.pipeline.video_processor, images, h, w)

    @torch.no_grad()
    def encode_conditions(self, media: ConditionMedia, height, width, num_frames) -> Conditioning:
        pipe, channels = self.pipeline, self.pipeline.vae.config.z_dim
        images = [as_pil(sample)[0] for sample in media.images]  # the pipeline's input: 8-bit images
        cond = {}
        if pipe.transformer.config.image_dim is not None:  # Wan2.1: CLIP states for the image attention
            cond["image_embeds"] = pipe.encode_image(images, self.device)
        unused_noise = torch.zeros(1, *self.latent_shape(height, width, num_frames))
        conditions = []
        # one image at a time: given a batch, prepare_latents would repeat the whole batch's encoding per sample
        for image in images:
            pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(self.device, torch.float32)
            _, condition = pipe.prepare_latents(pixels, 1, channels, height, width, num_frames, torch.float32,
                                                self.device, latents=unused_noise)
            conditions.append(condition)  # (1, 4 mask + C latent channels, F', h, w)
        return {**cond, "image_condition": torch.cat(conditions)}

    def with_condition(self, x: Tensor, cond: Conditioning, copies: int) -> tuple[Tensor, dict]:
        condition = cond["image_condition"].to(self.device, self.dtype).repeat(copies, 1, 1, 1, 1)
        x = torch.cat([x, condition], dim=1)
        if "image_embeds" not in cond:
            return x, {}
        return x, {"encoder_hidden_states_image": cond["image_embeds"].to(self.device, self.dtype).repeat(copies, 1, 1)}
