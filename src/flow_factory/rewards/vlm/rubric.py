"""``rational_rewards_t2i`` / ``rational_rewards_edit``: the VLM reasons over a rubric, then
scores each aspect; the reward is the weighted mean of the aspect scores mapped to [0, 1].

The reply is asked to end with a JSON object ``{"aspect": score, ...}``. Parsing takes the
last JSON object in the reply holding every aspect; failing that, the last line of the form
``aspect: score`` for each aspect (markdown ``**`` and case ignored). With scores ``s_a``
in ``[lo, hi]`` and weights ``w_a``: ``reward = sum_a w_a (s_a - lo) / (hi - lo) / sum_a w_a``.
A missing aspect or a score outside the range makes the reply unscorable
(``fallback_score``, or an error when that is null).

The edit judge sends the source image (the sample's first condition image) and then the
edited image, with the edit instruction as the prompt.
"""

from __future__ import annotations

import json
import re

from .base import UnscorableReply, VLMJudge, image_part, reply_text

T2I_ASPECTS = {"alignment": 1.0, "quality": 1.0, "aesthetics": 1.0}
EDIT_ASPECTS = {"instruction_following": 1.0, "consistency": 1.0, "quality": 1.0}

T2I_RUBRIC = (
    "You judge an image generated for the prompt: \"{prompt}\".\n"
    "Aspects: alignment (does it show everything the prompt asks, nothing contradicting it), "
    "quality (artifacts, anatomy, legibility), aesthetics (composition, lighting, colour).\n"
    "Reason briefly about each aspect, then end with one JSON object giving each aspect an integer "
    "score from {lo} to {hi}: {example}")
EDIT_RUBRIC = (
    "The first image is the source, the second the result of the edit instruction: \"{prompt}\".\n"
    "Aspects: instruction_following (the edit asked for was made), consistency (everything else is "
    "unchanged), quality (no artifacts).\n"
    "Reason briefly about each aspect, then end with one JSON object giving each aspect an integer "
    "score from {lo} to {hi}: {example}")


def parse_aspect_scores(text: str, aspects: list[str]) -> dict[str, float]:
    """``{aspect: score}`` from a reply (see the module doc); UnscorableReply when an aspect is missing."""
    for match in reversed(list(re.finditer(r"\{[^{}]*\}", text))):
        try:
            obj = json.loads(match.group(0))
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            lowered = {str(k).strip().lower(): v for k, v in obj.items()}
            if all(a in lowered for a in aspects):
                try:
                    return {a: float(lowered[a]) for a in aspects}
                except (TypeError, ValueError):
                    raise UnscorableReply(f"non-numeric aspect score in {match.group(0)!r}") from None
    scores = {}
    clean = text.replace("*", "")
    for aspect in aspects:
        found = re.findall(rf"(?im)^[\s\-#>]*{re.escape(aspect)}\s*[:=]\s*(-?\d+(?:\.\d+)?)", clean)
        if not found:
            raise UnscorableReply(f"no score for aspect {aspect!r} in the reply {text[-300:]!r}")
        scores[aspect] = float(found[-1])
    return scores


def aggregate(scores: dict[str, float], weights: dict[str, float], lo: float, hi: float) -> float:
    for aspect, s in scores.items():
        if not lo <= s <= hi:
            raise UnscorableReply(f"aspect {aspect!r} scored {s:g}, outside [{lo:g}, {hi:g}]")
    total = sum(weights.values())
    return sum(weights[a] * (scores[a] - lo) / (hi - lo) for a in weights) / total


class RubricJudge(VLMJudge):
    DEFAULT_ASPECTS: dict[str, float] = {}
    DEFAULT_RUBRIC = ""

    def __init__(self, *args, aspects: dict[str, float] | None = None, rubric: str | None = None,
                 score_range: tuple[float, float] | list[float] = (1, 10), max_tokens: int = 1024, **kwargs):
        super().__init__(*args, **kwargs)
        name = type(self).__name__
        self.weights = {str(k).lower(): float(v) for k, v in (aspects or self.DEFAULT_ASPECTS).items()}
        if not self.weights or any(w < 0 for w in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ValueError(f"{name}: aspects must map names to weights >= 0 with a positive sum, got {aspects}")
        lo, hi = (float(x) for x in score_range)
        if not lo < hi:
            raise ValueError(f"{name}: score_range must be [low, high] with low < high, got {score_range}")
        self.lo, self.hi, self.max_tokens = lo, hi, int(max_tokens)
        self.rubric = rubric or self.DEFAULT_RUBRIC
        if "{prompt}" not in self.rubric:
            raise ValueError(f"{name}: rubric must contain '{{prompt}}'")

    def instruction(self, prompt: str) -> str:
        example = json.dumps({a: int(self.hi) for a in self.weights})
        return (self.rubric.replace("{prompt}", prompt).replace("{lo}", f"{self.lo:g}")
                .replace("{hi}", f"{self.hi:g}").replace("{example}", example))

    def judge(self, images: list, prompt: str) -> float:
        body = self.chat([*(image_part(im) for im in images), {"type": "text", "text": self.instruction(prompt)}],
                         max_tokens=self.max_tokens, temperature=0.0)
        scores = parse_aspect_scores(reply_text(body), list(self.weights))
        return aggregate(scores, self.weights, self.lo, self.hi)


class RubricT2IJudge(RubricJudge):
    required_fields = ("prompt", "image")
    DEFAULT_ASPECTS, DEFAULT_RUBRIC = T2I_ASPECTS, T2I_RUBRIC

    def __call__(self, prompt, image=None):
        if image is None:
            raise ValueError("rational_rewards_t2i needs images")
        return self.score_each(len(prompt), lambda i: self.judge([image[i]], prompt[i]))


class RubricEditJudge(RubricJudge):
    required_fields = ("prompt", "image", "condition_images")
    DEFAULT_ASPECTS, DEFAULT_RUBRIC = EDIT_ASPECTS, EDIT_RUBRIC

    def __call__(self, prompt, image=None, condition_images=None):
        if image is None or condition_images is None or any(len(c) == 0 for c in condition_images):
            raise ValueError("rational_rewards_edit needs images and, per sample, the source image in "
                             "condition_images")
        return self.score_each(len(prompt), lambda i: self.judge([condition_images[i][0], image[i]], prompt[i]))
