"""Wan2.1 text-to-video (``WanPipeline``), model_type ``wan2_t2v``.

Latents are (B, 16, F', H/8, W/8) with F' = (F - 1) / 4 + 1 (the VAE is causal
in time: the first frame alone, then groups of four). Classifier-free guidance
uses the negative prompt, "" when none is given. ``decode`` returns videos
(B, F, 3, H, W) in [0, 1].
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
from torch import Tensor

from ..config.sections import MODEL_FAMILIES
from .base import Conditioning, FlowAdapter, decode_normalized


class WanT2VAdapter(FlowAdapter):
    model_type = "wan2_t2v"
    pipeline_class = WanPipeline
    is_video = True
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor
    # self-attention (attn1) and text cross-attention (attn2) projections of every block
    default_lora_targets = ["to_q", "to_k", "to_v", "to_out.0"]
    # UMT5 tokens: WanPipeline.__call__ pads to 512 (encode_prompt alone to 226); the zero padding
    # is attended to (no mask), so the length changes the output
    max_sequence_length = 512

    def __init__(self, pipeline, device="cpu", dtype: torch.dtype = torch.float32):
        problem = self.unsupported(pipeline.config)
        if problem:
            raise ValueError(problem)
        super().__init__(pipeline, device, dtype)

    @staticmethod
    def unsupported(model_index: Mapping) -> str | None:
        # WanPipeline also loads Wan2.2: a second expert is a (library, class) pair that is not
        # [null, null], and TI2V models set expand_timesteps (one timestep per latent frame)
        second = model_index.get("transformer_2") or (None, None)
        if any(second) or model_index.get("expand_timesteps", False):
            return ("wan2_t2v supports Wan2.1 (one transformer, one timestep per sample); "
                    "this checkpoint is a Wan2.2 two-expert or TI2V model")
        return None

    @staticmethod
    def pixel_factor_of(vae: Mapping, transformer: Mapping) -> int | None:
        # as WanPipeline: the VAE's spatial factor (configs saved before diffusers recorded it lack the
        # key and load with AutoencoderKLWan's default, 8), then the transformer's (frames, height,
        # width) patches
        if "patch_size" not in transformer:
            return None
        return (vae.get("scale_factor_spatial") or 8) * transformer["patch_size"][1]

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None = None,
               guidance_scale: float = 5.0) -> Conditioning:
        cfg = guidance_scale > 1
        if negative_prompts is None:
            negative_prompts = [""] * len(prompts)
        pos, neg = self.pipeline.encode_prompt(
            prompt=list(prompts), negative_prompt=list(negative_prompts) if cfg else None,
            do_classifier_free_guidance=cfg, num_videos_per_prompt=1,
            max_sequence_length=self.max_sequence_length, device=self.device,
        )
        cond = {"prompt_embeds": pos}
        if cfg:
            cond["negative_prompt_embeds"] = neg
        return cond

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        temporal = self.pipeline.vae_scale_factor_temporal
        spatial = self.pipeline.vae_scale_factor_spatial
        if num_frames is None or (num_frames - 1) % temporal:
            raise ValueError(f"wan2_t2v is a video model: num_frames must be 1 + a multiple of {temporal} "
                             f"(e.g. 5, 33, 81), got {num_frames}")
        self.check_size(height, width)
        return (self.transformer.config.in_channels, (num_frames - 1) // temporal + 1,
                height // spatial, width // spatial)

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> Tensor:
        scheduler = self.pipeline.scheduler
        if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler.config)
        else:
            # released Wan2.1 checkpoints ship UniPC with the shift stored as flow_shift; the rollout
            # integrates with its own dynamics, so it needs only the Euler grid of that shift
            scheduler = FlowMatchEulerDiscreteScheduler(shift=scheduler.config.get("flow_shift", 5.0))
        scheduler.set_timesteps(num_steps, device="cpu")  # WanPipeline passes no custom sigmas
        return scheduler.sigmas.float().to(self.device)

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        n = latents.shape[0]
        x = latents.to(self.device, self.dtype)
        t = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(n) * 1000
        cfg, x, t, (embeds,) = self.cfg_inputs(cond, guidance_scale, x, t, ("prompt_embeds",))
        out = self.denoiser(
            hidden_states=x, timestep=t, encoder_hidden_states=embeds.to(self.device, self.dtype),
            return_dict=False,
        )[0].float()
        return self.combine_cfg(out, guidance_scale) if cfg else out

    def decode(self, latents: Tensor) -> Tensor:
        return decode_normalized(self.pipeline.vae, latents, self.device).permute(0, 2, 1, 3, 4)
