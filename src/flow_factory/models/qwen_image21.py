"""Qwen-Image-2.1 (``QwenImage21Pipeline``), model_type ``qwen-image-2.1``: text to image.

What it shares with Qwen-Image (``QwenImageAdapter``, whose ``encode`` it keeps): ``guidance_scale`` is the
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
Condition images (the pipeline's ``image``) are not taken yet.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from diffusers import QwenImage21Pipeline
from torch import Tensor

from ..config.families import MODEL_FAMILIES
from .conditioning import Conditioning
from .qwen_image import QwenImageAdapter
from .qwen_image_edit import load_pipeline
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

    @classmethod
    def from_pretrained(cls, path: str, device="cpu", dtype: torch.dtype = torch.float32) -> "QwenImage21Adapter":
        return cls(load_pipeline(path, dtype, QwenImage21Pipeline, "Qwen3VLProcessor"), device, dtype)

    @staticmethod
    def pixel_factor_of(vae: Mapping, transformer: Mapping) -> int | None:
        # the VAE halves the size at each downsampling stage (four: x16), then an image slot covers 2x2 latents
        if "temperal_downsample" not in vae:
            return None
        return 2 ** len(vae["temperal_downsample"]) * _SLOT * transformer.get("patch_size", 1)

    def tokenizers(self) -> dict:
        # the pipeline has no tokenizer slot: its processor holds the tokenizer the prompt cache fingerprints
        processor = getattr(self.pipeline, "processor", None)
        return {"processor": processor.tokenizer} if processor is not None else {}

    def _encode_text(self, prompts: list[str]) -> Conditioning:
        embeds, mask, _ = self.pipeline.encode_prompt(prompt=list(prompts), device=self.device)
        # the pipeline pads to the batch's longest prompt and gives no mask when nothing was padded
        lengths = mask.sum(1).tolist() if mask is not None else [embeds.shape[1]] * len(embeds)
        embeds, mask = pad_text([e[:n] for e, n in zip(embeds, lengths)], self.max_sequence_length)
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

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
        cfg, x, t, (embeds, mask) = self.cfg_inputs(cond, guidance_scale, x, t,
                                                    ("prompt_embeds", "prompt_embeds_mask"))
        lengths = mask.sum(1).tolist()
        out = torch.empty(x.shape, dtype=torch.float32, device=self.device)
        for length in sorted(set(lengths)):  # the rows of one text length: one call, each as alone
            rows = torch.tensor([i for i, k in enumerate(lengths) if k == length], device=self.device)
            text, _ = trim_text(embeds[rows].to(self.device, self.dtype), mask[rows].to(self.device))
            out[rows] = self._transformer_call(x[rows], t[rows], text, (h, w))
        if cfg:
            out = self.combine_cfg(out, guidance_scale)
        s = self.pipeline.vae_scale_factor
        return pipe._unpack_latents(out, h * s, w * s, s).squeeze(2)

    def _transformer_call(self, x: Tensor, t: Tensor, text: Tensor, grid: tuple[int, int]) -> Tensor:
        """The pipeline's transformer call for prompts of one length without padding (no mask, as it passes
        none then) and no condition image: the text's slots, then one slot per 2x2 of the image's tokens."""
        slots = torch.cat([torch.zeros(len(x), text.shape[1], dtype=torch.bool, device=self.device),
                           torch.ones(len(x), x.shape[1] // _SLOT**2, dtype=torch.bool, device=self.device)], 1)
        return self.denoiser(
            hidden_states=x,
            timestep=t.to(self.dtype) / 1000,  # the pipeline's 1000 sigma / 1000, for the same rounding
            encoder_hidden_states=text,
            img_shapes=[[(1, *grid)]] * len(x),
            img_mask=slots,
            return_dict=False,
        )[0][:, -x.shape[1]:].float()

    def decode(self, latents: Tensor) -> Tensor:
        rgba = decode_normalized(self.pipeline.vae, latents.unsqueeze(2), self.device)[:, :, 0]
        rgb, alpha = rgba[:, :3], rgba[:, 3:]
        return rgb * alpha + (1 - alpha)  # over white

    def encode_media(self, media: Tensor) -> Tensor:
        opaque = torch.cat([media, torch.ones_like(media[:, :1])], 1)  # RGB images as opaque RGBA
        return encode_normalized(self.pipeline.vae, opaque.unsqueeze(2), self.device)[:, :, 0]
