"""Shared by the CLIP-family rewards (PickScore, CLIP, aesthetic): load a CLIPModel and
its processor through ``from_pretrained`` and turn images / prompts into unit-norm
embeddings. One place, so every CLIP reward preprocesses and normalises the same way."""

from __future__ import annotations

import torch
from PIL import Image

from .base import BaseRewardModel


def load_clip(reward: BaseRewardModel, model_path: str, processor_path: str) -> None:
    """Set ``reward.model`` (a CLIPModel, eval, on the reward's device and dtype) and
    ``reward.processor``. A hub id or a local folder; offline, a folder is the only way."""
    from transformers import AutoProcessor, CLIPModel

    try:
        reward.processor = AutoProcessor.from_pretrained(processor_path)
        model = CLIPModel.from_pretrained(model_path, dtype=reward.dtype)
    except OSError as e:
        raise OSError(f"{type(reward).__name__}: could not load the CLIP model {model_path!r} / processor "
                      f"{processor_path!r} (a hub id or a local folder with config.json and weights): {e}") from e
    reward.model = model.eval().requires_grad_(False).to(reward.device)


def clip_sources(options: dict, default_model: str) -> list[str]:
    """[model, processor] a CLIP reward's entry loads: its model_name_or_path (else ``default_model``) and
    processor_name_or_path (else the model's own)."""
    model = options.get("model_name_or_path") or default_model
    return [model, options.get("processor_name_or_path") or model]


@torch.no_grad()
def image_embeddings(reward: BaseRewardModel, images: list[Image.Image]) -> torch.Tensor:
    """(n, D) float32 unit vectors of ``get_image_features``."""
    pixels = reward.processor(images=images, return_tensors="pt")["pixel_values"]
    feats = reward.model.get_image_features(pixel_values=pixels.to(reward.device, reward.dtype))
    feats = _as_tensor(feats).float()
    return feats / feats.norm(dim=-1, keepdim=True)


@torch.no_grad()
def text_embeddings(reward: BaseRewardModel, prompts: list[str]) -> torch.Tensor:
    """(n, D) float32 unit vectors of ``get_text_features``; prompts truncated to 77 tokens."""
    tokens = reward.processor(text=list(prompts), padding=True, truncation=True, max_length=77,
                              return_tensors="pt")
    feats = reward.model.get_text_features(input_ids=tokens["input_ids"].to(reward.device),
                                           attention_mask=tokens["attention_mask"].to(reward.device))
    feats = _as_tensor(feats).float()
    return feats / feats.norm(dim=-1, keepdim=True)


def _as_tensor(out) -> torch.Tensor:
    # transformers 5 may return a model output with the projected features in pooler_output
    if isinstance(out, torch.Tensor):
        return out
    return out.pooler_output


def flatten_media(reward_name: str, image, video) -> tuple[list[Image.Image], torch.Tensor]:
    """Every picture to score and the sample each belongs to: an image is one picture, a video
    its frames (its score is the mean over frames, as the video reward of flow_grpo's scorers)."""
    if image is not None:
        return list(image), torch.arange(len(image))
    if video is not None:
        pictures = [frame for clip in video for frame in clip]
        owner = torch.tensor([i for i, clip in enumerate(video) for _ in clip])
        return pictures, owner
    raise ValueError(f"{reward_name} needs images or videos; got neither")


def mean_per_sample(values: torch.Tensor, owner: torch.Tensor, n: int) -> torch.Tensor:
    """Mean of ``values`` over the pictures of each of the ``n`` samples."""
    total = torch.zeros(n, dtype=values.dtype).index_add_(0, owner, values.cpu())
    count = torch.zeros(n, dtype=values.dtype).index_add_(0, owner, torch.ones_like(values.cpu()))
    return total / count
