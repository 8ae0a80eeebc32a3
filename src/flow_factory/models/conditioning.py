"""Conditioning (a dict of batch-first tensors) and condition media (a conditioned model's images or videos as it
sees them), per sample: sliced, joined, padded, and the condition images resized as the pipelines resize them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

Conditioning = dict[str, Tensor]


@dataclass
class ConditionMedia:
    """A batch's condition files as the model sees them (resized as its pipeline resizes them), in [0, 1]:
    what the rewards get as ``condition_images`` / ``condition_videos`` and what the sample grids show."""

    images: list[Tensor] | None = None  # per sample, (k, 3, H, W), or a list of (3, H, W) when their sizes differ
    videos: list[Tensor] | None = None  # per sample, (k, F, 3, H, W)
    # per sample, the condition images as read (RGB PIL): for a model that resizes them once more for another
    # encoder (Qwen-Image-Edit-Plus's vision-language text encoder), from the originals as its pipeline does
    originals: list[list] | None = None

    def take(self, rows: list[int]) -> "ConditionMedia":
        """The media of samples ``rows``, in that order."""
        return ConditionMedia(*(None if v is None else [v[i] for i in rows]
                                for v in (self.images, self.videos, self.originals)))

    @classmethod
    def concat(cls, parts: list["ConditionMedia"]) -> "ConditionMedia":
        """The samples of ``parts`` one after another."""
        def join(name):
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else [x for v in values for x in v]
        return cls(join("images"), join("videos"), join("originals"))

    def per_sample(self) -> list[list[Tensor]]:
        """Each sample's condition images (3, H, W) and videos (F, 3, H, W), one list per sample (sample grids)."""
        n = len(self.images if self.images is not None else self.videos or [])
        return [[*(self.images[i] if self.images is not None else []),
                 *(self.videos[i] if self.videos is not None else [])] for i in range(n)]


def resized_images(processor, images: list[list], height: int, width: int) -> ConditionMedia:
    """Each sample's condition images (RGB PIL) at (height, width) in [0, 1], as a pipeline's ``VaeImageProcessor``
    resizes and converts them (its preprocess minus the final 2x - 1)."""
    return ConditionMedia(images=[processor.numpy_to_pt(processor.pil_to_numpy(
        [processor.resize(image, height, width) for image in sample])) for sample in images])


def as_pil(images: Tensor) -> list:
    """(k, 3, H, W) in [0, 1] that came from 8-bit images, back to those RGB PIL images (exactly)."""
    from PIL import Image

    pixels = (images * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(p) for p in pixels]


def index_cond(cond: Conditioning, idx) -> Conditioning:
    return {k: v[idx] for k, v in cond.items()}


def cat_cond(conds: list[Conditioning]) -> Conditioning:
    """The samples of ``conds`` one after another; an entry whose lengths differ between them (a ragged condition,
    such as Qwen-Image-Edit-Plus's image tokens) is padded with zeros to the longest, each dim after the first."""
    return {k: pad_cat([c[k] for c in conds]) for k in conds[0]}


def pad_cat(tensors: list[Tensor], stack: bool = False) -> Tensor:
    """``torch.cat`` (``stack``: ``torch.stack``) of tensors of one rank, zero-padded at the end of each dim (after
    the batch dim) to the largest: a model whose entries differ in length keeps their real lengths beside them."""
    parts = [t[None] for t in tensors] if stack else tensors
    size = [max(t.shape[d] for t in parts) for d in range(1, parts[0].ndim)]
    if all(list(t.shape[1:]) == size for t in parts):
        return torch.cat(parts)
    padded = []
    for t in parts:
        grown = t.new_zeros(t.shape[0], *size)
        grown[(slice(None), *(slice(0, n) for n in t.shape[1:]))] = t
        padded.append(grown)
    return torch.cat(padded)
