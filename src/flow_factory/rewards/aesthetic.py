"""Aesthetic score: a CLIP image embedding (unit norm) fed to a small head loaded from a file,
as the LAION aesthetic predictor that flow_grpo uses (CLIP ViT-L/14 + ``sac+logos+ava1-l14-linearMSE``).

The head is a chain of linear layers read from a state dict (``.safetensors``, or a
``.pt``/``.pth`` loaded with ``weights_only=True``, so no pickled code runs): one layer
(``weight``, ``bias``) is the linear predictor; several (``layers.0``, ``layers.2``, ...) are
the MLP, applied in index order. LAION's MLP has dropout but no activation between its
layers, so none is applied here either; the dropouts are identity at eval.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .base import PointwiseRewardModel, RewardModelOutput
from .clip_common import clip_sources, flatten_media, image_embeddings, load_clip, mean_per_sample

AESTHETIC_CLIP = "openai/clip-vit-large-patch14"


def load_linear_chain(path: str | Path) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """[(weight (out, in), bias (out,) or None), ...] in application order, shapes checked."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"aesthetic: head_path {str(path)!r} is not a file")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict):
        raise ValueError(f"aesthetic: {path} holds {type(state).__name__}, expected a state dict")
    prefixes = sorted({k[: -len("weight")] for k, v in state.items() if k.endswith("weight") and v.ndim == 2},
                      key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p)])
    if not prefixes:
        raise ValueError(f"aesthetic: {path} has no 2-D '*weight' tensors; keys: {sorted(state)[:10]}")
    chain = [(state[p + "weight"].float(), state[p + "bias"].float() if p + "bias" in state else None)
             for p in prefixes]
    for (w0, _), (w1, _), name in zip(chain, chain[1:], prefixes[1:]):
        if w1.shape[1] != w0.shape[0]:
            raise ValueError(f"aesthetic: {path}: layer {name}weight takes {w1.shape[1]} inputs but the "
                             f"layer before it gives {w0.shape[0]}")
    if chain[-1][0].shape[0] != 1:
        raise ValueError(f"aesthetic: {path}: the last layer must output 1 score, it outputs "
                         f"{chain[-1][0].shape[0]}")
    return chain


class Aesthetic(PointwiseRewardModel):
    required_fields = ("image", "video")

    def __init__(self, model_name_or_path: str | None = None, device="cpu", dtype=torch.float32,
                 batch_size: int = 32, head_path: str | None = None, processor_name_or_path: str | None = None):
        super().__init__(model_name_or_path or AESTHETIC_CLIP, device, dtype, batch_size)
        if head_path is None:
            raise ValueError("aesthetic: set head_path to the head's weights (e.g. LAION's "
                             "sac+logos+ava1-l14-linearMSE.pth, or a .safetensors state dict)")
        self.head = load_linear_chain(head_path)
        load_clip(self, self.model_name_or_path, processor_name_or_path or self.model_name_or_path)
        dim = self.model.config.projection_dim
        if self.head[0][0].shape[1] != dim:
            raise ValueError(f"aesthetic: head {head_path} takes {self.head[0][0].shape[1]}-d inputs but the "
                             f"CLIP model {self.model_name_or_path!r} embeds into {dim}")

    @classmethod
    def models_to_load(cls, options: dict) -> list[str]:
        return clip_sources(options, AESTHETIC_CLIP)

    def __call__(self, image=None, video=None) -> RewardModelOutput:
        pictures, owner = flatten_media("aesthetic", image, video)
        x = image_embeddings(self, pictures).cpu()
        for weight, bias in self.head:
            x = x @ weight.T + (bias if bias is not None else 0)
        return RewardModelOutput(rewards=mean_per_sample(x[:, 0], owner, len(image if image is not None else video)))
