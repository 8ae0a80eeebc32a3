"""JPEG compressibility: smaller JPEG files score higher.

As flow_grpo computes it: the image is quantised to uint8 (``round(x * 255)``),
saved as JPEG at quality 95 with PIL, and the reward is ``-(size in kB) / 500``
with 1 kB = 1000 bytes. A video scores the mean over its frames.
Needs no model, so it is the reward the tests and the demo train on.
"""

from __future__ import annotations

import io

import torch
from PIL import Image

from .base import PointwiseRewardModel, RewardModelOutput


def jpeg_size_kb(image: Image.Image, quality: int = 95) -> float:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.tell() / 1000


class JpegCompressibility(PointwiseRewardModel):
    required_fields = ("image", "video")
    use_tensor_inputs = False

    # flow_grpo's divisor; kept so reward curves compare with its published runs
    SCALE_KB = 500.0

    def __init__(self, model_name_or_path: str | None = None, device="cpu", dtype=torch.float32,
                 batch_size: int = 64, quality: int = 95):
        super().__init__(model_name_or_path, device, dtype, batch_size)
        if not 1 <= int(quality) <= 100:
            raise ValueError(f"jpeg_compressibility: quality must be in [1, 100], got {quality}")
        self.quality = int(quality)

    def _reward(self, image: Image.Image) -> float:
        return -jpeg_size_kb(image, self.quality) / self.SCALE_KB

    def __call__(self, prompt=None, image=None, video=None, condition_images=None,
                 condition_videos=None) -> RewardModelOutput:
        if image is not None:
            rewards = [self._reward(im) for im in image]
        elif video is not None:
            rewards = [sum(self._reward(f) for f in frames) / len(frames) for frames in video]
        else:
            raise ValueError("jpeg_compressibility needs images or videos; got neither")
        return RewardModelOutput(rewards=torch.tensor(rewards, dtype=torch.float32))
