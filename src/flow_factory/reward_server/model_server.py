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


class RewardModelServer(RewardServer):
    def __init__(self, reward: str, **options: Any):
        cls = resolve_reward_class(reward)
        self.model = cls(**options)
        self.name = reward
        # a groupwise reward must see each request (one group) alone
        self.batchable = not isinstance(self.model, GroupwiseRewardModel)
        self.max_batch_size = max(self.model.batch_size, 1) if self.batchable else 1

    def compute_reward(self, prompts, images, videos, condition_images=None, **kwargs):
        if kwargs:
            raise ValueError(f"{self.name} takes no request kwargs, got {sorted(kwargs)}")
        fields = {"prompt": prompts, "image": images, "video": videos, "condition_images": condition_images,
                  "condition_videos": None}
        if self.model.use_tensor_inputs:
            if images is not None:
                fields["image"] = _stack(images, "images")
            if videos is not None:
                fields["video"] = torch.stack([_stack(f, "video frames") for f in videos])
            if condition_images is not None:
                fields["condition_images"] = [_stack(c, "condition_images") for c in condition_images]
        step = len(prompts) if isinstance(self.model, GroupwiseRewardModel) else self.model.batch_size
        out = []
        for i in range(0, len(prompts), step):
            call = {k: None if fields[k] is None else fields[k][i:i + step] for k in self.model.required_fields}
            with torch.no_grad():
                result = self.model(**call)
            rewards = result.rewards if hasattr(result, "rewards") else result
            out.extend(torch.as_tensor(rewards, dtype=torch.float32).reshape(-1).tolist())
        return out
