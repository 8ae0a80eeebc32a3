"""Metrics and images to TensorBoard (default), wandb or swanlab through accelerate's trackers."""

from __future__ import annotations

import importlib.util

import numpy as np
from PIL import Image

BACKEND_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "swanlab": "swanlab"}


def check_backend(backend: str) -> str | None:
    """The accelerate ``log_with`` value for ``log.logging_backend``; a clear error if not installed."""
    if backend == "none":
        return None
    package = BACKEND_PACKAGES[backend]
    if importlib.util.find_spec(package) is None:
        raise RuntimeError(
            f"log.logging_backend: {backend!r} is not installed; run `pip install {package}` "
            f"or set log.logging_backend to 'tensorboard' or 'none'"
        )
    return backend


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


def log_image(accelerator, backend: str | None, key: str, image: Image.Image, step: int) -> None:
    if backend is None:
        return
    tracker = accelerator.get_tracker(backend, unwrap=False)
    if backend == "tensorboard":
        tracker.log_images({key: np.asarray(image)[None]}, step=step, dataformats="NHWC")
    else:
        tracker.log_images({key: [image]}, step=step)
