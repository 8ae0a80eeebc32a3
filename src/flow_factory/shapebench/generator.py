"""The procedural data: seeded scenes of 1-4 flat shapes on white, each with its caption.

``generate(n, seed)`` gives the same images and prompts for the same arguments on
any machine (numpy's PCG64 stream, PIL rasterisation without anti-aliasing).
A scene always satisfies its prompt with margins the reward can read without
doubt: objects never touch (a gap of at least ``GAP`` pixels), and a position
prompt's objects are at least ``POSITION_OFFSET`` pixels apart along the axis
the relation names.

Held-out prompts: ``prompt_split`` puts about a quarter of each family's distinct
prompts in a test set that pretraining never sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from .prompts import COLORS, FAMILIES, SHAPES, PromptSpec, all_specs

IMAGE_SIZE = 64
BACKGROUND = (255, 255, 255)
SIZE_RANGE = (12, 18)  # side of an object's bounding box, pixels (at 64 px; scaled with the image)
GAP = 4  # pixels between objects' bounding boxes
POSITION_OFFSET = 20  # pixels between the two centres of a position prompt, along its axis


@dataclass(frozen=True)
class ShapeObject:
    shape: str
    color: str
    cx: float  # centre, pixels
    cy: float
    size: float  # bounding-box side, pixels

    @property
    def box(self) -> tuple[float, float, float, float]:
        h = self.size / 2
        return (self.cx - h, self.cy - h, self.cx + h, self.cy + h)


@dataclass(frozen=True)
class Sample:
    spec: PromptSpec
    objects: tuple[ShapeObject, ...]
    image: np.ndarray  # (H, W, 3) uint8

    @property
    def prompt(self) -> str:
        return self.spec.text


def render(objects, image_size: int = IMAGE_SIZE, background: tuple[int, int, int] = BACKGROUND) -> np.ndarray:
    """(H, W, 3) uint8: each object filled in its colour, hard edges, on ``background`` (white)."""
    img = Image.new("RGB", (image_size, image_size), background)
    draw = ImageDraw.Draw(img)
    for o in objects:
        x0, y0, x1, y1 = o.box
        fill = COLORS[o.color]
        if o.shape == "circle":
            draw.ellipse([x0, y0, x1, y1], fill=fill)
        elif o.shape == "square":
            draw.rectangle([x0, y0, x1, y1], fill=fill)
        elif o.shape == "triangle":  # upright, base = height = size
            draw.polygon([(x0, y1), (x1, y1), (o.cx, y0)], fill=fill)
        else:
            raise ValueError(f"unknown shape {o.shape!r}; valid: {list(SHAPES)}")
    return np.asarray(img, dtype=np.uint8)


def apart(a: ShapeObject, b: ShapeObject) -> bool:
    """True when the bounding boxes are at least GAP pixels apart along some axis."""
    ax0, ay0, ax1, ay1 = a.box
    bx0, by0, bx1, by1 = b.box
    return ax1 + GAP <= bx0 or bx1 + GAP <= ax0 or ay1 + GAP <= by0 or by1 + GAP <= ay0


def inside(o: ShapeObject, image_size: int) -> bool:
    """True when the object's box leaves a 1-pixel margin (2 on the far sides) in the image."""
    x0, y0, x1, y1 = o.box
    return x0 >= 1 and y0 >= 1 and x1 <= image_size - 2 and y1 <= image_size - 2


def _place(rng: np.random.Generator, wanted: list[tuple[str, str]], image_size: int,
           relation: str | None = None, tries: int = 500) -> tuple[ShapeObject, ...]:
    """Random non-touching positions and sizes for ``wanted`` (shape, colour) pairs."""
    scale = image_size / IMAGE_SIZE
    lo, hi = SIZE_RANGE[0] * scale, SIZE_RANGE[1] * scale
    for _ in range(tries):
        placed: list[ShapeObject] = []
        for shape, color in wanted:
            size = float(rng.integers(round(lo), round(hi) + 1))
            h = size / 2
            if relation is not None and placed:  # the second object of a position prompt
                a = placed[0]
                along = float(rng.uniform(POSITION_OFFSET * scale, image_size - size - 2))
                across = float(rng.uniform(-6, 6) * scale)
                dx, dy = {"left of": (along, across), "right of": (-along, across),
                          "above": (across, along), "below": (across, -along)}[relation]
                o = ShapeObject(shape, color, a.cx + dx, a.cy + dy, size)  # a is `relation` of o
            else:
                cx, cy = rng.uniform(1 + h, image_size - 2 - h, size=2)
                o = ShapeObject(shape, color, float(cx), float(cy), size)
            if not inside(o, image_size) or not all(apart(o, p) for p in placed):
                break
            placed.append(o)
        else:
            return tuple(placed)
    raise RuntimeError(f"could not place {wanted} in {image_size}x{image_size} after {tries} tries")


