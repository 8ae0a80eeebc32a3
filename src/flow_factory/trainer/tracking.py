"""Metrics, images and videos to TensorBoard (default), wandb or swanlab through accelerate's trackers."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
from PIL import Image

from ..config import ConfigError
from ..media import VIDEO_FPS, gif_bytes
from ..start_checks import backend_problem


def check_backend(backend: str) -> str | None:
    """The accelerate ``log_with`` value for ``log.logging_backend``; a clear error if not installed."""
    problem = backend_problem(backend)
    if problem:
        raise ConfigError(problem)
    return None if backend == "none" else backend


def flat_hparams(config: dict, prefix: str = "") -> dict:
    """Nested config -> flat {section.key: scalar} that every tracker accepts as hyperparameters."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_hparams(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        elif value is None:
            flat[name] = "null"
        else:
            flat[name] = str(value)
    return flat


def log_media(accelerator, backend: str | None, key: str, grid: Image.Image | list[Image.Image], step: int,
              path: Path, fps: int = VIDEO_FPS) -> None:
    """A sample grid to the tracker: an image, or a video for a list of frames (``path``: the grid as
    ``media.save_grid`` wrote it, an mp4 or a GIF for a video, which wandb and swanlab log as it is;
    TensorBoard plays no mp4 and gets the frames as an animated GIF)."""
    if backend is None:
        return
    tracker = accelerator.get_tracker(backend, unwrap=False)
    if not isinstance(grid, list):
        if backend == "tensorboard":
            tracker.log_images({key: np.asarray(grid)[None]}, step=step, dataformats="NHWC")
        else:
            tracker.log_images({key: [grid]}, step=step)
    elif backend == "tensorboard":
        # TensorBoard shows an animated GIF in its images tab: what SummaryWriter.add_video writes, without
        # the moviepy it needs to encode one
        from tensorboard.compat.proto.summary_pb2 import Summary

        gif = path.read_bytes() if path.suffix == ".gif" else gif_bytes(grid, fps)
        image = Summary.Image(height=grid[0].height, width=grid[0].width, colorspace=3, encoded_image_string=gif)
        tracker.writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=key, image=image)]), step)
    else:
        video = importlib.import_module(backend).Video  # wandb.Video / swanlab.Video read an mp4 or GIF file
        tracker.log({key: video(str(path))}, step=step)
