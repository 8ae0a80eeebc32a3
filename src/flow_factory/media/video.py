"""Video files through PyAV (FFmpeg's libraries, bundled with its wheel): probe, decode, write mp4.

``probe`` and ``read_frames`` read any container and codec FFmpeg does (mp4, mov, webm, mkv, avi,
GIF, ...). ``write_mp4`` writes H.264 in yuv420p at CRF 18, the codec and pixel format every
browser, tracker (wandb, swanlab) and player decodes; CRF 18 is x264's "visually lossless"
setting. yuv420p stores colour at half resolution in both directions, so an odd width or height
is padded by one row or column (a copy of the last one) to the even size it needs. A soundtrack
(``audio.soundtrack``) goes in as AAC, FFmpeg's own encoder, at its default 128 kbit/s. PyAV is
imported when a video is first read or written, not with the package.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image

from .audio import soundtrack

CRF = 18  # x264's constant quality: 0 lossless, 23 its default, 18 visually lossless


class VideoReadError(ValueError):
    """A file PyAV cannot read as a video: the message says why (the caller adds the file)."""


@dataclass(frozen=True)
class VideoInfo:
    frames: int
    fps: float
    size: tuple[int, int]  # (width, height), as Pillow gives an image's


def _open(path: Path):
    import av

    try:
        return av.open(str(path))
    except av.FFmpegError as e:  # its message without the file name, which the caller gives
        raise VideoReadError(f"cannot be read as a video ({e.strerror})") from None


def _video_stream(container):
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["no"]
        raise VideoReadError(f"has no video stream (it holds {', '.join(kinds)} streams)")
    return container.streams.video[0]


def probe(path: str | Path) -> VideoInfo:
    """Frame count, frames per second and size of the file's first video stream. The count is the
    container's when it records one (mp4, mov), else the demuxed packets' (webm, mkv): no decoding."""
    import av

    with _open(Path(path)) as container:
        stream = _video_stream(container)
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        frames = stream.frames
        if not frames:
            try:
                frames = sum(1 for packet in container.demux(stream) if packet.size)
            except av.FFmpegError as e:
                raise VideoReadError(f"is damaged ({e.strerror})") from None
        return VideoInfo(frames, float(rate) if rate else 0.0, (stream.codec_context.width, stream.codec_context.height))


def first_frame(path: str | Path) -> Image.Image:
    """The first frame, decoded: a file whose codec FFmpeg lacks, or whose data is damaged, fails here."""
    import av

    with _open(Path(path)) as container:
        stream = _video_stream(container)
        try:
            frame = next(container.decode(stream), None)
        except av.FFmpegError as e:
            raise VideoReadError(f"is damaged ({e.strerror})") from None
        if frame is None:
            raise VideoReadError("has no frame that decodes")
        return frame.to_image()


def read_frames(path: str | Path, limit: int | None = None) -> list[Image.Image]:
    """Every frame of the file's first video stream (its first ``limit``: decoding stops there), as RGB images."""
    import itertools

    import av

    with _open(Path(path)) as container:
        stream = _video_stream(container)
        stream.thread_type = "AUTO"
        try:
            return [frame.to_image() for frame in itertools.islice(container.decode(stream), limit)]
        except av.FFmpegError as e:
            raise VideoReadError(f"is damaged ({e.strerror})") from None


def _even(frame: np.ndarray) -> np.ndarray:
    h, w = frame.shape[:2]
    return np.pad(frame, ((0, h % 2), (0, w % 2), (0, 0)), mode="edge") if h % 2 or w % 2 else frame


def write_mp4(frames: list[Image.Image], path: str | Path, fps: float, audio=None,
              sample_rate: int | None = None) -> Path:
    """``frames`` (RGB images of one size) as an H.264 mp4 at ``fps``, with ``audio`` (channels, samples) at
    ``sample_rate`` as its soundtrack when given, written beside ``path`` and renamed onto it: ``path``
    holds the old file or the whole new one, never a part. Returns ``path``."""
    import av

    if not frames:
        raise ValueError("write_mp4: no frames")
    sound = None if audio is None else soundtrack(audio, sample_rate)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    for i, frame in enumerate(frames):
        if frame.size != frames[0].size:
            raise ValueError(f"write_mp4: frames of one size: frame {i} is {frame.width}x{frame.height}, "
                             f"frame 0 {frames[0].width}x{frames[0].height}")
    arrays = [_even(np.asarray(frame.convert("RGB"))) for frame in frames]
    try:
        # faststart: the index before the data, so a browser plays it while it downloads
        with av.open(str(tmp), mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
            stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
            stream.height, stream.width = arrays[0].shape[:2]
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": str(CRF)}
            if sound is not None:
                aac = container.add_stream("aac", rate=int(sample_rate))
                aac.layout = "stereo" if len(sound) == 2 else "mono"
            for array in arrays:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
            container.mux(stream.encode())  # the frames the encoder still holds
            if sound is not None:  # one frame of every sample: the encoder cuts it into AAC's frames
                frame = av.AudioFrame.from_ndarray(sound, format="fltp", layout=aac.layout.name)
                frame.sample_rate, frame.pts = int(sample_rate), 0
                container.mux(aac.encode(frame))
                container.mux(aac.encode())
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
