"""The reward server's wire format: the JSON that a remote reward (the client, in
``flow_factory.rewards``) and ``ff-reward-server`` (``flow_factory.reward_server``) exchange,
and its checks.

It lives outside both packages, and imports neither torch nor either of them, so each side
imports it without importing the other: the server runs where torch is not installed, and
the rewards never depend on the server.

Media travel as base64 PNG (lossless for the uint8 images rewards see) or JPEG/WebP;
nothing a client sends is executed or unpickled: it is JSON, base64 and image decoding.
Each image's header (format, width, height) is read first, so a request's pixel count is
checked against the server's limits before any pixel is decoded (``open_request``).

Two request shapes, both JSON with base64 images:

- ``ScoreRequest``, POST ``/score``: this project's (``prompts``, ``images``, ``videos``,
  ``condition_images``, ``group``, ``kwargs``).
- ``ComputeRequest``, POST ``/compute``: Flow-Factory's. Its server template
  (``reward_server/example_server.py``) and its client (``rewards/my_reward_remote.py``),
  as of the snapshot this project follows (commit a0b2bc5), spell the fields as its reward
  models' arguments: ``prompt``, ``image``, ``video``, ``condition_images``,
  ``condition_videos``, and the template reads ``extra``. An early version of both (commit
  696af07) spelled them ``prompts``, ``images``, ``videos``, and its client sent ``kwargs``.
  Both spellings are read here; the remote rewards send the snapshot's
  (``ComputeRequest.template_body``), which every Flow-Factory server written from its
  template reads. Answer: ``{"rewards": [...]}``. Flow-Factory's protocol pickles nothing either.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from typing import Any, Union

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

ALLOWED_FORMATS = {"PNG", "JPEG", "WEBP"}
MAX_PIXELS = 4096 * 4096  # per image, read from its header: a larger one is refused before decoding
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
        return one_per_prompt(self)


def one_per_prompt(request: BaseModel) -> BaseModel:
    """ValueError unless ``request`` has prompts and every media field present has one entry per prompt."""
    n = len(request.prompts)
    if n == 0:
        raise ValueError("prompts is empty")
    for name in MEDIA_KEYS:
        value = getattr(request, name, None)
        if value is not None and len(value) != n:
            raise ValueError(f"{len(value)} {name} for {n} prompts; need one per prompt")
    return request


MEDIA_KEYS = ("images", "videos", "condition_images", "condition_videos")
# Flow-Factory's spelling of a /compute field -> its name here (that of Flow-Factory's early
# template); the other fields are spelled alike. "kwargs" is what its early client sent for "extra".
COMPUTE_SPELLINGS = {"prompt": "prompts", "image": "images", "video": "videos", "kwargs": "extra"}
# what Flow-Factory's server template reads at the snapshot: our field name -> its key
TEMPLATE_KEYS = {"prompts": "prompt", "images": "image", "videos": "video"}


class ComputeRequest(BaseModel):
    """Flow-Factory's POST /compute body, in either of its two spellings (see the module docstring)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    prompts: list[str] = Field(description="one prompt per sample (also read as 'prompt')")
    images: list[str] | None = Field(None, description="base64 images, one per sample (also 'image')")
    videos: list[list[str]] | None = Field(None, description="base64 frames, one list per sample (also 'video')")
    condition_images: list[list[str]] | None = Field(None, description="base64 images, one list per sample")
    condition_videos: list[list[list[str]]] | None = Field(None, description="base64 frames of each condition "
                                                                             "video, one list per sample")
    extra: dict[str, JsonValue] = Field(default_factory=dict, description="keyword arguments of compute_reward "
                                                                          "(also 'kwargs')")

    @model_validator(mode="before")
    @classmethod
    def _one_spelling(cls, data):
        if not isinstance(data, dict):
            return data
        clash = [key for key, name in COMPUTE_SPELLINGS.items() if key in data and name in data]
        if clash:
            raise ValueError(f"both {clash[0]!r} and {COMPUTE_SPELLINGS[clash[0]]!r} are given; send one of them")
        out = {COMPUTE_SPELLINGS.get(key, key): value for key, value in data.items()}
        if out.get("extra") is None:  # Flow-Factory's client sends "kwargs": null when it has none
            out.pop("extra", None)
        return out

    @model_validator(mode="after")
    def _one_per_prompt(self):
        return one_per_prompt(self)

    def template_body(self) -> dict[str, Any]:
        """The JSON body in the keys Flow-Factory's server template reads (``prompt``, ``image``,
        ``video``, ``condition_images``, ``condition_videos``, ``extra``); absent media are left out."""
        return {TEMPLATE_KEYS.get(name, name): value for name, value in self.model_dump(exclude_none=True).items()}


