"""Soundtracks of a model with audio (LTX-2): checked, and written as a WAV file.

A soundtrack is (channels, samples), one or two channels, float in [-1, 1] (louder samples are
clipped, as a player would), at a sample rate in Hz. ``video.write_mp4`` muxes it into the mp4 as
AAC; a GIF holds no sound, so beside one it is written as 16-bit PCM WAV (the standard library's
``wave``), which every player opens.
"""

from __future__ import annotations

import io
import os
import wave
from pathlib import Path

import numpy as np


def soundtrack(audio, sample_rate: int | None) -> np.ndarray:
    """``audio`` (channels, samples) or (samples,), a tensor on the CPU or an array, as a float32 array
    (channels, samples) clipped to [-1, 1]; a ValueError says what is wrong with it."""
    array = np.asarray(audio, dtype=np.float32)
    array = array[None] if array.ndim == 1 else array
    if array.ndim != 2 or array.shape[0] not in (1, 2) or array.shape[1] == 0:
        raise ValueError(f"soundtrack of shape {tuple(np.shape(audio))}: expected (channels, samples) with 1 or 2 "
                         "channels and at least one sample")
    if not np.isfinite(array).all():
        raise ValueError("soundtrack: it holds non-finite samples")
    if not sample_rate or sample_rate <= 0:
        raise ValueError(f"soundtrack: sample rate {sample_rate!r}: expected a positive number of samples a second")
    return np.ascontiguousarray(np.clip(array, -1.0, 1.0))


def write_wav(audio, path: str | Path, sample_rate: int) -> Path:
    """``audio`` as a 16-bit PCM WAV file at ``path``, written beside it and renamed onto it. Returns ``path``."""
    array = soundtrack(audio, sample_rate)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(array.shape[0])
        f.setsampwidth(2)
        f.setframerate(int(sample_rate))
        f.writeframes((array.T * 32767).round().astype("<i2").tobytes())  # interleaved, little-endian
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
