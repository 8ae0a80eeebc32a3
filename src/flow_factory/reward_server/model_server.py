"""Serving a Flow-Factory reward model (a built-in name or a reward class path).

Imported only for those: it needs torch and the reward's own dependencies, which a
plain ``RewardServer`` subclass does not.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..rewards import GroupwiseRewardModel, resolve_reward_class
from .base import RewardServer


def _stack(images, where: str) -> torch.Tensor:
    sizes = {im.size for im in images}
    if len(sizes) > 1:
        raise ValueError(f"{where}: a tensor-input reward needs images of one size, got {sorted(sizes)}")
    return torch.from_numpy(np.stack([np.asarray(im) for im in images])).permute(0, 3, 1, 2).float() / 255


def _size_of(samples: dict, i: int) -> tuple:
    """Sample ``i``'s image size and video frame size: samples of one size can share a tensor."""
    image = samples["image"][i].size if samples["image"] is not None else None
    frame = samples["video"][i][0].size if samples["video"] is not None and samples["video"][i] else None
    return image, frame


class RewardModelServer(RewardServer):
    def __init__(self, reward: str, **options: Any):
        cls = resolve_reward_class(reward)
        self.model = cls(**options)
        self.name = reward
        # a groupwise reward must see each request (one group) alone
        self.groupwise = isinstance(self.model, GroupwiseRewardModel)
        self.batchable = not self.groupwise
        self.max_batch_size = max(self.model.batch_size, 1) if self.batchable else 1

    def compute_reward(self, prompts, images, videos, condition_images=None, **kwargs):
        if kwargs:
            raise ValueError(f"{self.name} takes no request kwargs, got {sorted(kwargs)}")
        samples = {"prompt": prompts, "image": images, "video": videos, "condition_images": condition_images}
        if self.groupwise:  # one group, one call
            return self._score(samples)
        rewards = [0.0] * len(prompts)
        for chunk in self._chunks(samples):
            picked = {k: None if v is None else [v[i] for i in chunk] for k, v in samples.items()}
            for i, reward in zip(chunk, self._score(picked)):
                rewards[i] = reward
        return rewards

    def _chunks(self, samples: dict) -> list[list[int]]:
        """Sample indices in calls of at most batch_size; for a tensor-input reward each call
        holds one image size (merged requests may differ in size), in order of first appearance."""
        n = len(samples["prompt"])
        by_size: dict[tuple, list[int]] = {}
        for i in range(n):
            by_size.setdefault(_size_of(samples, i) if self.model.use_tensor_inputs else (), []).append(i)
        step = self.model.batch_size
        return [indices[k:k + step] for indices in by_size.values() for k in range(0, len(indices), step)]

    def _score(self, samples: dict) -> list[float]:
        """One call of the model on ``samples`` (PIL images, converted to tensors here when it
        takes tensors: a chunk at a time, so float copies stay small)."""
        fields = dict(samples, condition_videos=None)
        if self.model.use_tensor_inputs:
            if samples["image"] is not None:
                fields["image"] = _stack(samples["image"], "images")
            if samples["video"] is not None:
                fields["video"] = torch.stack([_stack(f, "video frames") for f in samples["video"]])
            if samples["condition_images"] is not None:
                fields["condition_images"] = [_stack(c, "condition_images") for c in samples["condition_images"]]
        call = {k: fields[k] for k in self.model.required_fields}
        with torch.no_grad():
            result = self.model(**call)
        rewards = result.rewards if hasattr(result, "rewards") else result
        return torch.as_tensor(rewards, dtype=torch.float32).reshape(-1).tolist()
