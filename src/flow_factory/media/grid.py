"""A sample grid a person would rather look at than read: each sample with its prompt and rewards,
beside the condition images or videos it was generated from; a grid of videos is a video (mp4 or GIF)."""

from __future__ import annotations

import io
import math
import textwrap
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from .audio import write_wav
from .video import write_mp4

CAPTION_LINES = 4
VIDEO_FPS = 16  # frames per second of written videos: Wan's, as diffusers' examples export it
VIDEO_FORMATS = ("mp4", "gif")  # H.264 mp4 (small, plays in browsers and trackers), or an animated GIF


def _to_pil(image: torch.Tensor) -> Image.Image:
    """(3, H, W) in [0, 1]."""
    array = (image.clamp(0, 1).permute(1, 2, 0).cpu().numpy() * 255).round().astype(np.uint8)
    return Image.fromarray(array)


def _frame(media: torch.Tensor, t: int) -> torch.Tensor:
    """Frame ``t`` of a video (F, 3, H, W), its last one past its end; an image (3, H, W) is every frame."""
    return media[min(t, media.shape[0] - 1)] if media.ndim == 4 else media


def _fit(image: torch.Tensor, tile: int) -> Image.Image:
    """Scaled to fit a ``tile`` x ``tile`` box, its aspect ratio kept (nearest: tiny images stay sharp)."""
    pil = _to_pil(image)
    scale = tile / max(pil.size)
    return pil.resize((max(1, round(pil.width * scale)), max(1, round(pil.height * scale))), Image.NEAREST)


def sample_grid(media: torch.Tensor | list[torch.Tensor], captions: list[str], tile: int = 256,
                columns: int | None = None,
                conditions: list[list[torch.Tensor]] | None = None) -> Image.Image | list[Image.Image]:
    """Tile the samples (each fit into ``tile`` px, its aspect ratio kept, centred) with a few wrapped caption
    lines below.

    ``media``: images (N, 3, H, W) give one image; videos (N, F, 3, H, W) one grid per frame, an
    animation (``save_grid`` writes it as an mp4 or a GIF); or a list of N images (3, H, W) or videos
    (F, 3, H, W) whose sizes may differ (datasets evaluated at their own resolutions). ``conditions``: per
    sample, the condition images (3, H, W) or videos (F, 3, H, W) it was generated from, shown left of it."""
    n = len(captions)
    conditions = conditions or [[] for _ in range(n)]
    per_cell = 1 + max((len(c) for c in conditions), default=0)
    columns = columns or min(n, max(1, 4 // per_cell))
    rows = math.ceil(n / columns)
    video = media[0].ndim == 4
    frames = max([max(m.shape[0] for m in media) if video else 1]
                 + [c.shape[0] for cs in conditions for c in cs if c.ndim == 4])
    font = ImageFont.load_default()
    line_h, chars = 12, max(16, per_cell * tile // 6)
    cell_w, cell_h = per_cell * tile, tile + CAPTION_LINES * line_h + 6
    grids = []
    for t in range(frames):
        grid = Image.new("RGB", (columns * cell_w, rows * cell_h), "white")
        draw = ImageDraw.Draw(grid)
        for i in range(n):
            x, y = (i % columns) * cell_w, (i // columns) * cell_h
            for j, shown in enumerate([*conditions[i], media[i]]):
                pil = _fit(_frame(shown, t), tile)
                # the sample itself always sits in the cell's last tile, its conditions before it
                left = x + (per_cell - 1 - len(conditions[i]) + j) * tile
                grid.paste(pil, (left + (tile - pil.width) // 2, y + (tile - pil.height) // 2))
            for k, line in enumerate(textwrap.wrap(captions[i], chars)[:CAPTION_LINES]):
                draw.text((x + 3, y + tile + 3 + k * line_h), line, fill="black", font=font)
        grids.append(grid)
    return grids if video or len(grids) > 1 else grids[0]


def gif_bytes(frames: list[Image.Image], fps: int = VIDEO_FPS) -> bytes:
    """An animated GIF of ``frames``, looping."""
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0)
    return out.getvalue()


def save_video(frames: list[Image.Image], path: str | Path, video_format: str = "mp4", fps: int = VIDEO_FPS,
               audio=None, sample_rate: int | None = None) -> Path:
    """``frames`` as ``path`` with the suffix of ``video_format`` (``VIDEO_FORMATS``), written atomically;
    returns the path written. ``audio`` (channels, samples) at ``sample_rate``: the soundtrack, inside an
    mp4, or beside a GIF (which holds no sound) as ``path`` with .wav."""
    if video_format not in VIDEO_FORMATS:
        raise ValueError(f"video format {video_format!r}: expected one of {', '.join(VIDEO_FORMATS)}")
    path = Path(path).with_suffix(f".{video_format}")
    if video_format == "mp4":
        return write_mp4(frames, path, fps, audio, sample_rate)
    if audio is not None:
        write_wav(audio, path.with_suffix(".wav"), sample_rate)
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_bytes(gif_bytes(frames, fps))
    tmp.replace(path)
    return path


def save_grid(grid: Image.Image | list[Image.Image], path: str | Path, video_format: str = "mp4",
              fps: int = VIDEO_FPS) -> Path:
    """A grid as ``path`` with .png, or a video (a list of frames) as ``save_video`` writes it; returns the
    path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(grid, list):
        path = save_video(grid, path, video_format, fps)
    else:
        path = path.with_suffix(".png")
        grid.save(path)
    return path


def caption(prompt: str, rewards: dict[str, float]) -> str:
    scores = " ".join(f"{k}={v:.4g}" for k, v in rewards.items())
    return f"{scores} | {prompt}"


def eval_grid(samples: list[tuple]) -> Image.Image | list[Image.Image]:
    """The grid of an eval's ``samples`` (prompt, media, rewards, condition media), each captioned with its rewards
    (``eval_sampling.grid_samples`` picks them); each dataset's samples may have a size of their own."""
    conditions = [cond for *_, cond in samples]
    return sample_grid([media for _, media, _, _ in samples],
                       [caption(prompt, rewards) for prompt, _, rewards, _ in samples],
                       conditions=conditions if any(conditions) else None)
