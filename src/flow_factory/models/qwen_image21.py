"""Qwen-Image-2.1 (``QwenImage21Pipeline``), model_type ``qwen-image-2.1``: images from text, or from condition
images a row names.

What it shares with Qwen-Image (``QwenImageAdapter``, its base class): ``guidance_scale`` is the
pipeline's ``true_cfg_scale`` (a second branch from the negative prompt, "" when none is given, above 1; the
released model is meant to be sampled at 1), each prompt keeps its own length (padded to
``max_sequence_length`` with its mask in the conditioning), and the schedule shifts with the number of image
tokens. What differs, all read from diffusers' pipeline:

- The text encoder is Qwen3-VL behind a ``Qwen3VLProcessor`` (its ``encode_prompt``; without torchvision the
  processor is built without its video processor, ``qwen_image_edit.image_only_processor``).
- The VAE is x16 with 64 latent channels and four image channels (RGBA). Latents stay (B, 64, H/16, W/16)
  outside this file; ``velocity`` flattens them into one token each (the pipeline's ``_pack_latents``), and the
  text encoder's image slots stand for 2x2 of them, so sizes are multiples of 32. ``decode`` puts the alpha
  channel over white (the pipeline does so for the images its encoder reads), so rewards see RGB.
- One single-stream, block-causal transformer reads text then image in one sequence, and the image's rotary
  positions start where the text ends: a prompt's padding would move them, so the pipeline's batch of prompts
  of different lengths is not its prompts alone. ``velocity`` therefore calls the transformer once per text
  length in the batch (CFG branches included), which gives each sample what the pipeline gives it alone, and
  never passes the pipeline's KV cache (exact within one step, kept out of training as upstream does).
- CFG is the plain mix, without Qwen-Image's norm rescale.

Sigmas: the pipeline's ``sample_sigmas`` when the checkpoint configures a grid of ``num_steps`` steps (what its
``__call__`` uses), else its unconfigured ``linspace(1, 1/n, n)``, shifted by the token count as it shifts them.

Condition images (the pipeline's ``image``; optional, a row without any is text to image): each is resized to
``condition_image_size``'s area (default the pipeline's ``output_resolution``, 1024^2) at its own aspect ratio in
multiples of 32 (its ``calculate_dimensions``), as RGBA. Qwen3-VL reads them in the prompt (``encode`` with the
conditions: ``text_reads_conditions``), one image slot per 2x2 of their latents (``prompt_image_slots``); their VAE
latents (the mode, normalised: ``_encode_vae_image``), one token each, are stored ragged with their grids and go
before the generated image's tokens. ``velocity``'s calls are per text length and condition grids. The files are
read as RGB, so their alpha is 1.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import numpy as np
import torch
from diffusers import QwenImage21Pipeline
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions
from torch import Tensor

from ..config.families import MODEL_FAMILIES
from .conditioning import ConditionMedia, Conditioning
from .qwen_image import QwenImageAdapter
from .qwen_image_edit import load_pipeline, sizes_at_area
from .schedule import shifted_sigmas
from .text import pad_text, trim_text
from .vae import decode_normalized, encode_normalized

_SLOT = 2  # one text-encoder image slot stands for 2x2 latent tokens


class QwenImage21Adapter(QwenImageAdapter):
    model_type = "qwen-image-2.1"
    pipeline_class = QwenImage21Pipeline
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor
    # Flow-Factory's: every projection of each single-stream block (attention and SwiGLU)
    default_lora_targets = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.proj",
                            "img_mlp.gate_layer", "img_mlp.out"]
    latents_per_token = 1  # unpatched: one latent, one token
    text_encoder_names = ("text_encoder",)
    condition_inputs = ("images",)  # optional: a row without any is text to image
    conditions_per_sample = (0, 4)  # the pipeline sets no limit; each image adds its tokens to every step
    text_reads_conditions = True  # Qwen3-VL reads the images in the prompt
    # the pipeline's default condition area: output_resolution^2
    condition_side = inspect.signature(QwenImage21Pipeline.__call__).parameters["output_resolution"].default

    @classmethod
    def from_pretrained(cls, path: str, device="cpu", dtype: torch.dtype = torch.float32) -> "QwenImage21Adapter":
        return cls(load_pipeline(path, dtype, QwenImage21Pipeline, "Qwen3VLProcessor"), device, dtype)

    @staticmethod
    def pixel_factor_of(vae: Mapping, transformer: Mapping) -> int | None:
        # the VAE halves the size at each downsampling stage (four: x16), then an image slot covers 2x2 latents
        if "temperal_downsample" not in vae:
            return None
        return 2 ** len(vae["temperal_downsample"]) * _SLOT * transformer.get("patch_size", 1)

    def condition_encoders(self) -> dict:
        # the condition cache's fingerprint covers Qwen3-VL's image processor too: it reads the resized images
        processor = getattr(self.pipeline, "processor", None)
        found = super().condition_encoders()
        return {**found, "vl_image_processor": processor.image_processor} if processor is not None else found

    def tokenizers(self) -> dict:
        # the pipeline has no tokenizer slot: its processor holds the tokenizer the prompt cache fingerprints
        processor = getattr(self.pipeline, "processor", None)
        return {"processor": processor.tokenizer} if processor is not None else {}

    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None = None, guidance_scale: float = 4.0,
               conditions: ConditionMedia | None = None) -> Conditioning:
        images = conditions.originals if conditions is not None else None
        branches = {"": self._encode_rows(prompts, images if images is not None else [[] for _ in prompts])}
        if self.uses_cfg(guidance_scale):  # the pipeline encodes the negative prompt with the same images
            negatives = negative_prompts if negative_prompts is not None else [""] * len(prompts)
            branches["negative_"] = self._encode_rows(negatives, images if images is not None else [[]] * len(prompts))
        # max_sequence_length, or the longest with its images: both branches one length, for cfg_inputs
        length = max(self.max_sequence_length, *(len(e) for rows in branches.values() for e, _ in rows))
        cond = {}
        for prefix, rows in branches.items():
            embeds, mask = pad_text([e for e, _ in rows], length)
            slots, _ = pad_text([s[:, None] for _, s in rows], length)
            cond.update({f"{prefix}prompt_embeds": embeds, f"{prefix}prompt_embeds_mask": mask,
                         f"{prefix}prompt_image_slots": slots[..., 0]})
        return cond

    def _encode_rows(self, prompts: list[str], images: list[list]) -> list[tuple[Tensor, Tensor]]:
        """Each prompt read with its sample's images, one call each (the pipeline's layout for that sample alone):
        its embedding and which of its positions are image slots."""
        rows = []
        for prompt, seen in zip(prompts, images):
            embeds, _, slots = self.pipeline.encode_prompt(prompt=[prompt], image=seen or None, device=self.device)
            rows.append((embeds[0], slots[0]))
        return rows

    # --- the conditions -------------------------------------------------------------------------
    @classmethod
    def call_shape(cls, sizes, condition_size) -> None:
        """Nothing a call's samples must share (``velocity`` calls per layout); a row's sizes are checked."""
        cls.condition_sizes(sizes, condition_size)

    @classmethod
    def condition_sizes(cls, sizes, condition_size) -> tuple:
        """Each image's (width, height) at ``condition_size``'s area (default the pipeline's) and its own aspect
        ratio, in multiples of 32 (the pipeline's ``calculate_dimensions``)."""
        area = condition_size[0] * condition_size[1] if condition_size else cls.condition_side ** 2
        return sizes_at_area(cls.model_type, sizes, area, calculate_dimensions)

    def _resized(self, image, size):
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        return self.pipeline.image_processor.resize(rgba, width=size[0], height=size[1])

    def prepare_conditions(self, images, videos, height, width, num_frames, condition_size) -> ConditionMedia:
        """Each image resized as the pipeline resizes it, RGB in [0, 1] (a sample without any: (0, 3, H, W));
        ``originals``: the resized RGBA images, which Qwen3-VL reads (``encode``)."""
        processor, per_sample, resized = self.pipeline.image_processor, [], []
        for sample in images:
            sizes = self.condition_sizes([im.size for im in sample], condition_size)
            resized.append([self._resized(image, size) for image, size in zip(sample, sizes)])
            shown = [processor.numpy_to_pt(processor.pil_to_numpy([im]))[0, :3] for im in resized[-1]]
            same = len({tuple(s.shape) for s in shown}) <= 1
            per_sample.append((torch.stack(shown) if shown else torch.zeros(0, 3, height, width)) if same else shown)
        return ConditionMedia(images=per_sample, originals=resized)

    @torch.no_grad()
    def encode_conditions(self, media: ConditionMedia, height, width, num_frames) -> Conditioning:
        """Per sample, its images' latent tokens one after another and their (rows, columns) grids, zero-padded."""
        tokens, grids = [], []
        for sample in media.images:
            packed, grid = [torch.zeros(0, self.transformer.config.in_channels, device=self.device)], []
            for image in sample:  # one at a time, opaque RGBA, as the pipeline encodes them
                rgba = torch.cat([image, torch.ones_like(image[:1])])[None, :, None] * 2 - 1
                latents = self.pipeline._encode_vae_image(rgba.to(self.device, self.pipeline.vae.dtype), None)
                c, h, w = latents.shape[1], *latents.shape[-2:]
                packed.append(type(self.pipeline)._pack_latents(latents, 1, c, h, w)[0].float())
                grid.append((h, w))
            tokens.append(torch.cat(packed))
            grids.append(torch.tensor(grid, dtype=torch.long).reshape(-1, 2))
        image_latents, _ = pad_text(tokens, max(1, *(len(t) for t in tokens)))
        image_shapes, _ = pad_text(grids, max(1, *(len(g) for g in grids)))
        return {"image_latents": image_latents, "image_shapes": image_shapes.long()}

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> Tensor:
        self.check_size(height, width)
        tokens = (height // self.pipeline.vae_scale_factor) * (width // self.pipeline.vae_scale_factor)
        configured = self.pipeline.config.get("sample_sigmas")
        grid = configured if configured is not None and len(configured) == num_steps else \
            np.linspace(1.0, 1 / num_steps, num_steps)
        return shifted_sigmas(self.pipeline, num_steps, tokens, grid, self.device)

    def velocity(self, latents: Tensor, sigma: Tensor, cond: Conditioning, guidance_scale: float) -> Tensor:
        pipe = type(self.pipeline)
        n, c, h, w = latents.shape
        x = pipe._pack_latents(latents.to(self.device, self.dtype), n, c, h, w)
        t = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(n) * 1000
        cfg, x, t, (embeds, mask, slots) = self.cfg_inputs(cond, guidance_scale, x, t, (
            "prompt_embeds", "prompt_embeds_mask", "prompt_image_slots"))
        images, shapes = cond.get("image_latents"), cond.get("image_shapes")
        if images is None:
            images, shapes = x.new_zeros(len(x), 0, c), torch.zeros(len(x), 0, 2, dtype=torch.long)
        elif cfg:  # both branches see the same images
            images, shapes = images.repeat(2, 1, 1), shapes.repeat(2, 1, 1)
        # the rows of one text length and one set of condition grids: one call, each as alone
        keys = [(int(length), tuple((int(a), int(b)) for a, b in grid.tolist() if a))
                for length, grid in zip(mask.sum(1), shapes)]
        out = torch.empty(x.shape, dtype=torch.float32, device=self.device)
        for length, grids in sorted(set(keys)):
            rows = torch.tensor([i for i, k in enumerate(keys) if k == (length, grids)], device=self.device)
            text, _ = trim_text(embeds[rows].to(self.device, self.dtype), mask[rows].to(self.device))
            condition = images[rows, :sum(a * b for a, b in grids)].to(self.device, self.dtype)
            out[rows] = self._transformer_call(torch.cat([condition, x[rows]], 1), t[rows], text,
                                               slots[rows, :length].to(self.device), [*grids, (h, w)])
        if cfg:
            out = self.combine_cfg(out, guidance_scale)
        s = self.pipeline.vae_scale_factor
        return pipe._unpack_latents(out, h * s, w * s, s).squeeze(2)

    def _transformer_call(self, x: Tensor, t: Tensor, text: Tensor, slots: Tensor, grids: list) -> Tensor:
        """The pipeline's transformer call for prompts of one length without padding (no mask, as it passes none
        then) and one layout: condition tokens then the image's, the text's image slots then one slot per 2x2 of
        the image's tokens; the prediction for the image's own tokens."""
        tokens = grids[-1][0] * grids[-1][1]
        target = torch.ones(len(x), tokens // _SLOT**2, dtype=torch.bool, device=self.device)
        return self.denoiser(
            hidden_states=x,
            timestep=t.to(self.dtype) / 1000,  # the pipeline's 1000 sigma / 1000, for the same rounding
            encoder_hidden_states=text,
            img_shapes=[[(1, *grid) for grid in grids]] * len(x),
            img_mask=torch.cat([slots.bool(), target], 1),
            return_dict=False,
        )[0][:, -tokens:].float()

    def decode(self, latents: Tensor) -> Tensor:
        rgba = decode_normalized(self.pipeline.vae, latents.unsqueeze(2), self.device)[:, :, 0]
        rgb, alpha = rgba[:, :3], rgba[:, 3:]
        return rgb * alpha + (1 - alpha)  # over white

    def encode_media(self, media: Tensor) -> Tensor:
        opaque = torch.cat([media, torch.ones_like(media[:, :1])], 1)  # RGB images as opaque RGBA
        return encode_normalized(self.pipeline.vae, opaque.unsqueeze(2), self.device)[:, :, 0]