def random_color(rng: np.random.Generator) -> str:
    """A palette colour name, uniformly."""
    return list(COLORS)[int(rng.integers(len(COLORS)))]


def scene_for(spec: PromptSpec, rng: np.random.Generator, image_size: int = IMAGE_SIZE) -> tuple[ShapeObject, ...]:
    """Objects that satisfy ``spec`` exactly (unnamed colours drawn at random)."""
    color = spec.color or random_color(rng)
    if spec.family == "counting":
        wanted = [(spec.shape, random_color(rng)) for _ in range(spec.count)]
    elif spec.shape2 is None:
        wanted = [(spec.shape, color)]
    else:
        wanted = [(spec.shape, color), (spec.shape2, spec.color2 or random_color(rng))]
    return _place(rng, wanted, image_size, spec.relation)


def random_spec(rng: np.random.Generator, pool: list[PromptSpec] | None = None) -> PromptSpec:
    """A family uniformly, then a prompt of it uniformly (or one of ``pool``)."""
    if pool is not None:
        return pool[int(rng.integers(len(pool)))]
    specs = all_specs(FAMILIES[int(rng.integers(len(FAMILIES)))])
    return specs[int(rng.integers(len(specs)))]


def generate(n: int, seed: int, specs: list[PromptSpec] | None = None, image_size: int = IMAGE_SIZE,
             by_family: bool = True) -> list[Sample]:
    """``n`` samples from the seeded stream ``seed``.

    ``specs``: the prompts to draw from (default: every prompt). With ``by_family``
    the family is drawn first, so the six families are equally frequent whatever
    their sizes (color_attr alone has 180 prompts).
    """
    rng = np.random.default_rng(seed)
    pool = list(specs) if specs is not None else [s for f in FAMILIES for s in all_specs(f)]
    if not pool:
        raise ValueError("generate: empty prompt pool")
    families = {}
    for s in pool:
        families.setdefault(s.family, []).append(s)
    out = []
    for _ in range(n):
        if by_family:
            fam = list(families)[int(rng.integers(len(families)))]
            spec = random_spec(rng, families[fam])
        else:
            spec = random_spec(rng, pool)
        objects = scene_for(spec, rng, image_size)
        out.append(Sample(spec, objects, render(objects, image_size)))
    return out


def prompt_split(seed: int = 0, test_fraction: float = 0.25) -> tuple[list[PromptSpec], list[PromptSpec]]:
    """(train, test) distinct prompts: per family, a seeded ``test_fraction`` (at least one) is held out."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for family in FAMILIES:
        specs = all_specs(family)
        order = rng.permutation(len(specs))
        k = max(1, round(test_fraction * len(specs)))
        test += [specs[i] for i in sorted(order[:k])]
        train += [specs[i] for i in sorted(order[k:])]
    return train, test


def write_prompt_dataset(path: str | Path, seed: int = 0, num_test: int = 256, num_train: int | None = None) -> Path:
    """A Flow-Factory prompt folder: ``train.txt`` (every training prompt once, or ``num_train``
    drawn family-balanced) and ``test.txt`` (``num_test`` lines of held-out prompts,
    family-balanced; repeats get different seeds in eval since each line is a sample)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    train, test = prompt_split(seed)
    by_family = lambda specs: {f: [s for s in specs if s.family == f] for f in FAMILIES}  # noqa: E731

    def balanced(specs, n, rng):
        groups = by_family(specs)
        return [groups[FAMILIES[i % len(FAMILIES)]][int(rng.integers(len(groups[FAMILIES[i % len(FAMILIES)]])))]
                for i in range(n)]

    # separate streams, so the test lines do not depend on num_train
    train_lines = ([s.text for s in train] if num_train is None
                   else [s.text for s in balanced(train, num_train, np.random.default_rng(seed + 2))])
    (path / "train.txt").write_text("\n".join(train_lines) + "\n")
    test_lines = [s.text for s in balanced(test, num_test, np.random.default_rng(seed + 1))]
    (path / "test.txt").write_text("\n".join(test_lines) + "\n")
    return path
