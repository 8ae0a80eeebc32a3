"""The JSON that client and server exchange, and its checks.

Media travel as base64 PNG (lossless for the uint8 images rewards see) or JPEG/WebP;
nothing a client sends is executed or unpickled: it is JSON, base64 and image decoding
with a pixel limit.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any, Union

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, model_validator

ALLOWED_FORMATS = {"PNG", "JPEG", "WEBP"}
MAX_PIXELS = 4096 * 4096  # per image; beyond this decoding is refused (decompression bombs)
JsonScalar = Union[str, int, float, bool, None]


class ScoreRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    prompts: list[str] = Field(description="one prompt per sample")
    images: list[str] | None = Field(None, description="base64 PNG/JPEG/WebP, one per sample")
    videos: list[list[str]] | None = Field(None, description="base64 frames, one list per sample")
    condition_images: list[list[str]] | None = Field(None, description="base64 images, one list per sample")
    group: bool = Field(False, description="the samples are one group: computed together, never merged")
    kwargs: dict[str, JsonScalar] = Field(default_factory=dict, description="options for compute_reward")

    @model_validator(mode="after")
    def _one_per_prompt(self):
        n = len(self.prompts)
        if n == 0:
            raise ValueError("prompts is empty")
        for name in ("images", "videos", "condition_images"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"{len(value)} {name} for {n} prompts; need one per prompt")
        return self


class ScoreResponse(BaseModel):
    rewards: list[float]


def encode_image(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_image(data: str, where: str) -> Image.Image:
    """An RGB image, or ValueError naming ``where`` (e.g. ``images[3]``) and what is wrong."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: not valid base64 ({e})") from None
    try:
        with Image.open(io.BytesIO(raw)) as image:
            if image.format not in ALLOWED_FORMATS:
                raise ValueError(f"{where}: image format {image.format} not accepted; send "
                                 f"{sorted(ALLOWED_FORMATS)}")
            if image.width * image.height > MAX_PIXELS:
                raise ValueError(f"{where}: {image.width}x{image.height} is over the {MAX_PIXELS}-pixel limit")
            return image.convert("RGB")  # decodes fully: truncated data fails here
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - PIL raises many types for corrupt data
        raise ValueError(f"{where}: not a readable image ({type(e).__name__}: {e})") from None


def decode_request(req: ScoreRequest) -> dict[str, Any]:
    """The arguments of ``compute_reward`` (except the request's own kwargs)."""
    images = None if req.images is None else [decode_image(d, f"images[{i}]") for i, d in enumerate(req.images)]
    videos = None if req.videos is None else [
        [decode_image(d, f"videos[{i}][{j}]") for j, d in enumerate(frames)] for i, frames in enumerate(req.videos)]
    conds = None if req.condition_images is None else [
        [decode_image(d, f"condition_images[{i}][{j}]") for j, d in enumerate(c)]
        for i, c in enumerate(req.condition_images)]
    return {"prompts": list(req.prompts), "images": images, "videos": videos, "condition_images": conds}
