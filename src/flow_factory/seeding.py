"""Per-purpose random generators derived from (seed, epoch, index, ...).

Every random draw of an epoch comes from a generator seeded by what it is for,
not from a global stream, so a resumed run, or one with a different batch size
or number of processes, draws exactly the same noise for the same sample.
"""

from __future__ import annotations

import hashlib

import torch


def derived_seed(*parts: int | str) -> int:
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator(*parts: int | str) -> torch.Generator:
    return torch.Generator().manual_seed(derived_seed(*parts))


def per_sample_noise(adapter, keys: list[tuple], height: int, width: int, num_frames: int | None) -> torch.Tensor:
    """One initial latent per key; equal keys give equal latents (``same_latent`` shares a key per group)."""
    return torch.cat([
        adapter.initial_noise(1, height, width, generator(*key), num_frames=num_frames) for key in keys
    ])
