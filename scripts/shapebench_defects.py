"""Defects of ShapeBench data that no caption names and the strict score rejects: the
changes scripts/pretrain_shapebench.py puts into part of its training scenes (--clutter,
--tint, --dark), so that RL has something to remove. Each returns a new ``Sample``.
"""

from __future__ import annotations

import numpy as np

from flow_factory.shapebench.generator import (IMAGE_SIZE, SIZE_RANGE, Sample, ShapeObject, apart, inside,
                                               random_color, render)
from flow_factory.shapebench.prompts import SHAPES


def with_extra_object(sample: Sample, rng: np.random.Generator, tries: int = 200) -> Sample | None:
    """The sample plus one object of a random shape and colour that its prompt does not ask
    for (the smallest size, apart from the others), re-rendered; None when none fits."""
    image_size = sample.image.shape[0]
    size = SIZE_RANGE[0] * image_size / IMAGE_SIZE
    for _ in range(tries):
        cx, cy = rng.uniform(1 + size / 2, image_size - 2 - size / 2, size=2)
        extra = ShapeObject(SHAPES[int(rng.integers(len(SHAPES)))], random_color(rng), float(cx), float(cy), size)
        if inside(extra, image_size) and all(apart(extra, o) for o in sample.objects):
            objects = sample.objects + (extra,)
            return Sample(sample.spec, objects, render(objects, image_size))
    return None


def with_background(sample: Sample, background: tuple[int, int, int]) -> Sample:
    """The sample's objects on another background colour (a saturated one reads as one more object)."""
    return Sample(sample.spec, sample.objects, render(sample.objects, sample.image.shape[0], background))


def with_exposure(sample: Sample, factor: float) -> Sample:
    """The sample with every pixel scaled by ``factor``: below about 0.25 an under-exposed
    scene whose objects are too dark for the reward to see."""
    image = np.clip(np.round(sample.image.astype(np.float32) * factor), 0, 255).astype(np.uint8)
    return Sample(sample.spec, sample.objects, image)
