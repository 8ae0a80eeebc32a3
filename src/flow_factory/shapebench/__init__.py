"""ShapeBench: procedural shape scenes with GenEval-style prompts, and a verifiable reward.

``generate`` makes seeded (prompt, image) samples; ``verdict_on_image`` / the
``shapebench`` and ``shapebench_strict`` rewards score any image against its prompt.
"""

from .analysis import Detection, detect
from .generator import Sample, ShapeObject, generate, prompt_split, render, write_prompt_dataset
from .prompts import (COLORS, FAMILIES, RELATIONS, SHAPES, PromptSpec, all_specs, parse_prompt,
                      prompt_family)
from .reward import ShapeBenchReward, ShapeBenchStrictReward, Verdict, judge, verdict_on_image

__all__ = [
    "COLORS", "FAMILIES", "RELATIONS", "SHAPES", "Detection", "PromptSpec", "Sample", "ShapeBenchReward",
    "ShapeBenchStrictReward", "ShapeObject", "Verdict", "all_specs", "detect", "generate", "judge",
    "parse_prompt", "prompt_family", "prompt_split", "render", "verdict_on_image", "write_prompt_dataset",
]
