"""Qwen-Image-Edit-Plus (``QwenImageEditPlusPipeline``), model_type ``qwen-image-edit-plus``: image editing
from one to three condition images per sample.

Qwen-Image with two additions, both computed once per sample (``encode`` with the conditions,
``encode_conditions``) and read by ``velocity`` at every step:

- The text encoder, Qwen2.5-VL, reads the prompt AND the condition images ("Picture 1: <image> ..."), each
  resized by the pipeline to about ``CONDITION_IMAGE_SIZE`` pixels (384^2) at its own aspect ratio. A prompt's
  embedding therefore depends on its images: ``text_reads_conditions``, so the prompt cache never answers
  for it, and the condition cache keys it by prompt and files.
- Each condition image, resized to about ``VAE_IMAGE_SIZE`` pixels (1024^2) at its own aspect ratio, is
  VAE-encoded (the distribution's mode), packed into 2x2 tokens and appended to the latents' tokens;
  ``img_shapes`` lists the grids, the generated image's first. The prediction for the latents' own tokens
  is kept. ``condition_image_size`` (train / eval) sets that area instead, as Flow-Factory's does.

Ragged: a sample's condition images keep their own sizes, so the conditioning stores each sample's image tokens
one after another (``image_latents``) with their grids (``image_shapes``, (k, 2) token rows and columns, zero
rows where a sample has fewer images); ``cat_cond`` pads across samples. The transformer takes one
``img_shapes`` for a whole batch (diffusers uses the first sample's), so one transformer call takes samples
whose conditions have the same shapes (``per_device_batch_size: 1``, as Flow-Factory's examples set it, takes
any). Both encoders' images are resized from the files' images (``ConditionMedia.originals``), as the pipeline
resizes them; the rewards and grids see the VAE's.
"""

from __future__ import annotations

import logging

import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus
from torch import Tensor

from ..config.families import MODEL_FAMILIES
from .base import JOINT_ATTENTION_LORA_TARGETS
from .conditioning import ConditionMedia, Conditioning
from .text import pad_text
from .qwen_image import QwenImageAdapter

logger = logging.getLogger(__name__)


def image_only_processor(image_processor, tokenizer, processor_class: str = "Qwen2VLProcessor"):
    """A ``Qwen2VLProcessor`` (or another Qwen-VL processor class of transformers: Qwen-Image-2.1's
    ``Qwen3VLProcessor``) of these two parts without its video processor, for a machine without torchvision
    (transformers' processor needs it for the video processor alone). Its chat template is the tokenizer's.

    What differs from the real one: no videos (Qwen-Image-Edit-Plus passes none), and the image processor is
    transformers' PIL backend (``Qwen2VLImageProcessorPil``), whose resize can differ from the torchvision
    backend's by rounding; the prompt template, the tokens and the patches are the same."""
    import transformers

    class ImageOnlyProcessor(getattr(transformers, processor_class)):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None  # the check transformers cannot make without torchvision
            return super().check_argument_for_proper_class(argument_name, argument)

    ImageOnlyProcessor.__name__ = ImageOnlyProcessor.__qualname__ = f"ImageOnly{processor_class}"
    return ImageOnlyProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                              chat_template=getattr(tokenizer, "chat_template", None))


