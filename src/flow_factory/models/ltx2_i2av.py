"""LTX-2 image to video with audio (``LTX2ImageToVideoPipeline``), model_type ``ltx2_i2av``.

Text-to-audio-video's adapter (ltx2.py: text, the flat video-then-audio latent, sigmas, decoding, the
audio on the ODE) with one condition image per sample, the video's first frame. As the pipeline
conditions on it:

- the image is re-compressed as one H.264 frame at the CRF the model was trained with (the
  pipeline's default ``image_crf``: 33 with LTX-2's Gemma 3 text encoder, 18 with Gemma 4's),
  resized to the video's size and VAE-encoded (the distribution's mode) into one latent frame,
  normalised as the pipeline normalises it (``encode_conditions``, once per sample);
- the rollout starts from those latents in the first latent frame's tokens and the noise in the
  others (``start_latents``: the pipeline's ``init_latents * mask + noise * (1 - mask)``);
- at every step the transformer sees timestep 0 on the first frame's tokens (``timestep * (1 -
  conditioning_mask)``), the audio and the cross-modal modulation the step's own
  (``use_cross_timestep``), and the step leaves the first frame where it is: the pipeline steps
  frames 1: only, here the velocity there is 0 and the SDE's noise reaches neither it nor the
  audio (``explored``), so a step's log-probability is that of the generated frames. ``velocity``
  puts the image in the first frame of whatever it is given, so the decoupled algorithms, which
  noise a rollout's whole final latent, show the transformer the frame it was conditioned on; their losses
  average over the generated elements only (``generated``: the other frames and the audio), as the frame's
  error there, a velocity of 0 against ``eps - x0``, is no prediction of the model's.

The audio is not conditioned on the image. The ODE rollout equals ``LTX2ImageToVideoPipeline(image=...,
stg_scale=0, modality_scale=1, guidance_rescale=0)`` for the same noise (its generator's draws: the
video's, then the audio's). ``condition_image_size`` has no effect, as in Flow-Factory: the first
frame is encoded at the video's size.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import LTX2ImageToVideoPipeline
from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf
from PIL import Image
from torch import Tensor

from ..config.families import MODEL_FAMILIES
from .conditioning import ConditionMedia, Conditioning, resized_images
from .ltx2 import Geometry, LTX2Adapter


class LTX2I2AVAdapter(LTX2Adapter):
    model_type = "ltx2_i2av"
    pipeline_class = LTX2ImageToVideoPipeline
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor
    condition_inputs = ("images",)
    conditions_per_sample = (1, 1)  # the first frame

    def __init__(self, pipeline, device="cpu", dtype: torch.dtype = torch.float32):
        super().__init__(pipeline, device, dtype)
        # read now: the text encoder is released once the prompt cache holds every prompt
        self.image_crf = resolve_default_image_crf(pipeline.text_encoder)

    def prepare_conditions(self, images, videos, height, width, num_frames, condition_size) -> ConditionMedia:
        # re-compressed at full size, then resized to the video's, as the pipeline does (condition_size: no effect)
        if self.image_crf:
            images = [[Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), self.image_crf))
                       for image in sample] for sample in images]
        return resized_images(self.pipeline.video_processor, images, height, width)

    @torch.no_grad()
    def encode_conditions(self, media: ConditionMedia, height, width, num_frames) -> Conditioning:
        pipe, vae = self.pipeline, self.pipeline.vae
        latents = []
        for sample in media.images:  # one image a call, as the pipeline encodes them: (1, 3, 1, H, W)
            pixels = (sample[:1] * 2 - 1).to(self.device, vae.dtype).unsqueeze(2)
            latents.append(vae.encode(pixels).latent_dist.mode())
        # normalised without the VAE's scaling factor, as the pipeline normalises its image's latents
        return {"image_latents": pipe._normalize_latents(torch.cat(latents).float(), vae.latents_mean,
                                                         vae.latents_std)}  # (B, C, 1, h, w)

    def given_tokens(self, g: Geometry) -> Tensor:
        """The pipeline's conditioning mask, (video tokens,) float: 1 on the first latent frame's tokens."""
        mask = torch.zeros(1, 1, g.frames, g.height, g.width)
        mask[:, :, 0] = 1.0
        pipe = self.pipeline
        return pipe._pack_latents(mask, pipe.transformer_spatial_patch_size,
                                  pipe.transformer_temporal_patch_size).squeeze(-1)[0]

    def given(self, g: Geometry) -> Tensor:
        """The latent's elements of the first frame, (numel,) bool: the image's, never stepped."""
        tokens = self.given_tokens(g).bool().repeat_interleave(g.video_tokens[1])
        return torch.cat([tokens, torch.zeros(g.numel - g.video_numel, dtype=torch.bool)])

    def generated(self, latents: Tensor) -> Tensor:
        return ~self.given(self.geometry(latents))

    def explored(self, g: Geometry) -> Tensor:
        return super().explored(g) & ~self.given(g)

    def start_latents(self, noise: Tensor, sigma: Tensor, cond: Conditioning) -> Tensor:
        g, pipe = self.geometry(noise), self.pipeline
        image = cond["image_latents"].to(noise.device, torch.float32).repeat(1, 1, g.frames, 1, 1)
        video = pipe._pack_latents(image, pipe.transformer_spatial_patch_size,
                                   pipe.transformer_temporal_patch_size).flatten(1)
        image = torch.cat([video, torch.zeros_like(noise[:, g.video_numel:], dtype=torch.float32)], 1)
        return torch.where(self.given(g).to(noise.device), image.to(noise.dtype), noise)

    def timesteps(self, t: Tensor, g: Geometry) -> dict:
        # per video token: 0 on the given frame; the audio's, and the cross-modal modulation's, the step's own
        video = t[:, None] * (1 - self.given_tokens(g).to(t.device))
        return {"timestep": video, "audio_timestep": t, "sigma": t, "use_cross_timestep": True}

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        # the transformer sees the image in the first frame: a rollout's states hold it already; the decoupled
        # algorithms' x_t, a rollout's final latent noised whole, gets it back
        v = super().velocity(self.start_latents(latents, sigma, cond), sigma, cond, guidance_scale)
        # the pipeline steps frames 1: only; the first frame stays the image's
        return torch.where(self.given(self.geometry(latents)).to(v.device), 0.0, v)
