"""Prompts of their own lengths (Qwen-Image, Z-Image, HunyuanVideo-1.5, FLUX.2): padded to one length so that
any two batches' conditioning stack, and cut back for the transformer."""

from __future__ import annotations

import torch
from torch import Tensor


def pad_text(rows: list[Tensor], length: int) -> tuple[Tensor, Tensor]:
    """Text embeddings of one length per prompt, (L_i, D) each, as a (B, length, D) tensor padded with
    zeros and the (B, length) bool mask of the real tokens.

    Pipelines whose prompts keep their own lengths (Qwen-Image, Z-Image) pad a batch to its longest
    prompt; padded to one fixed length instead, any two batches' conditioning stack (the prompt cache,
    ``cat_cond``), and ``trim_text`` gives the transformer the pipeline's batch again.
    """
    longest = max(len(r) for r in rows)
    if longest > length:
        raise ValueError(f"a prompt of {longest} text tokens does not fit the padded length {length}")
    embeds = rows[0].new_zeros(len(rows), length, rows[0].shape[-1])
    mask = torch.zeros(len(rows), length, dtype=torch.bool, device=rows[0].device)
    for i, row in enumerate(rows):
        embeds[i, :len(row)], mask[i, :len(row)] = row, True
    return embeds, mask


def trim_text(embeds: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``pad_text``'s padding cut back to the longest prompt in the batch."""
    longest = int(mask.sum(1).max())
    return embeds[:, :longest], mask[:, :longest]