class ScoreResponse(BaseModel):
    rewards: list[float]


def encode_image(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class TooManyPixels(ValueError):
    """Images that would decode to more pixels than a limit allows (the server answers 413)."""


@dataclass
class EncodedImage:
    """One image as sent: its compressed bytes and the size its header declares. Nothing is
    decoded yet, so a request's pixel count is known before any memory goes to pixels."""

    where: str  # e.g. ``images[3]``, for error messages
    raw: bytes
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height

    def decode(self) -> Image.Image:
        """The RGB image, or ValueError naming ``where``."""
        try:
            image = Image.open(io.BytesIO(self.raw))
            image.load()  # decodes fully: truncated data fails here
            # kept as decoded when already RGB: converting would hold a second copy meanwhile
            return image if image.mode == "RGB" else image.convert("RGB")
        except Exception as e:  # noqa: BLE001 - PIL raises many types for corrupt data
            raise ValueError(f"{self.where}: not a readable image ({type(e).__name__}: {e})") from None


def read_header(data: str, where: str) -> EncodedImage:
    """``data`` (base64) checked as far as its header: format and size. ValueError naming
    ``where`` and what is wrong; TooManyPixels for an image over ``MAX_PIXELS``."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: not valid base64 ({e})") from None
    try:
        with Image.open(io.BytesIO(raw)) as image:  # reads the header only
            fmt, (width, height) = image.format, image.size
    except Image.DecompressionBombError as e:
        raise TooManyPixels(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 - PIL raises many types for corrupt data
        raise ValueError(f"{where}: not a readable image ({type(e).__name__}: {e})") from None
    if fmt not in ALLOWED_FORMATS:
        raise ValueError(f"{where}: image format {fmt} not accepted; send {sorted(ALLOWED_FORMATS)}")
    if width * height > MAX_PIXELS:
        raise TooManyPixels(f"{where}: {width}x{height} is over the {MAX_PIXELS}-pixel limit per image "
                            f"(4096x4096); send smaller images")
    return EncodedImage(where, raw, width, height)


@dataclass
class OpenedRequest:
    """A request whose images' headers were read: ``pixels`` is known, nothing is decoded."""

    prompts: list[str]
    images: list[EncodedImage] | None
    videos: list[list[EncodedImage]] | None
    condition_images: list[list[EncodedImage]] | None
    condition_videos: list[list[list[EncodedImage]]] | None = None  # sent only to /compute

    @property
    def pixels(self) -> int:
        """What the images take once decoded, in pixels (PIL stores 4 bytes a pixel for RGB)."""
        return sum(image.pixels for image in self._all_images())

    def _all_images(self):
        yield from self.images or []
        for frames in (self.videos or []) + (self.condition_images or []):
            yield from frames
        for clips in self.condition_videos or []:
            for frames in clips:
                yield from frames

    def decode(self) -> dict[str, Any]:
        """The arguments of ``compute_reward`` (except the request's own kwargs)."""
        return {"prompts": list(self.prompts), **{name: _decoded(getattr(self, name)) for name in MEDIA_KEYS}}


def _decoded(media):
    """Nested lists of EncodedImage -> the same lists of RGB images (None stays None)."""
    if media is None:
        return None
    return [item.decode() if isinstance(item, EncodedImage) else _decoded(item) for item in media]


def _headers(media, where: str):
    """Nested lists of base64 strings -> the same lists of EncodedImage, each named by its index."""
    if media is None:
        return None
    return [read_header(item, f"{where}[{i}]") if isinstance(item, str) else _headers(item, f"{where}[{i}]")
            for i, item in enumerate(media)]


def open_request(req: ScoreRequest | ComputeRequest) -> OpenedRequest:
    """Every image of ``req`` read as far as its header (see ``read_header``)."""
    return OpenedRequest(list(req.prompts), *(_headers(getattr(req, name, None), name) for name in MEDIA_KEYS))

