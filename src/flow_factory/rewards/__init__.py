"""Rewards: pointwise and groupwise reward models, their registry, and the RewardSet.

Built-in reward modules are not imported here: ``resolve_reward_class`` imports
only the module of the reward a config names, so a run never pays for (or needs)
the dependencies of rewards it does not use.

Layers, lowest first (each imports only those before it): ``base`` (the interface and
the one scoring path, ``model.score``), ``registry`` (names -> classes), ``async_pool``
(scoring while sampling), ``reward_set`` (building from ``RewardConfig`` entries). The
reward modules import ``base``; the remote ones also ``flow_factory.wire``, never the
reward server.
"""

from .base import (
    BaseRewardModel,
    GroupwiseRewardModel,
    PointwiseRewardModel,
    RewardInputs,
    RewardModelOutput,
    images_to_pil,
    videos_to_pil,
)
from .registry import register_reward, register_reward_model, registered_rewards, resolve_reward_class
from .reward_set import RewardSet, build_reward

__all__ = [
    "BaseRewardModel",
    "GroupwiseRewardModel",
    "PointwiseRewardModel",
    "RewardInputs",
    "RewardModelOutput",
    "RewardSet",
    "build_reward",
    "images_to_pil",
    "register_reward",
    "register_reward_model",
    "registered_rewards",
    "resolve_reward_class",
    "videos_to_pil",
]
