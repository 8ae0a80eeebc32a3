"""Wan2.1 and Wan2.2 image-to-video (``WanImageToVideoPipeline``), model_type ``wan2_i2v``.

Text-to-video's adapter (wan.py: text, sigmas, the two experts of Wan2.2 A14B with
``guidance_scale_2``, decoding) with one condition image per sample, the video's first frame.
As the pipeline does, the image is VAE-encoded as a video (the image, then black frames), and
a 4-channel mask marks the first frame as given: these 20 channels are concatenated to the 16
of the noisy latents at every step (the transformer's ``in_channels`` 36). Wan2.1 also feeds
its CLIP image encoder's penultimate states to the transformer's image attention; Wan2.2 I2V
has no image encoder. Both are computed once per sample (``encode_conditions``).

First-last-frame-to-video (Wan2.1 FLF2V, whose transformer sets ``pos_embed_seq_len``): each
sample takes two images, the first frame and the last (the pipeline's ``image`` and
``last_image``). The VAE condition is the first image, black frames, then the last image, its
mask marking both ends as given; the CLIP encoder sees both, and the transformer reads the two
images' states as one sequence under its position embedding. Such a checkpoint needs both
images (its position embedding covers two), any other Wan I2V checkpoint takes the first alone:
``checkpoint_conditions``.

Sizes: the condition is given to the model as ``condition_image_size`` (default: the size
generated), which the CLIP encoder sees; the VAE sees it resized to the video's size, as the
pipeline resizes its ``image``. So the rollout equals ``pipeline(image=<the condition at that
size>, last_image=<the second, if any>)``. Wan2.2 TI2V-5B's image-to-video (``expand_timesteps``: the first latent frame
replaced by the image's instead of concatenated) is not supported.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from diffusers import WanImageToVideoPipeline
from torch import Tensor

from ..config.families import MODEL_FAMILIES
from .conditioning import ConditionMedia, Conditioning, as_pil, resized_images
from .wan import WanT2VAdapter


class WanI2VAdapter(WanT2VAdapter):
    model_type = "wan2_i2v"
    pipeline_class = WanImageToVideoPipeline
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor
    transformer_names = MODEL_FAMILIES[model_type].components
    condition_inputs = ("images",)
    conditions_per_sample = (1, 2)  # the first frame, and the last with a first-last-frame checkpoint

    def __init__(self, pipeline, device="cpu", dtype: torch.dtype = torch.float32):
        super().__init__(pipeline, device, dtype)
        if pipeline.transformer.config.image_dim is not None and pipeline.image_encoder is None:
            raise ValueError("wan2_i2v: this transformer takes CLIP image states (image_dim is set; Wan2.1 I2V) but "
                             "the pipeline has no image_encoder")
        (_, self.images_per_sample), self._conditions_note = self.checkpoint_conditions(pipeline.transformer.config)

    @classmethod
    def checkpoint_conditions(cls, transformer_config: Mapping | None) -> tuple[tuple[int, int], str]:
        if transformer_config is None:
            return cls.conditions_per_sample, ""
        if transformer_config.get("pos_embed_seq_len"):
            return (2, 2), ("; this checkpoint generates between a first and a last frame (its transformer sets "
                            "pos_embed_seq_len: Wan2.1 FLF2V), so each row names both, first then last")
        return (1, 1), ("; this checkpoint generates from a first frame: a last frame too needs a first-last-frame "
                        "checkpoint (Wan2.1 FLF2V, whose transformer sets pos_embed_seq_len)")

    @classmethod
    def unsupported(cls, model_index: Mapping) -> str | None:
        if model_index.get("expand_timesteps"):
            return ("wan2_i2v: this checkpoint generates from an image by replacing the first latent frame "
                    "(expand_timesteps, Wan2.2 TI2V-5B), which is not supported; Wan2.1 I2V and Wan2.2 I2V A14B are")
        return super().unsupported(model_index)

    def prepare_conditions(self, images, videos, height, width, num_frames, condition_size) -> ConditionMedia:
        wrong = [len(sample) for sample in images if len(sample) != self.images_per_sample]
        if wrong:  # rows are checked against the checkpoint before it loads; a hub id's only now
            raise ValueError(f"wan2_i2v: a sample has {wrong[0]} condition images, this checkpoint takes "
                             f"{self.images_per_sample}{self._conditions_note}")
        h, w = condition_size or (height, width)
        return resized_images(self.pipeline.video_processor, images, h, w)

    @torch.no_grad()
    def encode_conditions(self, media: ConditionMedia, height, width, num_frames) -> Conditioning:
        pipe, channels = self.pipeline, self.pipeline.vae.config.z_dim
        samples = [as_pil(sample) for sample in media.images]  # the pipeline's input: 8-bit images, first[, last]
        cond = {}
        if pipe.transformer.config.image_dim is not None:  # Wan2.1: CLIP states for the image attention
            states = pipe.encode_image([image for sample in samples for image in sample], self.device)
            # (B, tokens, dim): a sample's images' states one after another, as the transformer joins them
            cond["image_embeds"] = states.reshape(len(samples), -1, states.shape[-1])
        unused_noise = torch.zeros(1, *self.latent_shape(height, width, num_frames))
        conditions = []
        # one sample at a time: given a batch, prepare_latents would repeat the whole batch's encoding per sample
        for sample in samples:
            pixels = [pipe.video_processor.preprocess(image, height=height, width=width).to(self.device, torch.float32)
                      for image in sample]
            _, condition = pipe.prepare_latents(pixels[0], 1, channels, height, width, num_frames, torch.float32,
                                                self.device, latents=unused_noise,
                                                last_image=pixels[1] if len(pixels) > 1 else None)
            conditions.append(condition)  # (1, 4 mask + C latent channels, F', h, w)
        return {**cond, "image_condition": torch.cat(conditions)}

    def with_condition(self, x: Tensor, cond: Conditioning, copies: int) -> tuple[Tensor, dict]:
        condition = cond["image_condition"].to(self.device, self.dtype).repeat(copies, 1, 1, 1, 1)
        x = torch.cat([x, condition], dim=1)
        if "image_embeds" not in cond:
            return x, {}
        states = cond["image_embeds"].to(self.device, self.dtype).repeat(copies, 1, 1)
        # the transformer takes a row per image (the pipeline's encode_image) and joins a sample's two itself
        return x, {"encoder_hidden_states_image": states.reshape(-1, states.shape[1] // self.images_per_sample,
                                                                 states.shape[2])}
