"""Z-Image and Z-Image-Turbo (``ZImagePipeline``), model_type ``z-image``.

Guidance follows the pipeline's own convention: ``guidance_scale`` 0 (Turbo, distilled) runs one
branch; above 0 the negative prompt ("" when none is given) is a second branch and
v = v_cond + g (v_cond - v_uncond). The transformer predicts the negated velocity at time
1 - sigma and takes lists of per-sample latents and caption embeddings of their own lengths,
so the conditioning holds the captions padded to ``max_sequence_length`` with their mask and
``velocity`` hands the transformer each caption unpadded, as the pipeline does.
"""

from __future__ import annotations


import torch
from diffusers import ZImagePipeline
from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas
from torch import Tensor

from ..config.families import MODEL_FAMILIES
from .base import FlowAdapter
from .conditioning import Conditioning
from .schedule import shifted_sigmas
from .text import pad_text
from .vae import decode_image, encode_image, packed_2x2_pixel_factor


class ZImageAdapter(FlowAdapter):
    model_type = "z-image"
    pipeline_class = ZImagePipeline
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor
    # Flow-Factory's: attention projections and the SwiGLU feed-forward of every block (refiners included)
    default_lora_targets = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                            "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]
    max_sequence_length = 512  # caption tokens, ZImagePipeline's default

    # the transformer cuts 2x2 patches
    pixel_factor_of = staticmethod(packed_2x2_pixel_factor)

    def uses_cfg(self, guidance_scale: float) -> bool:
        return guidance_scale > 0  # ZImagePipeline.do_classifier_free_guidance

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None = None,
               guidance_scale: float = 0.0) -> Conditioning:
        cfg = self.uses_cfg(guidance_scale)
        negatives = negative_prompts if negative_prompts is not None else [""] * len(prompts)
        # fresh lists: the pipeline writes the chat-templated prompts back into the list it is given
        pos, neg = self.pipeline.encode_prompt(
            prompt=list(prompts), device=self.device, do_classifier_free_guidance=cfg,
            negative_prompt=list(negatives) if cfg else None, max_sequence_length=self.max_sequence_length,
        )
        embeds, mask = pad_text(pos, self.max_sequence_length)
        cond = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        if cfg:
            embeds, mask = pad_text(neg, self.max_sequence_length)
            cond.update(negative_prompt_embeds=embeds, negative_prompt_embeds_mask=mask)
        return cond

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> Tensor:
        tokens = (height // self.loaded_pixel_factor) * (width // self.loaded_pixel_factor)
        return shifted_sigmas(self.pipeline, num_steps, tokens, get_default_z_image_sigmas(num_steps), self.device)

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        n = latents.shape[0]
        x = latents.to(self.device, self.dtype)
        t = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(n) * 1000
        t = (1000 - t) / 1000  # the pipeline's time runs from 0 (noise) to 1, from its scheduler's timestep
        cfg = self.uses_cfg(guidance_scale)
        if cfg and "negative_prompt_embeds" not in cond:
            raise ValueError("guidance_scale > 0 needs the negative branch: encode() with the same guidance_scale")
        # one call on [cond, uncond], the pipeline's order
        out = self._transformer(x, t, cond, ("", "negative_") if cfg else ("",))
        out = torch.stack([o.float() for o in out]).squeeze(2)
        if cfg:
            text, uncond = out.chunk(2)
            out = text + guidance_scale * (text - uncond)
        return -out

    def _transformer(self, x: Tensor, t: Tensor, cond: Conditioning, branches: tuple[str, ...]) -> list[Tensor]:
        """One transformer call on the latents once per branch (the prefixes of the prompt's keys), each sample
        a (C, 1, H, W) entry of a list as the pipeline gives them; the per-sample predictions in that order."""
        captions = [c for prefix in branches for c in self._captions(cond, f"{prefix}prompt_embeds")]
        latents = list(x.unsqueeze(2).unbind(0)) * len(branches)
        return self.denoiser(latents, t.repeat(len(branches)), captions, return_dict=False)[0]

    def _captions(self, cond: Conditioning, key: str) -> list[Tensor]:
        embeds, mask = cond[key].to(self.device, self.dtype), cond[f"{key}_mask"].to(self.device)
        return [e[m] for e, m in zip(embeds, mask)]

    def decode(self, latents: Tensor) -> Tensor:
        return decode_image(self.pipeline.vae, latents, self.device)

    def encode_media(self, media: Tensor) -> Tensor:
        return encode_image(self.pipeline.vae, media, self.device)
