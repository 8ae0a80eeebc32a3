"""Wan2.1 video-to-video (``WanVideoToVideoPipeline``), model_type ``wan2_v2v``.

Text-to-video's adapter (wan.py) that starts from a condition video instead of pure noise, as
the pipeline does: the video is VAE-encoded (the distribution's mode, normalised), its
schedule keeps the last ``strength`` part of the steps (``int(num_steps x strength)`` of them),
and the rollout starts at sigmas[0] from ``sigma x noise + (1 - sigma) x video latents`` (the
scheduler's ``scale_noise``; ``start_latents``). The transformer sees only the latents.

The condition video is resized to the video generated and cut to its first ``num_frames``
frames (a shorter one is an error); ``condition_image_size`` does not apply. Videos are read
as data/media.py reads them (mp4, webm, ... through PyAV; animated GIF, WebP, PNG through Pillow).
"""

from __future__ import annotations

import torch
from diffusers import WanVideoToVideoPipeline
from diffusers.pipelines.wan.pipeline_wan_video2video import retrieve_latents
from torch import Tensor

from ..config.families import MODEL_FAMILIES
from ..config.sections import DEFAULT_STRENGTH, strength_steps
from .conditioning import ConditionMedia, Conditioning, as_pil, resized_images
from .wan import WanT2VAdapter


class WanV2VAdapter(WanT2VAdapter):
    model_type = "wan2_v2v"
    pipeline_class = WanVideoToVideoPipeline
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor
    transformer_names = ("transformer",)
    condition_inputs = ("videos",)
    conditions_per_sample = (1, 1)
    # how much of the condition video is noised and regenerated (the pipeline's default; train / eval.strength)
    strength: float = DEFAULT_STRENGTH

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> Tensor:
        # as the pipeline's get_timesteps: the last int(num_steps x strength) steps of the full schedule
        kept = strength_steps(num_steps, self.strength)
        if kept == 0:
            raise ValueError(f"wan2_v2v: strength {self.strength} keeps none of {num_steps} steps")
        return super().sigmas(num_steps, height, width, num_frames)[num_steps - kept:]

    def prepare_conditions(self, images, videos, height, width, num_frames, condition_size) -> ConditionMedia:
        if condition_size not in (None, (height, width)):
            raise ValueError("wan2_v2v: the condition video is resized to the video generated; condition_image_size "
                             f"{condition_size} does not apply (leave it null)")
        short = [len(sample[0]) for sample in videos if len(sample[0]) < num_frames]
        if short:
            raise ValueError(f"wan2_v2v: a condition video has {short[0]} frames; num_frames is {num_frames}")
        frames = [sample[0][:num_frames] for sample in videos]
        resized = resized_images(self.pipeline.video_processor, frames, height, width).images  # (F, 3, H, W) each
        return ConditionMedia(videos=[video[None] for video in resized])

    @torch.no_grad()
    def encode_conditions(self, media: ConditionMedia, height, width, num_frames) -> Conditioning:
        pipe, vae = self.pipeline, self.pipeline.vae
        frames = [as_pil(sample[0]) for sample in media.videos]  # the pipeline's input: 8-bit frames
        video = pipe.video_processor.preprocess_video(frames, height=height, width=width).to(self.device, vae.dtype)
        # the pipeline's prepare_latents: each video encoded alone, its mode, normalised per channel
        latents = torch.cat([retrieve_latents(vae.encode(v[None]), sample_mode="argmax") for v in video]).float()
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents)
        return {"video_latents": (latents - mean) * inv_std}

    def start_latents(self, noise: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor:
        video = cond["video_latents"].to(noise.device, noise.dtype)
        return sigma * noise + (1.0 - sigma) * video
