"""OCR reward, as flow_grpo's: how well the image shows the text quoted in its prompt.

The target is the first double-quoted span of the prompt (``a sign that says "OPEN"`` ->
``OPEN``). Spaces are dropped and both sides lower-cased; the reward is 1 when the target
appears in the recognised text, else ``1 - min(d, len(target)) / len(target)`` with ``d``
the Levenshtein distance between recognised text and target. Text lines PaddleOCR
recognises with confidence 0 are ignored. A prompt without a quoted span scores 0.

PaddleOCR is optional (``pip install paddleocr paddlepaddle``); ``ocr_reward`` is pure
and takes recognised text, so it can be used with any engine.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import PointwiseRewardModel, RewardModelOutput

INSTALL = "pip install paddleocr paddlepaddle"


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def quoted_text(prompt: str) -> str | None:
    parts = prompt.split('"')
    return parts[1] if len(parts) >= 3 else None


def ocr_reward(prompt: str, recognised: str) -> float:
    target = quoted_text(prompt)
    if target is None:
        return 0.0
    target = target.replace(" ", "").lower()
    found = recognised.replace(" ", "").lower()
    if not target:
        return 0.0
    if target in found:
        return 1.0
    return 1.0 - min(levenshtein(found, target), len(target)) / len(target)


def paddle_text(result) -> str:
    """Text of one image from what PaddleOCR 2.x ``ocr(image)`` returns: ``[lines]`` with each
    line ``[box, (text, confidence)]``, or ``[None]`` when nothing was found. Lines with
    confidence 0 are dropped and the rest concatenated in reading order."""
    lines = result[0] if result else None
    return "".join(text for _, (text, conf) in (lines or []) if conf > 0)


class OcrReward(PointwiseRewardModel):
    required_fields = ("prompt", "image")

    def __init__(self, model_name_or_path: str | None = None, device="cpu", dtype=torch.float32,
                 batch_size: int = 16, lang: str = "en"):
        super().__init__(model_name_or_path, device, dtype, batch_size)
        try:
            from paddleocr import PaddleOCR
        except ImportError as e:
            raise ImportError(f"the ocr reward needs PaddleOCR, which is not installed: {INSTALL}") from e
        self.engine = PaddleOCR(use_angle_cls=False, lang=lang, use_gpu=self.device.type == "cuda",
                                show_log=False)

    def __call__(self, prompt, image=None) -> RewardModelOutput:
        if image is None:
            raise ValueError("ocr needs images")
        texts = [paddle_text(self.engine.ocr(np.asarray(im), cls=False)) for im in image]
        return RewardModelOutput(rewards=[ocr_reward(p, t) for p, t in zip(prompt, texts)],
                                 extra_info={"text": texts})
