"""Wan2.1 and Wan2.2 text-to-video (``WanPipeline``), model_type ``wan2_t2v``.

Latents are (B, C, F', H/s, W/s) with F' = (F - 1) / 4 + 1 (the VAE is causal in time:
the first frame alone, then groups of four); C and s are the VAE's (Wan2.1 and Wan2.2
A14B: 16 channels, x8; Wan2.2 TI2V-5B: 48 channels, x16). Classifier-free guidance uses
the negative prompt, "" when none is given. ``decode`` returns videos (B, F, 3, H, W) in [0, 1].

Wan2.2 as ``WanPipeline.__call__`` runs it:
- A14B has two experts: ``transformer`` denoises while t = 1000 sigma >= boundary_ratio x
  num_train_timesteps (model_index.json), ``transformer_2`` below, with ``guidance_scale_2``
  (None = guidance_scale). Whether CFG runs at all follows ``guidance_scale``, for both experts.
  A batch whose per-sample sigmas straddle the boundary is split between the experts.
- TI2V-5B (``expand_timesteps``) gives the transformer one timestep per latent token, here
  all equal: text-to-video conditions on no image.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline
from torch import Tensor

from ..config.families import MODEL_FAMILIES
from .base import FlowAdapter
from .conditioning import Conditioning, index_cond
from .vae import decode_normalized, encode_normalized


class WanT2VAdapter(FlowAdapter):
    model_type = "wan2_t2v"
    pipeline_class = WanPipeline
    is_video = True
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor
    transformer_names = MODEL_FAMILIES[model_type].components  # transformer (high noise), transformer_2 (low)
    lora_load_kwargs = {"transformer_2": {"load_into_transformer_2": True}}
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
    def experts(model_index: Mapping) -> tuple[str, ...]:
        # the pipeline calls transformer_2 only when a boundary between the experts is set
        second = model_index.get("transformer_2") or (None, None)
        return ("transformer", "transformer_2") if any(second) and model_index.get("boundary_ratio") is not None \
            else ("transformer",)

    @classmethod
    def unsupported(cls, model_index: Mapping) -> str | None:
        # WanPipeline may load without transformer (only transformer_2), or with a boundary and no second expert
        if not any(model_index.get("transformer") or (None, None)):
            return f"{cls.model_type} needs the pipeline's transformer; this checkpoint has none"
        if model_index.get("boundary_ratio") is not None and not any(model_index.get("transformer_2") or (None, None)):
            return (f"{cls.model_type}: this checkpoint sets boundary_ratio but has no transformer_2 (the low-noise "
                    "expert)")
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
            raise ValueError(f"{self.model_type} is a video model: num_frames must be 1 + a multiple of {temporal} "
                             f"(e.g. 5, 33, 81), got {num_frames}")
        self.check_size(height, width)
        return (self.pipeline.vae.config.z_dim, (num_frames - 1) // temporal + 1,
                height // spatial, width // spatial)

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> Tensor:
        scheduler = self.pipeline.scheduler
        if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler.config)
        else:
            # released Wan checkpoints ship UniPC with the shift stored as flow_shift; the rollout
            # integrates with its own dynamics, so it needs only the Euler grid of that shift
            scheduler = FlowMatchEulerDiscreteScheduler(shift=scheduler.config.get("flow_shift", 5.0))
        scheduler.set_timesteps(num_steps, device="cpu")  # WanPipeline passes no custom sigmas
        return scheduler.sigmas.float().to(self.device)

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        n = latents.shape[0]
        x = latents.to(self.device, self.dtype)
        # the scheduler's timestep, t = sigma x num_train_timesteps in float32, which the pipeline compares
        t = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(n) \
            * self.pipeline.scheduler.config.num_train_timesteps
        high = self.high_noise(t)
        scale_2 = guidance_scale if self.guidance_scale_2 is None else self.guidance_scale_2
        parts = {"transformer": (high, guidance_scale), "transformer_2": (~high, scale_2)}
        called = self.expert_calls.to_run({name: bool(rows.any()) for name, (rows, _) in parts.items()})
        if sum(called.values()) == 1:
            (name,) = (name for name, on in called.items() if on)
            return self._expert_velocity(name, x, t, cond, guidance_scale, parts[name][1])
        out = torch.empty(latents.shape, dtype=torch.float32, device=self.device)
        for name, (rows, scale) in parts.items():
            rows = rows.nonzero().squeeze(1)
            if len(rows):
                out[rows] = self._expert_velocity(name, x[rows], t[rows], index_cond(cond, rows), guidance_scale,
                                                  scale)
            elif called[name]:  # no row needs it, yet the backend runs it (another process does: expert_calls)
                first = torch.zeros(1, dtype=torch.long, device=self.device)
                out = self.expert_calls.idle_pass(out, lambda: self._expert_velocity(
                    name, x[first], t[first], index_cond(cond, first), guidance_scale, scale))  # noqa: B023
        return out

    def experts_at(self, sigmas: Tensor) -> list[str]:
        t = sigmas.float() * self.pipeline.scheduler.config.num_train_timesteps
        return ["transformer" if high else "transformer_2" for high in self.high_noise(t).tolist()]

    def high_noise(self, t: Tensor) -> Tensor:
        """Which timesteps the high-noise expert (``transformer``) denoises: all of them but on Wan2.2 A14B."""
        ratio = self.pipeline.config.get("boundary_ratio")
        if ratio is None:
            return torch.ones_like(t, dtype=torch.bool)
        return t >= ratio * self.pipeline.scheduler.config.num_train_timesteps

    def _expert_velocity(self, name: str, x: Tensor, t: Tensor, cond: Conditioning, guidance_scale: float,
                         scale: float) -> Tensor:
        if self.pipeline.config.get("expand_timesteps", False):
            # TI2V: a timestep per token of the transformer's 2x2 patches, as the pipeline's mask[:, ::2, ::2]
            t = t[:, None].expand(-1, x[0, 0, :, ::2, ::2].numel())
        cfg, x, t, (embeds,) = self.cfg_inputs(cond, guidance_scale, x, t, ("prompt_embeds",))
        x, image_inputs = self.with_condition(x, cond, 2 if cfg else 1)
        out = self.denoiser_for(name)(
            hidden_states=x, timestep=t, encoder_hidden_states=embeds.to(self.device, self.dtype),
            return_dict=False, **image_inputs,
        )[0].float()
        return self.combine_cfg(out, scale) if cfg else out

    def with_condition(self, x: Tensor, cond: Conditioning, copies: int) -> tuple[Tensor, dict]:
        """The transformer's input and its image keyword arguments, for ``x`` holding ``copies`` of the batch
        (two under CFG): text-to-video has no image; image-to-video adds its condition (wan_i2v.py)."""
        return x, {}

    def decode(self, latents: Tensor) -> Tensor:
        return decode_normalized(self.pipeline.vae, latents, self.device).permute(0, 2, 1, 3, 4)

    def encode_media(self, media: Tensor) -> Tensor:
        return encode_normalized(self.pipeline.vae, media.permute(0, 2, 1, 3, 4), self.device)
