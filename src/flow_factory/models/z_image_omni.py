"""Z-Image-Omni (``ZImageOmniPipeline``), model_type ``z-image-omni``: Z-Image's transformer in its omni mode,
generating from a prompt and, optionally, condition images (editing, reference images); a row without any is
text-to-image.

What it adds to Z-Image (``z_image.py``, which it extends), each computed once per sample and read by
``velocity`` at every step:

- The prompt is a chat template cut into segments around the condition images (k images: k + 2 segments; none:
  one), each encoded to its own length by the pipeline's ``encode_prompt``. The encoding depends on how many
  images a sample has, so ``encode`` takes the conditions (``text_reads_conditions``). The conditioning holds a
  sample's segments one after another (``prompt_embeds`` and its mask) with their lengths
  (``prompt_embeds_segments``).
- Each condition image is resized as the pipeline resizes it: one of over 1024^2 pixels down to the generated
  image's area (the pipeline's, called with a height and width), or, with ``condition_image_size``, one over its
  area down to it (Flow-Factory's); then floored to multiples of 16 and centre-cropped. The cropped image is
  VAE-encoded (the distribution's mode, shifted and scaled: the clean latents the transformer reads at time 1);
  the one before the crop (kept in ``ConditionMedia.originals``) is what SigLIP2 reads, a grid of patch states.
  Both are stored ragged, zero-padded, with each image's grid size.
- ``velocity`` gives the transformer, per sample, the condition latents then the noisy latents (noise mask 0,
  then 1), the segments, and the SigLIP states followed by the pipeline's None for the generated image. The
  transformer skips SigLIP for a whole call when its first sample has none, so one call takes samples that all
  have condition images or all have none (``call_shape``).

The pipeline casts a condition image to bfloat16 for its VAE, so it runs only with a bfloat16 VAE (the
release's dtype); the adapter encodes in the VAE's own dtype, which is that for a bfloat16 VAE. Guidance is
Z-Image's, both branches on the same conditions; the pipeline's ``cfg_normalization`` and ``cfg_truncation``
stay at their defaults (off).
"""

from __future__ import annotations

import torch
from diffusers import ZImageOmniPipeline
from torch import Tensor

from ..config.families import MODEL_FAMILIES
from .conditioning import ConditionMedia, Conditioning, pad_cat
from .text import pad_text
from .z_image import ZImageAdapter

PIPELINE_AREA = 1024 * 1024  # the pipeline resizes a condition image of more pixels than this


