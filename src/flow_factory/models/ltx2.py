"""LTX-2 text to video with audio (``LTX2Pipeline``), model_type ``ltx2_t2av``.

One transformer denoises a video and its soundtrack together, on one sigma schedule. A sample's
latent is one flat vector: the video's tokens as the transformer reads them (``_pack_latents`` of
the VAE's normalised latents), then the audio's (``_pack_audio_latents`` of the audio VAE's
normalised mel latents), which is where the pipeline draws its noise. The vector does not say
the size it was made for (512x768 and 768x512 give the same length), so ``latent_shape``
remembers the size of each length it hands out and ``velocity`` and ``decode`` read it back; a
length made for two sizes is an error there.

As Flow-Factory trains LTX-2, the sampler's noise reaches the video alone: ``sampling_dynamics``
keeps the audio on the ODE, so a step's log-probability is the video's. Rewards may still ask for
the audio (``decode_audio``; the ``audio`` reward field).

Guidance is the pipeline's classifier-free guidance with one scale for both streams (its
``audio_guidance_scale=None``); spatio-temporal guidance (STG), modality-isolation guidance and the
guidance rescale are off, as in Flow-Factory's LTX-2 configs: the ODE equals ``LTX2Pipeline(...,
stg_scale=0, modality_scale=1, guidance_rescale=0)``. Videos play at ``frame_rate``, the pipeline's
default 24 fps, which also sets the audio's length.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from diffusers import LTX2Pipeline
from torch import Tensor

from ..config.families import MODEL_FAMILIES
from ..dynamics import Dynamics, PartlyStochastic
from .base import FlowAdapter
from .conditioning import Conditioning
from .schedule import shifted_sigmas

# Flow-Factory's targets: the video and audio self- and text cross-attention, the cross-modal
# attention both ways, and both feed-forwards, in every block
LTX2_LORA_TARGETS = [
    f"{attn}.{proj}" for attn in ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn",
                                  "video_to_audio_attn") for proj in ("to_q", "to_k", "to_v", "to_out.0")
] + ["ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2"]


@dataclass(frozen=True)
class Geometry:
    """One size's latent grid: video (frames, height, width) in latent units, audio latent frames, and
    the token layouts (tokens, channels) the transformer reads."""

    frames: int
    height: int
    width: int
    audio_frames: int
    video_tokens: tuple[int, int]
    audio_tokens: tuple[int, int]

    @property
    def video_numel(self) -> int:
        return self.video_tokens[0] * self.video_tokens[1]

    @property
    def numel(self) -> int:
        return self.video_numel + self.audio_tokens[0] * self.audio_tokens[1]


class LTX2Adapter(FlowAdapter):
    model_type = "ltx2_t2av"
    pipeline_class = LTX2Pipeline
    is_video = True
    has_audio = True
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor
    default_lora_targets = LTX2_LORA_TARGETS
    max_sequence_length = 1024  # Gemma tokens, the pipeline's default
    # the connectors turn Gemma's stacked layers into the transformer's video and audio text
    text_encoder_names = ("text_encoder", "connectors")
    frame_rate = 24.0  # the pipeline's default; sets the audio's length and the video's time positions

    def __init__(self, pipeline, device="cpu", dtype: torch.dtype = torch.float32):
        super().__init__(pipeline, device, dtype)
        for module in (pipeline.audio_vae, pipeline.vocoder):
            module.requires_grad_(False)
        self._geometries: dict[int, Geometry] = {}  # latent length -> the size latent_shape made it for

    @staticmethod
    def pixel_factor_of(vae: Mapping, transformer: Mapping) -> int | None:
        # the VAE's ratio as AutoencoderKLLTX2Video sets it (its config's, else patch x 2 per scaling block),
        # then the transformer's patches
        if "patch_size" not in transformer or "patch_size" not in vae:
            return None
        scaling = vae.get("spatio_temporal_scaling", (True,) * 4)
        spatial = vae.get("spatial_compression_ratio") or vae["patch_size"] * 2 ** sum(
            [scaling] * 4 if isinstance(scaling, bool) else scaling)
        return spatial * transformer["patch_size"]

    def sampling_dynamics(self, dynamics: Dynamics) -> Dynamics:
        if not dynamics.stochastic:
            return dynamics
        return PartlyStochastic(dynamics, lambda x: self.explored(self.geometry(x)))

    def explored(self, g: Geometry) -> Tensor:
        """The elements of a latent of grid ``g`` that the SDE's noise reaches: the video's."""
        return torch.arange(g.numel) < g.video_numel

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None = None,
               guidance_scale: float = 4.0) -> Conditioning:
        cfg = guidance_scale > 1
        negatives = list(negative_prompts) if negative_prompts is not None else [""] * len(prompts)
        pos, pos_mask, neg, neg_mask = self.pipeline.encode_prompt(
            prompt=list(prompts), negative_prompt=negatives if cfg else None, do_classifier_free_guidance=cfg,
            max_sequence_length=self.max_sequence_length, device=self.device)
        if cfg:  # the connectors run on [negative, positive], as in the pipeline
            pos, pos_mask = torch.cat([neg, pos]), torch.cat([neg_mask, pos_mask])
        video, audio, mask = self.pipeline.connectors(pos, pos_mask, padding_side=self.pipeline.tokenizer.padding_side)
        cond = {"prompt_embeds": video, "audio_prompt_embeds": audio, "prompt_attention_mask": mask}
        if not cfg:
            return cond
        halves = {key: value.chunk(2) for key, value in cond.items()}
        return {**{k: h[1] for k, h in halves.items()}, **{f"negative_{k}": h[0] for k, h in halves.items()}}

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        return (self.size_geometry(height, width, num_frames).numel,)

    def size_geometry(self, height: int, width: int, num_frames: int | None) -> Geometry:
        """The latent grid of videos of this size, remembered under its latent length (for ``geometry``)."""
        pipe = self.pipeline
        temporal = pipe.vae_temporal_compression_ratio
        if num_frames is None or (num_frames - 1) % temporal:
            raise ValueError(f"{self.model_type} is a video model: num_frames must be 1 + a multiple of {temporal} "
                             f"(e.g. 9, 41, 121), got {num_frames}")
        self.check_size(height, width)
        s, p, pt = (pipe.vae_spatial_compression_ratio, pipe.transformer_spatial_patch_size,
                    pipe.transformer_temporal_patch_size)
        frames, h, w = (num_frames - 1) // temporal + 1, height // s, width // s
        # the pipeline's audio length: the video's duration in audio latent frames
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        audio_frames = round(num_frames / self.frame_rate * per_second)
        config = self.transformer.config
        g = Geometry(frames, h, w, audio_frames,
                     ((frames // pt) * (h // p) * (w // p), config.in_channels * pt * p * p),
                     (audio_frames, config.audio_in_channels))
        if self._geometries.setdefault(g.numel, g) != g:
            raise ValueError(f"{self.model_type}: {height}x{width} at {num_frames} frames gives latents as long as "
                             f"another size's ({self._geometries[g.numel]}), which velocity could not tell apart; "
                             "sample at only one of the two")
        return g

    def geometry(self, latents: Tensor) -> Geometry:
        """The grid of ``latents`` (B, n), from the size ``latent_shape`` made that length for."""
        n = latents.shape[-1]
        if n not in self._geometries:
            raise ValueError(f"{self.model_type}: no size gave latents of length {n}; make them with this adapter's "
                             "latent_shape or initial_noise")
        return self._geometries[n]

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> Tensor:
        # as the pipeline: a linear grid ending at 1/n, shifted by the number of video tokens
        tokens = self.size_geometry(height, width, num_frames).video_tokens[0]
        return shifted_sigmas(self.pipeline, num_steps, tokens, np.linspace(1.0, 1 / num_steps, num_steps),
                              self.device)

    def split(self, latents: Tensor) -> tuple[Tensor, Tensor]:
        """(B, n) -> video tokens (B, S, C) and audio tokens (B, L, C_a)."""
        g = self.geometry(latents)
        return latents[:, :g.video_numel].unflatten(1, g.video_tokens), \
            latents[:, g.video_numel:].unflatten(1, g.audio_tokens)

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        g, n = self.geometry(latents), latents.shape[0]
        x = latents.to(self.device, self.dtype)
        t = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(n) * 1000
        cfg, x, t, (embeds, audio_embeds, mask) = self.cfg_inputs(
            cond, guidance_scale, x, t, ("prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask"))
        video, audio = self.split(x)
        # audio and video share the timestep, so the transformer's cross-modal timestep choice
        # (use_cross_timestep) makes no difference
        out = self.denoiser(
            hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=embeds.to(self.device, self.dtype),
            audio_encoder_hidden_states=audio_embeds.to(self.device, self.dtype), **self.timesteps(t, g),
            encoder_attention_mask=mask.to(self.device), audio_encoder_attention_mask=mask.to(self.device),
            num_frames=g.frames, height=g.height, width=g.width, fps=self.frame_rate, audio_num_frames=g.audio_frames,
            return_dict=False,
        )
        v = torch.cat([out[0].float().flatten(1), out[1].float().flatten(1)], 1)
        # the pipeline mixes the branches in x0 = x - sigma v and converts back: the same number up to rounding
        return self.combine_cfg(v, guidance_scale) if cfg else v

    def timesteps(self, t: Tensor, g: Geometry) -> dict:
        """The transformer's timestep arguments for a step at ``t`` (B,): one for the video and the audio."""
        return {"timestep": t, "sigma": t}

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        pipe, vae = self.pipeline, self.pipeline.vae
        g = self.geometry(latents)
        video = pipe._unpack_latents(self.split(latents.to(self.device))[0], g.frames, g.height, g.width,
                                     pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        # the pipeline's decode_timestep and decode_noise_scale default to 0: no noise mixed in
        timestep = torch.zeros(len(video), device=self.device) if vae.config.timestep_conditioning else None
        frames = vae.decode(video.to(vae.dtype), timestep, return_dict=False)[0]
        return pipe.video_processor.postprocess_video(frames, output_type="pt").float()

    @torch.no_grad()
    def decode_audio(self, latents: Tensor) -> tuple[Tensor, int]:
        pipe, audio_vae = self.pipeline, self.pipeline.audio_vae
        g = self.geometry(latents)
        audio = pipe._denormalize_audio_latents(self.split(latents.to(self.device))[1], audio_vae.latents_mean,
                                                audio_vae.latents_std)
        mel_bins = audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        audio = pipe._unpack_audio_latents(audio, g.audio_frames, num_mel_bins=mel_bins)
        mel = audio_vae.decode(audio.to(audio_vae.dtype), return_dict=False)[0]
        return pipe.vocoder(mel).float(), pipe.vocoder.config.output_sampling_rate

    @torch.no_grad()
    def encode_media(self, media: Tensor, sounds: list | None = None) -> Tensor:
        """``decode``'s and ``decode_audio``'s inverse, as Flow-Factory encodes an LTX-2 target: (B, F, 3, H, W)
        videos and their soundtracks (``sounds``: files, read at the pipeline's audio rate for the video's duration
        at ``frame_rate``) as one latent each: the video VAE's mode, normalised and packed, then the audio VAE's
        mode of the log-mel spectrogram (``media.audio.log_mel_spectrogram``), packed and normalised."""
        from ..media.audio import log_mel_spectrogram, read_audio

        if sounds is None or len(sounds) != len(media):
            raise ValueError(f"{self.model_type} encodes each video with its soundtrack: give one per video")
        pipe, vae, audio_vae = self.pipeline, self.pipeline.vae, self.pipeline.audio_vae
        g = self.size_geometry(media.shape[3], media.shape[4], media.shape[1])
        z = vae.encode((media.transpose(1, 2) * 2 - 1).to(self.device, vae.dtype)).latent_dist.mode().float()
        z = pipe._normalize_latents(z, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        video = pipe._pack_latents(z, pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        waves = torch.stack([torch.from_numpy(read_audio(sound, pipe.audio_sampling_rate, audio_vae.config.in_channels,
                                                         media.shape[1] / self.frame_rate)) for sound in sounds])
        mel = log_mel_spectrogram(waves, pipe.audio_sampling_rate, pipe.audio_hop_length, audio_vae.config.mel_bins)
        a = audio_vae.encode(mel.to(self.device, audio_vae.dtype)).latent_dist.mode().float()[:, :, :g.audio_frames]
        a = torch.nn.functional.pad(a, (0, 0, 0, g.audio_frames - a.shape[2]))  # the pipeline's audio length
        audio = pipe._normalize_audio_latents(pipe._pack_audio_latents(a), audio_vae.latents_mean,
                                              audio_vae.latents_std)
        return torch.cat([video.flatten(1), audio.flatten(1)], 1).float()