def load_pipeline(path, dtype: torch.dtype = torch.float32, pipeline_class=QwenImageEditPlusPipeline,
                  processor_class: str = "Qwen2VLProcessor", **kwargs):
    """``pipeline_class.from_pretrained``; without torchvision, with ``image_only_processor`` of the checkpoint's
    ``processor`` folder (a warning says so)."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available() and "processor" not in kwargs:
        logger.warning("%s: torchvision is not installed, so transformers cannot load the %s; using its image "
                       "processor (PIL backend) and tokenizer without it", pipeline_class.__name__, processor_class)
        kwargs["processor"] = image_only_processor(Qwen2VLImageProcessor.from_pretrained(path, subfolder="processor"),
                                                   AutoTokenizer.from_pretrained(path, subfolder="processor"),
                                                   processor_class)
    return pipeline_class.from_pretrained(path, dtype=dtype, **kwargs)


def sizes_at_area(model_type: str, sizes, area: int, calculate_dimensions) -> tuple:
    """Each (width, height) brought to ``area`` pixels at its own aspect ratio by the pipeline's
    ``calculate_dimensions`` (Qwen-Image-Edit-Plus's, Qwen-Image-2.1's: multiples of 32); ValueError for one that
    comes out empty."""
    resized = tuple(tuple(calculate_dimensions(area, w / h)[:2]) for w, h in sizes)
    for (w, h), (new_w, new_h) in zip(sizes, resized):
        if not (new_w and new_h):
            raise ValueError(f"{model_type}: a {w}x{h} condition image resized to an area of {area} pixels is "
                             f"{new_w}x{new_h}; give images of a less extreme aspect ratio")
    return resized


class QwenImageEditPlusAdapter(QwenImageAdapter):
    model_type = "qwen-image-edit-plus"
    pipeline_class = QwenImageEditPlusPipeline
    pixel_factor = MODEL_FAMILIES[model_type].pixel_factor
    # Flow-Factory's: both streams' attention projections and both feed-forward layers of each stream
    default_lora_targets = [*JOINT_ATTENTION_LORA_TARGETS, "net.0.proj", "net.2"]
    condition_inputs = ("images",)
    conditions_per_sample = (1, 3)  # the model card's 1 to 3 input images
    auto_resize = True  # Flow-Factory's examples: generate at the (last) condition image's aspect ratio
    text_reads_conditions = True
    max_sequence_length = 1024  # the pipeline's tokenizer_max_length

    @classmethod
    def from_pretrained(cls, path: str, device="cpu", dtype: torch.dtype = torch.float32) -> "QwenImageEditPlusAdapter":
        return cls(load_pipeline(path, dtype), device, dtype)

    def condition_encoders(self) -> dict:
        processor = getattr(self.pipeline, "processor", None)
        found = {"vae": self.pipeline.vae, "image_processor": self.pipeline.image_processor}
        return {**found, "vl_image_processor": processor.image_processor} if processor is not None else found

    # --- the conditions -----------------------------------------------------------------------
    @classmethod
    def call_shape(cls, sizes, condition_size) -> tuple:
        """Each image's (width, height) at ``condition_size``'s area (default the pipeline's ``VAE_IMAGE_SIZE``) and
        its own aspect ratio, in multiples of 32 (``calculate_dimensions``)."""
        area = condition_size[0] * condition_size[1] if condition_size else edit_plus.VAE_IMAGE_SIZE
        return sizes_at_area(cls.model_type, sizes, area, edit_plus.calculate_dimensions)

    def prepare_conditions(self, images, videos, height, width, num_frames, condition_size) -> ConditionMedia:
        """Each image at its ``call_shape``, as the pipeline resizes it; one sample's images stack when they agree."""
        processor, per_sample = self.pipeline.image_processor, []
        for sample in images:
            shown = []
            for image, (w, h) in zip(sample, self.call_shape([im.size for im in sample], condition_size)):
                shown.append(processor.numpy_to_pt(processor.pil_to_numpy([processor.resize(image, h, w)]))[0])
            sizes = {tuple(s.shape) for s in shown}
            per_sample.append(torch.stack(shown) if len(sizes) == 1 else shown)
        return ConditionMedia(images=per_sample, originals=[list(sample) for sample in images])

    @torch.no_grad()
    def encode_conditions(self, media: ConditionMedia, height, width, num_frames) -> Conditioning:
        tokens, shapes = [], []
        for sample in media.images:
            packed, grid = [], []
            for image in sample:  # one at a time, as the pipeline encodes them
                pixels = (image[None, :, None] * 2 - 1).to(self.device, self.pipeline.vae.dtype)
                latents = self.pipeline._encode_vae_image(pixels, generator=None)[:, :, 0]  # its mode
                _, c, h, w = latents.shape
                packed.append(self.pipeline._pack_latents(latents, 1, c, h, w)[0])
                grid.append((h // 2, w // 2))
            tokens.append(torch.cat(packed))
            shapes.append(torch.tensor(grid))
        image_latents, _ = pad_text(tokens, max(len(t) for t in tokens))
        image_shapes, _ = pad_text(shapes, max(len(s) for s in shapes))
        return {"image_latents": image_latents, "image_shapes": image_shapes.long()}

    # --- the text, read with the conditions ----------------------------------------------------
    @torch.no_grad()
    def encode(self, prompts: list[str], negative_prompts: list[str] | None = None, guidance_scale: float = 4.0,
               conditions: ConditionMedia | None = None) -> Conditioning:
        if conditions is None:
            raise ValueError(f"{self.model_type} encodes each prompt with its condition images: encode(..., "
                             "conditions=prepare_conditions(...))")
        seen = [self._encoder_images(sample) for sample in conditions.originals]
        branches = {"": self._encode_with(prompts, seen)}
        if self.uses_cfg(guidance_scale):  # the pipeline encodes the negative prompt with the same images
            negatives = negative_prompts if negative_prompts is not None else [""] * len(prompts)
            branches["negative_"] = self._encode_with(negatives, seen)
        # both branches padded to one length, so that one transformer call takes them (cfg_inputs)
        longest = max(len(r) for rows in branches.values() for r in rows)
        if longest > self.max_sequence_length:
            raise ValueError(f"{self.model_type}: a prompt with its condition images is {longest} tokens, over the "
                             f"pipeline's {self.max_sequence_length}")
        cond = {}
        for prefix, rows in branches.items():
            cond[f"{prefix}prompt_embeds"], cond[f"{prefix}prompt_embeds_mask"] = pad_text(rows, longest)
        return cond

    def _encoder_images(self, sample: list) -> list:
        """A sample's images (as read) as the pipeline gives them to the VL encoder: at ``CONDITION_IMAGE_SIZE``'s
        area and their own aspect ratios."""
        out = []
        for image in sample:
            w, h = edit_plus.calculate_dimensions(edit_plus.CONDITION_IMAGE_SIZE, image.width / image.height)
            out.append(self.pipeline.image_processor.resize(image, h, w))
        return out

    def _encode_with(self, prompts: list[str], images: list[list]) -> list[Tensor]:
        """Each prompt's embedding (L_i, D), read with its sample's images: one call each, as the pipeline takes."""
        return [self.pipeline.encode_prompt(prompt=[prompt], image=seen, device=self.device)[0][0]
                for prompt, seen in zip(prompts, images)]

    def with_condition_tokens(self, packed: Tensor, cond: Conditioning) -> tuple[Tensor, list[tuple[int, int, int]]]:
        shapes = cond["image_shapes"]
        if not (shapes == shapes[:1]).all():
            raise ValueError(f"{self.model_type}: the samples of one transformer call must have condition images of "
                             f"the same sizes (its img_shapes are one for the batch); got {shapes.tolist()}; set "
                             "per_device_batch_size: 1, or give conditions of one size")
        grids = [(1, int(a), int(b)) for a, b in shapes[0].tolist() if a]
        image = cond["image_latents"][:, :sum(a * b for _, a, b in grids)]
        return torch.cat([packed, image.to(self.device, self.dtype)], dim=1), grids
