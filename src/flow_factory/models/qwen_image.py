"""Qwen-Image (``QwenImagePipeline``), model_type ``qwen-image``.

Not guidance-distilled: ``guidance_scale`` is the pipeline's ``true_cfg_scale``. Above 1 the
negative prompt ("" when none is given) is a second branch, and the combined prediction is
rescaled, token by token, to the norm of the conditional one, as the pipeline does.

Latents stay (B, 16, H/8, W/8) outside this file: the VAE's layout without its single frame,
which ``decode`` adds back. ``velocity`` packs 2x2 latents into tokens with the pipeline's own
static helpers. Each prompt keeps its own length (the transformer masks the padding), so the
conditioning holds the embeddings padded to ``max_sequence_length`` with their mask, and
``velocity`` cuts the padding back to the longest prompt of the batch, as the pipeline pads.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from diffusers import QwenImagePipeline
from torch import Tensor

from ..config.families import MODEL_FAMILIES
from .base import JOINT_ATTENTION_LORA_TARGETS, FlowAdapter
from .conditioning import Conditioning
from .schedule import shifted_sigmas
from .text import pad_text, trim_text
from .vae import decode_normalized, encode_normalized


class QwenImageAdapter(FlowAdapter):
    model_type = "qwen-image"
    pipeline_class = QwenImagePipeline
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor
    # Flow-Factory's: both streams' attention projections and each MLP's first layer. Its list also names
    # img_mlp.net.2.proj and txt_mlp.net.2.proj, which match no module of diffusers' transformer
    # (net.2 is the Linear itself), so it trains without them; so does this
    default_lora_targets = [*JOINT_ATTENTION_LORA_TARGETS, "img_mlp.net.0.proj", "txt_mlp.net.0.proj"]
    max_sequence_length = 512  # text tokens: QwenImagePipeline.__call__ truncates to this
    latents_per_token = 4  # the pipeline packs 2x2 latents into one token

    @staticmethod
    def pixel_factor_of(vae: Mapping, transformer: Mapping) -> int | None:
        # as QwenImagePipeline: the VAE halves the size at each downsampling stage (three: x8), then the
        # pipeline packs 2x2 latents into one token
        if "temperal_downsample" not in vae:
            return None
        return 2 ** len(vae["temperal_downsample"]) * 2

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None = None,
               guidance_scale: float = 4.0) -> Conditioning:
        cond = self._encode_text(prompts)
        if self.uses_cfg(guidance_scale):
            negatives = negative_prompts if negative_prompts is not None else [""] * len(prompts)
            cond.update({f"negative_{k}": v for k, v in self._encode_text(negatives).items()})
        return cond

    def _encode_text(self, prompts: list[str]) -> Conditioning:
        embeds, mask = self.pipeline.encode_prompt(prompt=list(prompts), device=self.device,
                                                   max_sequence_length=self.max_sequence_length)
        # the pipeline pads to the batch's longest prompt and gives no mask when nothing was padded
        lengths = mask.sum(1).tolist() if mask is not None else [embeds.shape[1]] * len(embeds)
        embeds, mask = pad_text([e[:n] for e, n in zip(embeds, lengths)], self.max_sequence_length)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> Tensor:
        tokens = (height // self.loaded_pixel_factor) * (width // self.loaded_pixel_factor)
        grid = np.linspace(1.0, 1 / num_steps, num_steps)  # QwenImagePipeline's default sigmas
        return shifted_sigmas(self.pipeline, num_steps, tokens, grid, self.device)

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        pipe = type(self.pipeline)
        n, c, h, w = latents.shape
        x = pipe._pack_latents(latents.to(self.device, self.dtype), n, c, h, w)
        tokens = x.shape[1]
        x, grids = self.with_condition_tokens(x, cond)
        t = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(n) * 1000
        # the pipeline calls the transformer once per branch; one call on [uncond, cond] is the same
        # arithmetic per sample, and one forward per backward is what DDP needs
        cfg, x, t, (embeds, mask) = self.cfg_inputs(cond, guidance_scale, x, t,
                                                    ("prompt_embeds", "prompt_embeds_mask"))
        embeds, mask = trim_text(embeds.to(self.device, self.dtype), mask.to(self.device))
        out = self.denoiser(
            hidden_states=x,
            timestep=t.to(self.dtype) / 1000,  # the pipeline's 1000 sigma / 1000, for the same rounding
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=None if mask.all() else mask,  # as the pipeline: no mask without padding
            img_shapes=[[(1, h // 2, w // 2), *grids]] * len(x),
            return_dict=False,
        )[0][:, :tokens].float()  # the prediction for the latents' own tokens
        if cfg:
            text = out.chunk(2)[1]
            combined = self.combine_cfg(out, guidance_scale)
            out = combined * (text.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))
        s = self.pipeline.vae_scale_factor
        return pipe._unpack_latents(out, h * s, w * s, s).squeeze(2)

    def with_condition_tokens(self, packed: Tensor, cond: Conditioning) -> tuple[Tensor, list[tuple[int, int, int]]]:
        """The tokens the transformer reads after the latents' and their (frames, rows, columns) grids: an editing
        model's condition images (qwen_image_edit.py); none here."""
        return packed, []

    def decode(self, latents: Tensor) -> Tensor:
        # the VAE is Wan's kind: 5-D, here with one frame
        return decode_normalized(self.pipeline.vae, latents.unsqueeze(2), self.device)[:, :, 0]

    def encode_media(self, media: Tensor) -> Tensor:
        return encode_normalized(self.pipeline.vae, media.unsqueeze(2), self.device)[:, :, 0]
