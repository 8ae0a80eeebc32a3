"""FLUX.2 (``Flux2Pipeline``, model_type ``flux2``) and FLUX.2 [klein] (``Flux2KleinPipeline``,
model_type ``flux2-klein``): one transformer, VAE and schedule, two text sides.

Latents outside this file are the VAE's latents as the transformer sees them: patchified 2x2
and normalised by the VAE's batch-norm statistics, (B, 4 x 32, H/16, W/16), which is where the
pipeline draws its noise (``prepare_latents`` takes them in this layout). ``velocity`` packs
them into tokens with the pipeline's ``_pack_latents`` and scatters the prediction back with
``_unpack_latents_with_ids``; ``decode`` undoes the normalisation and the patchify as the
pipeline does before its VAE decode.

The text side is the pipeline's own ``encode_prompt``: hidden states of several text-encoder
layers stacked (``text_encoder_out_layers``, the pipeline's defaults), 512 padded tokens.
FLUX.2 [dev] is guidance-distilled (an embedding, one pass); Klein passes no guidance: the
distilled checkpoints (``is_distilled``) ignore ``guidance_scale``, the base ones run
classifier-free guidance on "" or the negative prompt.

Reference images (image-to-image, the pipelines' ``image=[...]``): a row may name condition images; none makes
the sample text-to-image. Each is resized as the pipelines resize it (down to ``condition_image_size``'s area,
by default their 1024^2, then floored to multiples of 16, keeping its aspect ratio), VAE-encoded (the
distribution's mode), normalised and packed like the latents, and appended to the latents' tokens with position
ids whose first coordinate is 10, 20, ... per image; the prediction for the latents' own tokens is kept. The
tokens are encoded once per sample (``encode_conditions``) and stored ragged, padded with their mask: one
transformer call takes samples whose references come out the same sizes (``call_shape``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from torch import Tensor

from ..config.families import MODEL_FAMILIES
from .base import FlowAdapter
from .conditioning import ConditionMedia, Conditioning
from .text import pad_text

# Flow-Factory's FLUX.2 targets: the double-stream blocks' attention and both feed-forwards, the
# single-stream blocks' fused projection. (Its list also names "attn.to_out.0", which in a single-
# stream block is "attn.to_out": that projection stays frozen there, and here, so LoRAs match.)
FLUX2_LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
    "attn.to_qkv_mlp_proj",
]
REFERENCE_AREA = 1024 * 1024  # the pipelines resize a larger reference image down to this many pixels


class Flux2FamilyAdapter(FlowAdapter):
    """What FLUX.2 and Klein share; the subclasses say how they encode and guide."""

    default_lora_targets = FLUX2_LORA_TARGETS
    max_sequence_length = 512  # text tokens, the pipelines' default
    condition_inputs = ("images",)  # reference images, optional: a row without any is text-to-image
    conditions_per_sample = (0, 10)  # FLUX.2's multi-reference limit (its model card); the pipelines set none

    @staticmethod
    def pixel_factor_of(vae: Mapping, transformer: Mapping) -> int | None:
        # as the pipelines: the VAE halves the size at each block after the first, then 2x2 patchify
        if "block_out_channels" not in vae:
            return None
        return 2 ** (len(vae["block_out_channels"]) - 1) * 2

    def tokenizers(self) -> dict:
        # FLUX.2 [dev]'s tokenizer slot holds a processor; the prompt cache fingerprints its tokenizer
        return {name: getattr(t, "tokenizer", t) for name, t in super().tokenizers().items()}

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        self.check_size(height, width)
        f = self.loaded_pixel_factor
        return (self.transformer.config.in_channels, height // f, width // f)

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> Tensor:
        scheduler = type(self.pipeline.scheduler).from_config(self.pipeline.scheduler.config)
        # as the pipelines: a linear grid ending at 1/n, shifted by an empirical mu of the number of
        # image tokens and of the number of steps
        grid = None if scheduler.config.get("use_flow_sigmas", False) else np.linspace(1.0, 1 / num_steps, num_steps)
        _, h, w = self.latent_shape(height, width)
        scheduler.set_timesteps(num_steps, device="cpu", sigmas=grid, mu=compute_empirical_mu(h * w, num_steps))
        return scheduler.sigmas.float().to(self.device)

    # --- reference images ---------------------------------------------------------------------
    @classmethod
    def call_shape(cls, sizes, condition_size) -> tuple:
        """Each reference image's (width, height) as the pipelines resize it: down to ``condition_size``'s area
        (default theirs) when larger, then floored to multiples of the pixel factor. (The pipelines also refuse a
        side under 64 pixels or an aspect ratio over 8; Flow-Factory does not, nor does this.)"""
        area, f, out = condition_size[0] * condition_size[1] if condition_size else REFERENCE_AREA, cls.pixel_factor, []
        for w, h in sizes:
            if w * h > area:  # Flux2ImageProcessor._resize_to_target_area's size
                scale = math.sqrt(area / (w * h))
                w, h = int(w * scale), int(h * scale)
            if w < f or h < f:
                raise ValueError(f"{cls.model_type}: a reference image resized to an area of {area} pixels is {w}x{h}, "
                                 f"a side under {f} pixels; give a larger image, or raise condition_image_size")
            out.append((w // f * f, h // f * f))
        return tuple(out)

    def prepare_conditions(self, images, videos, height, width, num_frames, condition_size) -> ConditionMedia:
        """Each reference image as the pipelines preprocess it, in [0, 1]; a sample without any: (0, 3, H, W)."""
        processor, per_sample = self.pipeline.image_processor, []
        area = condition_size[0] * condition_size[1] if condition_size else REFERENCE_AREA
        for sample in images:
            shown = []
            for image, (w, h) in zip(sample, self.call_shape([im.size for im in sample], condition_size)):
                if image.width * image.height > area:
                    image = processor._resize_to_target_area(image, area)
                image = processor.resize(image, h, w, resize_mode="crop")
                shown.append(processor.numpy_to_pt(processor.pil_to_numpy([image]))[0])
            sizes = {tuple(s.shape) for s in shown}
            per_sample.append(torch.stack(shown) if len(sizes) == 1 else shown if shown
                              else torch.zeros(0, 3, height, width))
        return ConditionMedia(images=per_sample)

    @torch.no_grad()
    def encode_conditions(self, media: ConditionMedia, height, width, num_frames) -> Conditioning:
        """Each sample's reference tokens (L_i, C) and position ids (L_i, 4), as ``prepare_image_latents`` makes
        them, padded to the batch's longest with a mask of the real tokens."""
        pipe, tokens, ids, channels = self.pipeline, [], [], self.transformer.config.in_channels
        for sample in media.images:
            latents = [pipe._encode_vae_image((image[None] * 2 - 1).to(self.device, pipe.vae.dtype), generator=None)
                       for image in sample]  # one at a time, as the pipelines; the mode: deterministic
            tokens.append(torch.cat([pipe._pack_latents(z)[0] for z in latents]) if latents
                          else torch.zeros(0, channels, device=self.device, dtype=pipe.vae.dtype))
            ids.append(pipe._prepare_image_ids(latents)[0].to(self.device) if latents
                       else torch.zeros(0, 4, dtype=torch.long, device=self.device))
        longest = max(len(t) for t in tokens)
        image_latents, mask = pad_text(tokens, longest)
        return {"image_latents": image_latents, "image_latents_mask": mask, "image_ids": pad_text(ids, longest)[0]}

    def _references(self, cond: Conditioning, n: int) -> tuple[Tensor, Tensor] | None:
        """The reference tokens and ids of a call on ``n`` rows (CFG's doubled batch repeats them); None if none."""
        if "image_latents" not in cond:
            return None
        counts = cond["image_latents_mask"].sum(1)
        if not (counts == counts[:1]).all():
            raise ValueError(f"{self.model_type}: the samples of one transformer call must have reference images of "
                             f"the same sizes; got {counts.tolist()} tokens; set per_device_batch_size: 1")
        k = int(counts[0]) if len(counts) else 0
        if k == 0:
            return None
        tokens, ids = cond["image_latents"][:, :k], cond["image_ids"][:, :k]
        repeat = n // tokens.shape[0]
        return tokens.repeat(repeat, 1, 1).to(self.device, self.dtype), ids.repeat(repeat, 1, 1).to(self.device)

    def _transformer(self, latents: Tensor, sigma: Tensor, embeds: Tensor, guidance: Tensor | None,
                     cond: Conditioning) -> Tensor:
        """One call on (B, C, h, w) latents, with ``cond``'s reference tokens after theirs; returns the float32
        prediction of the latents' tokens in that layout."""
        pipe = type(self.pipeline)
        n = latents.shape[0]
        x = latents.to(self.device, self.dtype)
        image_ids = pipe._prepare_latent_ids(x).to(self.device)
        text_ids = pipe._prepare_text_ids(embeds).to(self.device)
        t = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(n) * 1000
        hidden, ids = pipe._pack_latents(x), image_ids
        references = self._references(cond, n)
        if references is not None:  # as the pipelines: appended to the latents' tokens, their prediction dropped
            hidden, ids = torch.cat([hidden, references[0]], dim=1), torch.cat([image_ids, references[1]], dim=1)
        out = self.denoiser(
            hidden_states=hidden,
            # the pipeline's round trip 1000 sigma / 1000, kept so the result is bit-identical
            timestep=t.to(self.dtype) / 1000,
            guidance=guidance,
            encoder_hidden_states=embeds.to(self.device, self.dtype),
            txt_ids=text_ids,
            img_ids=ids,
            return_dict=False,
        )[0][:, :image_ids.shape[1]]
        return pipe._unpack_latents_with_ids(out, image_ids).float()

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        vae = self.pipeline.vae
        z = latents.to(self.device, vae.dtype)
        # the VAE's batch-norm statistics of the patchified latents: denormalise, then unpatchify
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        z = type(self.pipeline)._unpatchify_latents(z * std + mean)
        image = vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_media(self, media: Tensor) -> Tensor:
        # decode's inverse, as the pipelines encode a reference image: the VAE's mode, patchified, normalised
        vae = self.pipeline.vae
        z = vae.encode((media * 2 - 1).to(self.device, vae.dtype)).latent_dist.mode()
        z = type(self.pipeline)._patchify_latents(z)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.device, z.dtype)
        return ((z - mean) / std).float()


