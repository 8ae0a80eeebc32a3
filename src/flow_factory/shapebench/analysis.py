"""Pixel analysis: which coloured shapes an image holds, and where.

No model: a pixel is foreground when it is saturated and bright enough, and its
hue names the nearest palette colour (the palette's hues are about 60 degrees
apart, so a blurred or slightly shifted colour still lands on the right name).
Each colour's mask is split into connected components (scipy.ndimage.label,
8-connectivity); a component's shape is read from how much of its bounding box
it fills: a square fills all of it, a circle pi/4 (0.785), an upright triangle
one half. Components smaller than ``min_area`` pixels are noise and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from .prompts import COLORS

MIN_SATURATION = 0.35
MIN_VALUE = 0.25
# fill-ratio boundaries, halfway-ish between the ideal values (0.5, 0.785, 1.0)
SQUARE_FILL = 0.9
CIRCLE_FILL = 0.64
_EIGHT = np.ones((3, 3), dtype=bool)


def _hue_saturation_value(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """HSV of (H, W, 3) uint8; hue in degrees [0, 360)."""
    x = rgb.astype(np.float32) / 255.0
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    mx, mn = x.max(-1), x.min(-1)
    delta = mx - mn
    safe = np.where(delta > 0, delta, 1.0)
    hue = np.where(mx == r, (g - b) / safe % 6, np.where(mx == g, (b - r) / safe + 2, (r - g) / safe + 4)) * 60.0
    saturation = np.where(mx > 0, delta / np.where(mx > 0, mx, 1.0), 0.0)
    return hue, saturation, mx


def _palette_hues() -> np.ndarray:
    rgb = np.array(list(COLORS.values()), dtype=np.uint8)[None]
    return _hue_saturation_value(rgb)[0][0]


_PALETTE_HUES = _palette_hues()
_COLOR_NAMES = list(COLORS)


@dataclass(frozen=True)
class Detection:
    color: str
    shape: str
    cx: float  # centroid, pixels (x to the right, y down)
    cy: float
    area: int
    fill: float  # area / bounding-box area


def _classify(rgb: np.ndarray) -> np.ndarray:
    hue, sat, val = _hue_saturation_value(rgb)
    distance = np.abs(hue[..., None] - _PALETTE_HUES)
    distance = np.minimum(distance, 360.0 - distance)
    labels = distance.argmin(-1)
    return np.where((sat >= MIN_SATURATION) & (val >= MIN_VALUE), labels, -1).astype(np.int8)


def _lookup_table() -> np.ndarray:
    # HSV per pixel costs more than all the rest of `detect`; classify the 2^15 colours
    # of 5 bits a channel once (at each bin's centre) and look pixels up instead
    levels = np.arange(32, dtype=np.uint8) * 8 + 4
    r, g, b = np.meshgrid(levels, levels, levels, indexing="ij")
    return _classify(np.stack([r, g, b], -1).reshape(-1, 1, 3)).reshape(-1)


_LUT = _lookup_table()


def color_labels(image: np.ndarray) -> np.ndarray:
    """(H, W) int8: index into the palette of each pixel's colour, -1 for background."""
    q = (image >> 3).astype(np.int32)
    return _LUT[(q[..., 0] << 10) | (q[..., 1] << 5) | q[..., 2]]


def shape_from_fill(fill: float) -> str:
    if fill >= SQUARE_FILL:
        return "square"
    if fill >= CIRCLE_FILL:
        return "circle"
    return "triangle"


def detect(image: np.ndarray, min_area: int | None = None) -> list[Detection]:
    """Coloured shapes in an (H, W, 3) uint8 image; ``min_area`` defaults to 24 px at 64x64, scaled by area."""
    if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
        raise ValueError(f"detect needs an (H, W, 3) uint8 image, got {image.dtype} {image.shape}")
    h, w = image.shape[:2]
    if min_area is None:
        min_area = max(4, round(24 * h * w / 64 ** 2))
    labels = color_labels(image)
    counts = np.bincount(labels.ravel() + 1, minlength=len(_COLOR_NAMES) + 1)[1:]
    found = []
    for index in np.nonzero(counts >= min_area)[0]:
        components, n = ndimage.label(labels == index, structure=_EIGHT)
        if n == 0:
            continue
        areas = np.bincount(components.ravel(), minlength=n + 1)
        for k, box in enumerate(ndimage.find_objects(components), start=1):
            if areas[k] < min_area:
                continue
            ys, xs = box
            box_area = (ys.stop - ys.start) * (xs.stop - xs.start)
            yy, xx = np.nonzero(components[box] == k)
            fill = float(areas[k]) / box_area
            found.append(Detection(_COLOR_NAMES[index], shape_from_fill(fill), float(xx.mean()) + xs.start,
                                   float(yy.mean()) + ys.start, int(areas[k]), fill))
    return found
