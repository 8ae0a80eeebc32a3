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


def check_audio(path: str | Path) -> float:
    """The duration in seconds of the first audio stream of ``path`` (a WAV, an mp4's soundtrack, ...), or a
    ValueError saying why it cannot serve."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise ValueError("has no audio stream")
            stream = container.streams.audio[0]
            if stream.duration is not None and stream.time_base:
                return float(stream.duration * stream.time_base)
            return sum(frame.samples for frame in container.decode(stream)) / stream.rate
    except av.FFmpegError as e:
        raise ValueError(f"cannot be read as audio ({e.strerror})") from None


def read_audio(path: str | Path, sample_rate: int, channels: int, seconds: float) -> np.ndarray:
    """The first ``seconds`` of the first audio stream of ``path``, resampled to ``sample_rate`` Hz with
    ``channels`` (1 or 2) channels by FFmpeg's resampler: float32 (channels, round(seconds x sample_rate)), padded
    with silence when the file is shorter."""
    import av

    resampler = av.AudioResampler(format="fltp", layout="mono" if channels == 1 else "stereo", rate=sample_rate)
    parts = []
    with av.open(str(path)) as container:
        for frame in container.decode(container.streams.audio[0]):
            parts += [out.to_ndarray() for out in resampler.resample(frame)]
    parts += [out.to_ndarray() for out in resampler.resample(None)]  # what the resampler still holds
    audio = np.concatenate(parts, axis=1) if parts else np.zeros((channels, 0), np.float32)
    wanted = max(round(seconds * sample_rate), 1)
    audio = audio[:, :wanted]
    return np.pad(audio, ((0, 0), (0, wanted - audio.shape[1]))).astype(np.float32)


def log_mel_spectrogram(waveforms, sample_rate: int, hop_length: int, mel_bins: int, n_fft: int = 1024):
    """(B, C, frames, mel_bins) natural-log magnitude mel spectrogram of (B, C, samples) waveforms (a torch
    tensor): a centred, reflect-padded STFT with a periodic Hann window of ``n_fft``, magnitudes (power 1) through
    Slaney-normalised Slaney-scale mel filters from 0 Hz to Nyquist, floored at 1e-5: LTX-2's audio VAE's input
    (Lightricks' front end, as Flow-Factory computes it)."""
    import torch
    from transformers.audio_utils import mel_filter_bank

    filters = torch.from_numpy(mel_filter_bank(n_fft // 2 + 1, mel_bins, 0.0, sample_rate / 2, sample_rate,
                                               norm="slaney", mel_scale="slaney")).float()
    b, c, n = waveforms.shape
    spec = torch.stft(waveforms.float().reshape(b * c, n), n_fft, hop_length, n_fft,
                      torch.hann_window(n_fft, device=waveforms.device), center=True, pad_mode="reflect",
                      return_complex=True).abs()  # (B C, freqs, frames)
    mel = torch.einsum("xft,fm->xtm", spec, filters.to(spec.device))
    return mel.clamp_min(1e-5).log().reshape(b, c, *mel.shape[1:])