class Flux2Adapter(Flux2FamilyAdapter):
    model_type = "flux2"
    pipeline_class = Flux2Pipeline
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor

    def uses_cfg(self, guidance_scale: float) -> bool:
        return False  # FLUX.2 [dev]'s guidance is an embedding: no negative branch

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None = None,
               guidance_scale: float = 4.0) -> Conditioning:
        # negative prompts have no effect: the guidance is distilled into the embedding
        embeds, _text_ids = self.pipeline.encode_prompt(
            prompt=list(prompts), device=self.device, max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": embeds}

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        # the pipeline passes the guidance embedding's input whether or not the transformer has one
        guidance = torch.full((latents.shape[0],), float(guidance_scale), device=self.device, dtype=torch.float32)
        return self._transformer(latents, sigma, cond["prompt_embeds"], guidance, cond)


class Flux2KleinAdapter(Flux2FamilyAdapter):
    model_type = "flux2-klein"
    pipeline_class = Flux2KleinPipeline
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor

    def uses_cfg(self, guidance_scale: float) -> bool:
        # as Flux2KleinPipeline.do_classifier_free_guidance: step-distilled checkpoints ignore the scale
        return guidance_scale > 1 and not self.pipeline.config.get("is_distilled", False)

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None = None,
               guidance_scale: float = 4.0) -> Conditioning:
        def embed(texts):
            return self.pipeline.encode_prompt(
                prompt=list(texts), device=self.device, max_sequence_length=self.max_sequence_length)[0]

        cond = {"prompt_embeds": embed(prompts)}
        if self.uses_cfg(guidance_scale):  # the pipeline's negative is "" (it takes negative embeddings)
            cond["negative_prompt_embeds"] = embed(negative_prompts or [""] * len(prompts))
        return cond

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        if not self.uses_cfg(guidance_scale):
            return self._transformer(latents, sigma, cond["prompt_embeds"], None, cond)
        # the pipeline makes one call per branch; one call on both is the same up to float rounding
        sigmas = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).reshape(-1)
        _, x, s, (embeds,) = self.cfg_inputs(cond, guidance_scale, latents, sigmas.expand(latents.shape[0]),
                                             ("prompt_embeds",))
        return self.combine_cfg(self._transformer(x, s, embeds, None, cond), guidance_scale)
