"""A sample grid a person would rather look at than read: each image with its prompt and rewards."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

CAPTION_LINES = 4


def _to_pil(image: torch.Tensor) -> Image.Image:
    """(3, H, W) in [0, 1], or a video (F, 3, H, W) shown by its middle frame."""
    if image.ndim == 4:
        image = image[image.shape[0] // 2]
    array = (image.clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)
    return Image.fromarray(array)


def sample_grid(images: torch.Tensor, captions: list[str], tile: int = 256, columns: int | None = None) -> Image.Image:
    """Tile images (each scaled to ``tile`` px wide) with a few wrapped caption lines below."""
    n = len(captions)
    columns = columns or min(n, 4)
    rows = math.ceil(n / columns)
    font = ImageFont.load_default()
    line_h = 12
    chars = max(16, tile // 6)
    cell_h = tile + CAPTION_LINES * line_h + 6
    grid = Image.new("RGB", (columns * tile, rows * cell_h), "white")
    draw = ImageDraw.Draw(grid)
    for i in range(n):
        img = _to_pil(images[i]).resize((tile, tile), Image.NEAREST)
        x, y = (i % columns) * tile, (i // columns) * cell_h
        grid.paste(img, (x, y))
        lines = textwrap.wrap(captions[i], chars)[:CAPTION_LINES]
        for j, line in enumerate(lines):
            draw.text((x + 3, y + tile + 3 + j * line_h), line, fill="black", font=font)
    return grid


def caption(prompt: str, rewards: dict[str, float]) -> str:
    scores = " ".join(f"{k}={v:.4g}" for k, v in rewards.items())
    return f"{scores} | {prompt}"