class ZImageOmniAdapter(ZImageAdapter):
    model_type = "z-image-omni"
    pipeline_class = ZImageOmniPipeline
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor
    condition_inputs = ("images",)  # optional: a row without any is text-to-image
    conditions_per_sample = (0, 10)  # the pipeline sets no limit; FLUX.2's multi-reference one
    text_reads_conditions = True  # the prompt's template has a segment per condition image

    def __init__(self, pipeline, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__(pipeline, device, dtype)
        pipeline.siglip.requires_grad_(False)

    def condition_encoders(self) -> dict:
        return {**super().condition_encoders(), "siglip": self.pipeline.siglip,
                "siglip_processor": self.pipeline.siglip_processor}

    # --- the text, in segments around the condition images ---------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None = None, guidance_scale: float = 0.0,
               conditions: ConditionMedia | None = None) -> Conditioning:
        counts = [len(s) for s in conditions.images] if conditions is not None else [0] * len(prompts)
        branches = {"": prompts}
        if self.uses_cfg(guidance_scale):  # the pipeline's negative is "" unless given, with the same images
            branches["negative_"] = negative_prompts if negative_prompts is not None else [""] * len(prompts)
        rows = {prefix: self._segments(list(texts), counts) for prefix, texts in branches.items()}
        # both branches padded to one length, the longest prompt's (a sample's segments one after another)
        longest = max(sum(len(s) for s in segments) for branch in rows.values() for segments in branch)
        cond = {}
        for prefix, branch in rows.items():
            key = f"{prefix}prompt_embeds"
            cond[key], cond[f"{key}_mask"] = pad_text([torch.cat(segments) for segments in branch], longest)
            cond[f"{key}_segments"] = pad_cat([torch.tensor([len(s) for s in segments]) for segments in branch],
                                              stack=True).to(self.device)
        return cond

    def _segments(self, texts: list[str], counts: list[int]) -> list[list[Tensor]]:
        """Each prompt's segments (L_j, D), encoded by the pipeline with the number of images of its sample; one
        call per number, as the pipeline encodes a batch that shares its images."""
        rows: list = [None] * len(texts)
        for k in sorted(set(counts)):
            index = [i for i, c in enumerate(counts) if c == k]
            embeds, _ = self.pipeline.encode_prompt(
                prompt=[texts[i] for i in index], device=self.device, do_classifier_free_guidance=False,
                max_sequence_length=self.max_sequence_length, num_condition_images=k)
            for i, segments in zip(index, embeds):
                rows[i] = segments
        return rows

    def _caption_segments(self, cond: Conditioning, key: str) -> list[list[Tensor]]:
        lengths = cond[f"{key}_segments"].tolist()
        return [list(row.split([n for n in sizes if n])) for row, sizes in zip(self._captions(cond, key), lengths)]

    # --- the condition images ----------------------------------------------------------------------
    @classmethod
    def call_shape(cls, sizes, condition_size) -> tuple:
        return ("with condition images",) if sizes else ("without condition images",)

    def prepare_conditions(self, images, videos, height, width, num_frames, condition_size) -> ConditionMedia:
        """Each image cropped as the pipeline preprocesses it, in [0, 1] (a sample without any: (0, 3, H, W));
        ``originals``: each before the crop, what SigLIP reads."""
        processor, multiple = self.pipeline.image_processor, self.pipeline.vae_scale_factor * 2
        # the pipeline's: over 1024^2 pixels, down to the generated area; Flow-Factory's condition_image_size: over
        # its area, down to it
        limit, area = ((condition_size[0] * condition_size[1],) * 2 if condition_size
                       else (PIPELINE_AREA, height * width))
        shown, seen = [], []
        for sample in images:
            resized = [processor._resize_to_target_area(im, area) if im.width * im.height > limit else im
                       for im in sample]
            cropped = [processor.numpy_to_pt(processor.pil_to_numpy([processor.resize(
                im, im.height // multiple * multiple, im.width // multiple * multiple, resize_mode="crop")]))[0]
                for im in resized]
            sizes = {tuple(c.shape) for c in cropped}
            shown.append(torch.stack(cropped) if len(sizes) == 1 else cropped if cropped
                         else torch.zeros(0, 3, height, width))
            seen.append(resized)
        return ConditionMedia(images=shown, originals=seen)

    @torch.no_grad()
    def encode_conditions(self, media: ConditionMedia, height, width, num_frames) -> Conditioning:
        """Per sample, its images' VAE latents (k, C, h, w) and SigLIP states (k, rows, cols, D), zero-padded to
        the batch's largest, with each one's grid size (k, 2)."""
        latents, states = [], []
        for shown, seen in zip(media.images, media.originals):
            latents.append([self._vae_latents(image) for image in shown])
            states.append([self.pipeline.prepare_siglip_embeds([image], 1, self.device, torch.float32)[0][0]
                           for image in seen])
        cond = {}
        for key, grids in (("condition_latents", latents), ("condition_siglip", states)):
            spatial = slice(1, 3) if key == "condition_latents" else slice(0, 2)
            cond[key] = pad_cat([pad_cat([g[None] for g in sample]) if sample else torch.zeros(0, 1, 1, 1)
                                 for sample in grids], stack=True).to(self.device)
            cond[f"{key}_sizes"] = pad_cat([torch.tensor([g.shape[spatial] for g in sample], dtype=torch.long)
                                            .reshape(-1, 2) for sample in grids], stack=True).to(self.device)
        return cond

    def _vae_latents(self, image: Tensor) -> Tensor:
        """``prepare_image_latents``' encoding of one image (3, h, w) in [0, 1], in the VAE's dtype: (C, h/8, w/8)."""
        vae = self.pipeline.vae
        # in the memory layout of the pipeline's preprocessed image ((1, H, W, 3) permuted, as numpy_to_pt makes
        # it): a convolution's result can depend on it (bfloat16 on a CPU)
        pixels = (image.permute(1, 2, 0)[None].contiguous() * 2 - 1).permute(0, 3, 1, 2).to(self.device, vae.dtype)
        z = vae.encode(pixels).latent_dist.mode()[0]
        return ((z - vae.config.shift_factor) * vae.config.scaling_factor).float()

    def _condition_lists(self, cond: Conditioning, n: int) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
        """Each sample's condition latents (C, 1, h, w) and SigLIP states (rows, cols, D), the padding cut off."""
        if "condition_latents" not in cond:
            return [[] for _ in range(n)], [[] for _ in range(n)]
        latents, states = [], []
        for i in range(n):
            latents.append([z[:, :h, :w].unsqueeze(1).to(self.device, self.dtype) for z, (h, w) in
                            zip(cond["condition_latents"][i], cond["condition_latents_sizes"][i].tolist()) if h])
            states.append([s[:r, :c].to(self.device, self.dtype) for s, (r, c) in
                           zip(cond["condition_siglip"][i], cond["condition_siglip_sizes"][i].tolist()) if r])
        if len({bool(s) for s in latents}) > 1:
            raise ValueError(f"{self.model_type}: the samples of one transformer call must all have condition images "
                             "or all have none (the transformer reads SigLIP states for all or none); set "
                             "per_device_batch_size: 1")
        return latents, states

    def _transformer(self, x: Tensor, t: Tensor, cond: Conditioning, branches: tuple[str, ...]) -> list[Tensor]:
        noisy = list(x.unsqueeze(2).unbind(0))
        latents, states = self._condition_lists(cond, len(noisy))
        images, captions, siglip, noise_masks = [], [], [], []
        for prefix in branches:  # [cond..., uncond...], each branch with the same condition images
            captions += self._caption_segments(cond, f"{prefix}prompt_embeds")
            for z, given, seen in zip(noisy, latents, states):
                images.append([*given, z])
                noise_masks.append([0] * len(given) + [1])
                siglip.append([*seen, None] if seen else None)
        return self.denoiser(x=images, t=t.repeat(len(branches)), cap_feats=captions, siglip_feats=siglip,
                             image_noise_mask=noise_masks, return_dict=False)[0]
