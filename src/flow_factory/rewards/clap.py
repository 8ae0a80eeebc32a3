"""CLAP (LAION's contrastive language-audio model): cosine similarity of the prompt's and the sample's
soundtrack's CLAP embeddings, in [-1, 1], as Flow-Factory's ``clap`` reward (laion/larger_clap_general by
default) scores a model that makes sound (LTX-2).

Each waveform is mixed down to mono and resampled to the 48 kHz CLAP was trained at, then the checkpoint's own
``ClapProcessor`` makes its features (padding or truncating to its length). Flow-Factory resamples with
torchaudio's sinc filter; this uses scipy's polyphase filter (``resample_poly``), which keeps the same band:
the two differ by the filters' ripple, far below what moves a CLAP embedding.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .base import PointwiseRewardModel, RewardModelOutput

CLAP_MODEL = "laion/larger_clap_general"
CLAP_SAMPLE_RATE = 48_000  # the rate every released CLAP checkpoint's feature extractor expects


def mono_at(waveform: np.ndarray, rate: int, target: int = CLAP_SAMPLE_RATE) -> np.ndarray:
    """(channels, samples) or (samples,) at ``rate`` -> float32 (samples',) mono at ``target``."""
    from scipy.signal import resample_poly

    wave = np.asarray(waveform, dtype=np.float32)
    wave = wave.mean(axis=0) if wave.ndim == 2 else wave  # channels averaged, as Flow-Factory downmixes
    if rate != target:
        common = math.gcd(int(rate), target)
        wave = resample_poly(wave, target // common, int(rate) // common)
    return wave.astype(np.float32)


class ClapScore(PointwiseRewardModel):
    required_fields = ("prompt", "audio")

    def __init__(self, model_name_or_path: str | None = None, device="cpu", dtype=torch.float32,
                 batch_size: int = 16):
        super().__init__(model_name_or_path or CLAP_MODEL, device, dtype, batch_size)
        from transformers import ClapModel, ClapProcessor

        try:
            self.processor = ClapProcessor.from_pretrained(self.model_name_or_path)
            model = ClapModel.from_pretrained(self.model_name_or_path, dtype=self.dtype)
        except OSError as e:
            raise OSError(f"ClapScore: could not load the CLAP model {self.model_name_or_path!r} (a hub id or a "
                          f"local folder with config.json, weights and the processor's files): {e}") from e
        self.model = model.eval().requires_grad_(False).to(self.device)

    @classmethod
    def models_to_load(cls, options: dict) -> list[str]:
        return [options.get("model_name_or_path") or CLAP_MODEL]

    @torch.no_grad()
    def __call__(self, prompt, audio=None, audio_sample_rate=None) -> RewardModelOutput:
        if audio is None or not audio_sample_rate:
            raise ValueError("clap scores a sample's soundtrack: it needs the audio and its audio_sample_rate "
                             "(a model that makes sound, such as ltx2_t2av)")
        waves = [mono_at(wave, audio_sample_rate[0]) for wave in audio]
        inputs = self.processor(text=list(prompt), audio=waves, sampling_rate=CLAP_SAMPLE_RATE,
                                return_tensors="pt", padding=True, truncation=True)
        inputs = {k: v.to(self.device, self.dtype) if v.is_floating_point() else v.to(self.device)
                  for k, v in inputs.items()}
        out = self.model(**inputs)
        sound = torch.nn.functional.normalize(out.audio_embeds.float(), dim=-1)
        text = torch.nn.functional.normalize(out.text_embeds.float(), dim=-1)
        return RewardModelOutput(rewards=(sound * text).sum(-1).cpu())
