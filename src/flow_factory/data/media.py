"""Condition images and videos that a dataset's rows name: checked when the prompts load,
read when a batch is sampled.

Every file is opened once when the prompt file is read, before any model loads, so a missing,
unreadable or wrong-kind file stops the run with its path and the jsonl line that names it.
Images are read with Pillow. Videos are read with Pillow when it knows the format (animated GIF,
WebP, PNG), else with PyAV (media/video.py: mp4, mov, webm, mkv and whatever else FFmpeg decodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageSequence, UnidentifiedImageError

# video containers: never an image (Pillow reads none of them; PyAV reads them all)
VIDEO_SUFFIXES = (".mp4", ".mov", ".avi", ".mkv", ".webm", ".m4v", ".mpeg", ".mpg", ".flv", ".wmv")


class MediaError(ValueError):
    """A condition file that cannot serve: the message says why (the caller adds file and line)."""


@dataclass(frozen=True)
class MediaFile:
    """A checked condition file: an image (``frames`` 1) or a video."""

    path: Path
    size: tuple[int, int]  # (width, height), as Pillow gives it
    frames: int
    container: bool = False  # a video PyAV reads (mp4, webm, ...), not an animation Pillow does
    fps: float | None = None  # a video's frame rate as the file gives it (None: unknown, or an image)

    @property
    def aspect_ratio(self) -> float:
        """Height over width."""
        return self.size[1] / self.size[0]


def _exists(path: Path) -> None:
    if not path.is_file():
        raise MediaError("not found" if not path.exists() else "not a file")


def _open(path: Path) -> Image.Image:
    _exists(path)
    try:
        return Image.open(path)
    except Exception as e:  # noqa: BLE001 - Pillow raises several kinds; the message is what counts
        raise MediaError(f"cannot be read as an image or animation ({type(e).__name__}: {e})") from None


def check_image(path: Path) -> MediaFile:
    """A still image Pillow can read, or MediaError."""
    if path.suffix.lower() in VIDEO_SUFFIXES:
        raise MediaError(f"is a {path.suffix} video, not an image; list it under 'video'")
    with _open(path) as im:
        frames = getattr(im, "n_frames", 1)
        if frames > 1:
            raise MediaError(f"has {frames} frames: a video, not an image; list it under 'video'")
        size = im.size
        try:
            im.verify()  # the whole file's structure, without decoding the pixels
        except Exception as e:  # noqa: BLE001
            raise MediaError(f"is damaged ({type(e).__name__}: {e})") from None
    return MediaFile(path, size, 1)


def check_video(path: Path) -> MediaFile:
    """A video of two or more frames, or MediaError: an animation Pillow reads, or else a video PyAV
    probes and decodes the first frame of (a codec FFmpeg lacks fails here, not mid-run)."""
    _exists(path)
    if path.suffix.lower() not in VIDEO_SUFFIXES:
        try:
            im = Image.open(path)
        except (UnidentifiedImageError, OSError):
            pass  # not a format Pillow knows: PyAV's turn
        else:
            with im:
                frames = getattr(im, "n_frames", 1)
                if frames < 2:
                    raise MediaError("is a single image, not a video; list it under 'image'")
                duration = im.info.get("duration")  # of the first frame, in milliseconds
                return MediaFile(path, im.size, frames, fps=1000 / duration if duration else None)
    from ..media.video import VideoReadError, first_frame, probe  # PyAV loads only for such a file

    try:
        info = probe(path)
        if info.frames < 2:
            raise MediaError(f"has {info.frames} frame{'s' * (info.frames != 1)}; a video needs two or more")
        first_frame(path)
    except VideoReadError as e:
        raise MediaError(str(e)) from None
    return MediaFile(path, info.size, info.frames, container=True, fps=info.fps or None)


def read_image(file: MediaFile) -> Image.Image:
    """The image as RGB."""
    try:
        with Image.open(file.path) as im:
            return im.convert("RGB")
    except Exception as e:  # noqa: BLE001 - changed or damaged since it was checked
        raise MediaError(f"{file.path}: cannot be read ({type(e).__name__}: {e})") from None


def read_video(file: MediaFile, limit: int | None = None) -> list[Image.Image]:
    """The video's frames (its first ``limit``) as RGB images."""
    from itertools import islice

    try:
        if file.container:
            from ..media.video import read_frames

            return read_frames(file.path, limit)
        with Image.open(file.path) as im:
            return [frame.convert("RGB") for frame in islice(ImageSequence.Iterator(im), limit)]
    except Exception as e:  # noqa: BLE001
        raise MediaError(f"{file.path}: cannot be read ({type(e).__name__}: {e})") from None
