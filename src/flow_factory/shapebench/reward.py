"""The ``shapebench`` verifiable reward: parse the prompt, analyse the pixels, check each clause.

A prompt's clauses (see prompts.py) each score 0 or 1 on the image's detections
(analysis.py). The *partial* score is their mean, as GenEval-style training
rewards give; the *strict* score is 1 only when every clause holds (GenEval's
accuracy) *and* the image holds nothing but the objects the prompt names (1, 2 or
the count). GenEval's object detector does not see objects in noise; a pixel
analysis does: without that condition, VAE-decoded Gaussian latents (about 9
coloured blobs each) scored strict 0.27 on the held-out prompts (every
"a photo of a triangle" passed, since an irregular blob's fill reads as a
triangle). The generator's own images always hold exactly the named objects.
The partial score keeps GenEval's clause mean. The RewardSet keeps one score per reward name, so both are rewards:

* ``shapebench`` (ShapeBenchReward): the partial score, the one to train on;
* ``shapebench_strict`` (ShapeBenchStrictReward): the 0/1 score, the one to report.

Each also returns the other score and the per-clause results in ``extra_info``.
Names: both are lines of ``flow_factory.rewards.registry.BUILTIN_REWARDS``, so a
config names them without importing anything first.

Positions follow GenEval: "A left of B" holds when some A's centroid is at least
``RELATION_MARGIN`` pixels (at 64 px, scaled with the image) left of some B's;
the cross axis is not constrained, so "left of" and "above" may both hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..rewards.base import PointwiseRewardModel, RewardModelOutput, to_uint8_hwc
from .analysis import Detection, detect
from .prompts import PromptSpec, parse_prompt

RELATION_MARGIN = 6.0


@dataclass(frozen=True)
class Verdict:
    spec: PromptSpec
    clauses: dict[str, bool]
    extra_objects: int = 0  # detections beyond the objects the prompt names

    @property
    def partial(self) -> float:
        return sum(self.clauses.values()) / len(self.clauses)

    @property
    def strict(self) -> float:
        return float(all(self.clauses.values()) and self.extra_objects == 0)


def _relation_holds(a: Detection, b: Detection, relation: str, margin: float) -> bool:
    dx, dy = b.cx - a.cx, b.cy - a.cy  # image y grows downwards
    return {"left of": dx >= margin, "right of": -dx >= margin,
            "above": dy >= margin, "below": -dy >= margin}[relation]


def judge(spec: PromptSpec, detections: list[Detection], image_size: int = 64) -> Verdict:
    """Each clause of ``spec`` checked against ``detections``."""
    def having(shape, color=None):
        return [d for d in detections if d.shape == shape and (color is None or d.color == color)]

    f, c = spec.family, {}
    named = spec.count if f == "counting" else (1 if spec.shape2 is None else 2)
    extra = max(0, len(detections) - named)
    if f == "color_attr":
        c[f"{spec.color} {spec.shape}"] = bool(having(spec.shape, spec.color))
        c[f"{spec.color2} {spec.shape2}"] = bool(having(spec.shape2, spec.color2))
        return Verdict(spec, c, extra)
    c[spec.shape] = bool(having(spec.shape))
    if f == "colors":
        c[f"{spec.color} {spec.shape}"] = bool(having(spec.shape, spec.color))
    elif f == "counting":
        c[f"{spec.count} x {spec.shape}"] = len(having(spec.shape)) == spec.count
    elif f in ("two_object", "position"):
        c[spec.shape2] = bool(having(spec.shape2))
    if f == "position":
        margin = RELATION_MARGIN * image_size / 64
        c[f"{spec.shape} {spec.relation} {spec.shape2}"] = any(
            _relation_holds(a, b, spec.relation, margin)
            for a in having(spec.shape) for b in having(spec.shape2) if a is not b)
    return Verdict(spec, c, extra)


def verdict_on_image(prompt: str, image: np.ndarray) -> Verdict:
    """The verdict on one (H, W, 3) uint8 image for ``prompt``."""
    return judge(parse_prompt(prompt), detect(image), image.shape[0])


class _ShapeBenchBase(PointwiseRewardModel):
    required_fields = ("prompt", "image")
    use_tensor_inputs = True  # the analysis reads uint8 arrays; PIL would be a detour

    score_name = "partial"

    def __init__(self, model_name_or_path: str | None = None, device="cpu", dtype=torch.float32,
                 batch_size: int = 256):
        super().__init__(model_name_or_path, device, dtype, batch_size)

    def __call__(self, prompt=None, image=None, video=None, condition_images=None,
                 condition_videos=None) -> RewardModelOutput:
        if image is None:
            raise ValueError(f"{type(self).__name__} scores images; got none")
        verdicts = [verdict_on_image(p, a) for p, a in zip(prompt, to_uint8_hwc(image))]
        partial = [v.partial for v in verdicts]
        strict = [v.strict for v in verdicts]
        scores = partial if self.score_name == "partial" else strict
        return RewardModelOutput(
            rewards=torch.tensor(scores, dtype=torch.float32),
            extra_info={"partial": partial, "strict": strict, "family": [v.spec.family for v in verdicts],
                        "clauses": [v.clauses for v in verdicts],
                        "extra_objects": [v.extra_objects for v in verdicts]})


class ShapeBenchReward(_ShapeBenchBase):
    """Mean of the prompt's clause scores, in [0, 1]."""

    score_name = "partial"


class ShapeBenchStrictReward(_ShapeBenchBase):
    """1 when every clause of the prompt holds, else 0."""

    score_name = "strict"
