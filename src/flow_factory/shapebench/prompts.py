"""ShapeBench's prompt families: GenEval's six, over shapes instead of COCO objects.

A prompt is built from a ``PromptSpec`` (what must be in the image) and parsed
back into one, so the reward checks exactly what the text asks for. The
templates follow GenEval's (``a photo of ...``):

| family         | template                                         | clauses checked                      |
|----------------|--------------------------------------------------|--------------------------------------|
| single_object  | a photo of a {shape}                             | has shape                            |
| two_object     | a photo of a {shape} and a {shape2}              | has shape, has shape2                |
| counting       | a photo of {two,three,four} {shape}s             | has shape, exactly n of shape        |
| colors         | a photo of a {color} {shape}                     | has shape, has it in that colour     |
| position       | a photo of a {shape} {left of,...} a {shape2}    | has shape, has shape2, the relation  |
| color_attr     | a photo of a {color} {shape} and a {color2} {shape2} | has each shape in its colour     |
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import permutations, product

SHAPES = ("circle", "square", "triangle")
# saturated colours six hues apart (about 60 degrees), so a pixel's hue names its colour
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 25),
    "yellow": (240, 220, 20),
    "green": (30, 190, 40),
    "cyan": (20, 200, 220),
    "blue": (30, 60, 230),
    "purple": (170, 30, 220),
}
RELATIONS = ("left of", "right of", "above", "below")
NUMBERS = {"two": 2, "three": 3, "four": 4}
FAMILIES = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


@dataclass(frozen=True)
class PromptSpec:
    """What a prompt asks for. ``shape2``/``color2`` are the second object's, when there is one."""

    family: str
    shape: str
    shape2: str | None = None
    color: str | None = None
    color2: str | None = None
    count: int = 1
    relation: str | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"unknown prompt family {self.family!r}; valid: {list(FAMILIES)}")
        for s in (self.shape, self.shape2):
            if s is not None and s not in SHAPES:
                raise ValueError(f"unknown shape {s!r}; valid: {list(SHAPES)}")
        for c in (self.color, self.color2):
            if c is not None and c not in COLORS:
                raise ValueError(f"unknown colour {c!r}; valid: {list(COLORS)}")
        if self.relation is not None and self.relation not in RELATIONS:
            raise ValueError(f"unknown relation {self.relation!r}; valid: {list(RELATIONS)}")

    @property
    def text(self) -> str:
        f = self.family
        if f == "single_object":
            return f"a photo of a {self.shape}"
        if f == "two_object":
            return f"a photo of a {self.shape} and a {self.shape2}"
        if f == "counting":
            word = next(w for w, n in NUMBERS.items() if n == self.count)
            return f"a photo of {word} {self.shape}s"
        if f == "colors":
            return f"a photo of a {self.color} {self.shape}"
        if f == "position":
            return f"a photo of a {self.shape} {self.relation} a {self.shape2}"
        return f"a photo of a {self.color} {self.shape} and a {self.color2} {self.shape2}"


_S = "|".join(SHAPES)
_C = "|".join(COLORS)
_R = "|".join(RELATIONS)
_N = "|".join(NUMBERS)
# tried in order; each is anchored, so at most one matches a well-formed prompt
_PATTERNS: list[tuple[str, re.Pattern]] = [
    ("color_attr", re.compile(rf"a photo of an? (?P<color>{_C}) (?P<shape>{_S}) and an? (?P<color2>{_C}) (?P<shape2>{_S})")),
    ("two_object", re.compile(rf"a photo of an? (?P<shape>{_S}) and an? (?P<shape2>{_S})")),
    ("position", re.compile(rf"a photo of an? (?P<shape>{_S}) (?P<relation>{_R}) an? (?P<shape2>{_S})")),
    ("counting", re.compile(rf"a photo of (?P<count>{_N}) (?P<shape>{_S})s")),
    ("colors", re.compile(rf"a photo of an? (?P<color>{_C}) (?P<shape>{_S})")),
    ("single_object", re.compile(rf"a photo of an? (?P<shape>{_S})")),
]


def parse_prompt(prompt: str) -> PromptSpec:
    """The spec a ShapeBench prompt states; ValueError naming the prompt and the valid forms otherwise.

    Case, surrounding blanks and a final full stop are ignored.
    """
    text = " ".join(prompt.strip().lower().rstrip(".").split())
    for family, pattern in _PATTERNS:
        m = pattern.fullmatch(text)
        if m:
            fields = m.groupdict()
            if "count" in fields:
                fields["count"] = NUMBERS[fields["count"]]
            return PromptSpec(family=family, **fields)
    forms = "; ".join(sorted({f"{PromptSpec(**ex).text!r}" for ex in _EXAMPLES}))
    raise ValueError(f"not a ShapeBench prompt: {prompt!r}. Prompts look like: {forms} "
                     f"(shapes {list(SHAPES)}, colours {list(COLORS)}, relations {list(RELATIONS)}, "
                     f"counts {list(NUMBERS)})")


def prompt_family(prompt: str) -> str | None:
    """The family of a ShapeBench prompt; None for any other text."""
    try:
        return parse_prompt(prompt).family
    except ValueError:
        return None


_EXAMPLES = [
    dict(family="single_object", shape="circle"),
    dict(family="two_object", shape="circle", shape2="square"),
    dict(family="counting", shape="triangle", count=3),
    dict(family="colors", shape="square", color="red"),
    dict(family="position", shape="circle", relation="left of", shape2="triangle"),
    dict(family="color_attr", shape="circle", color="blue", shape2="square", color2="yellow"),
]


def all_specs(family: str) -> list[PromptSpec]:
    """Every distinct prompt of a family, in a fixed order."""
    if family == "single_object":
        return [PromptSpec(family, s) for s in SHAPES]
    if family == "two_object":  # unordered: "a circle and a square" = "a square and a circle"
        return [PromptSpec(family, a, b) for i, a in enumerate(SHAPES) for b in SHAPES[i + 1:]]
    if family == "counting":
        return [PromptSpec(family, s, count=n) for s in SHAPES for n in NUMBERS.values()]
    if family == "colors":
        return [PromptSpec(family, s, color=c) for s in SHAPES for c in COLORS]
    if family == "position":
        return [PromptSpec(family, a, b, relation=r) for (a, b) in permutations(SHAPES, 2) for r in RELATIONS]
    if family == "color_attr":
        return [PromptSpec(family, a, b, color=c1, color2=c2)
                for (a, b) in permutations(SHAPES, 2) for c1, c2 in product(COLORS, COLORS) if c1 != c2]
    raise ValueError(f"unknown prompt family {family!r}; valid: {list(FAMILIES)}")
