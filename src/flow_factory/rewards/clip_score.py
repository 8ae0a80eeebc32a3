"""CLIP score: cosine similarity of the prompt's and the image's CLIP embeddings
(openai/clip-vit-large-patch14 by default), in [-1, 1]. A video scores the mean over frames."""

from __future__ import annotations

import torch

from .base import PointwiseRewardModel, RewardModelOutput
from .clip_common import clip_sources, flatten_media, image_embeddings, load_clip, mean_per_sample, text_embeddings

CLIP_MODEL = "openai/clip-vit-large-patch14"


class ClipScore(PointwiseRewardModel):
    required_fields = ("prompt", "image", "video")

    def __init__(self, model_name_or_path: str | None = None, device="cpu", dtype=torch.float32,
                 batch_size: int = 16, processor_name_or_path: str | None = None):
        super().__init__(model_name_or_path or CLIP_MODEL, device, dtype, batch_size)
        load_clip(self, self.model_name_or_path, processor_name_or_path or self.model_name_or_path)

    @classmethod
    def models_to_load(cls, options: dict) -> list[str]:
        return clip_sources(options, CLIP_MODEL)

    def __call__(self, prompt, image=None, video=None) -> RewardModelOutput:
        pictures, owner = flatten_media("CLIP", image, video)
        img = image_embeddings(self, pictures)
        txt = text_embeddings(self, list(prompt))[owner].to(img.device)
        return RewardModelOutput(rewards=mean_per_sample((img * txt).sum(-1).cpu(), owner, len(prompt)))
