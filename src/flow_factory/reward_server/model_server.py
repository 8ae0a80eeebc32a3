"""Serving a Flow-Factory reward model (a built-in name or a reward class path).

Imported only for those: it needs torch and the reward's own dependencies, which a
plain ``RewardServer`` subclass does not. Scoring is the reward's own ``score``, the
path training uses: the same chunks of ``batch_size``, fields and PIL / tensor inputs.
Merged requests may hold images of several sizes; ``score`` calls a tensor-input reward
once per size.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config.rewards import parse_reward_entries
from ..rewards import GroupwiseRewardModel, RewardInputs, build_reward
from .base import RewardServer


class RewardModelServer(RewardServer):
    def __init__(self, reward: str, **options: Any):
        # built as a run builds it (either constructor form), from the entry a config would hold
        entry = parse_reward_entries([{"reward_model": reward, **options}])[0]
        self.model = build_reward(entry)
        self.name = reward
        # a groupwise reward must see each request (one group) alone
        self.batchable = not isinstance(self.model, GroupwiseRewardModel)
        self.max_batch_size = self.model.batch_size if self.batchable else 1

    def compute_reward(self, prompts, images, videos, condition_images=None, **kwargs):
        if kwargs:
            raise ValueError(f"{self.name} takes no request kwargs, got {sorted(kwargs)}")
        inputs = RewardInputs(list(prompts), images, videos, condition_images)
        one_group = torch.zeros(len(inputs), dtype=torch.long)  # read by a groupwise reward only
        return self.model.score(inputs, one_group).tolist()
