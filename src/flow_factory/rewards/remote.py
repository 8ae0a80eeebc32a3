"""Rewards computed by a reward server (``ff-reward-server``, or anything speaking its
JSON: POST ``{server_url}/score``, see ``flow_factory.reward_server.wire``).

``RemotePointwiseRewardModel`` sends each chunk of ``batch_size`` samples as one
request; ``RemoteGroupwiseRewardModel`` sends each group as one request marked as a
group, which the server computes alone. Images travel as PNG (lossless: the server sees
exactly the uint8 pixels a local reward would). Pair with ``async_reward: true`` to
overlap requests with sampling.
"""

from __future__ import annotations

import torch

from ..reward_server.wire import encode_image
from .base import GroupwiseRewardModel, PointwiseRewardModel, RewardModelOutput
from .http_client import JsonClient, RemoteRewardError
from .registry import register_reward


class _RemoteReward:
    required_fields = ("prompt", "image", "video", "condition_images")
    use_tensor_inputs = False
    _group = False

    def __init__(self, model_name_or_path=None, device="cpu", dtype=torch.float32, batch_size: int = 16, *,
                 server_url: str | None = None, timeout: float = 60.0, retry_attempts: int = 3,
                 backoff: float = 0.5, api_key: str | None = None, request_kwargs: dict | None = None,
                 image_format: str = "PNG"):
        super().__init__(model_name_or_path, device, dtype, batch_size)
        if server_url is None:
            raise ValueError(f"{type(self).__name__}: set server_url (e.g. http://127.0.0.1:8000)")
        if image_format.upper() not in ("PNG", "JPEG", "WEBP"):
            raise ValueError(f"image_format must be PNG, JPEG or WEBP, got {image_format!r}")
        self.client = JsonClient(server_url, timeout, retry_attempts, backoff, api_key)
        self.request_kwargs = dict(request_kwargs or {})
        self.image_format = image_format.upper()

    def __call__(self, prompt, image=None, video=None, condition_images=None) -> RewardModelOutput:
        enc = lambda im: encode_image(im, self.image_format)  # noqa: E731
        payload = {"prompts": list(prompt), "group": self._group, "kwargs": self.request_kwargs}
        if image is not None:
            payload["images"] = [enc(im) for im in image]
        if video is not None:
            payload["videos"] = [[enc(f) for f in frames] for frames in video]
        if condition_images is not None:
            payload["condition_images"] = [[enc(c) for c in conds] for conds in condition_images]
        body = self.client.post("/score", payload)
        rewards = body.get("rewards") if isinstance(body, dict) else None
        if not isinstance(rewards, list) or len(rewards) != len(prompt):
            raise RemoteRewardError(f"{self.client.base_url}/score answered {str(body)[:200]}; expected "
                                    f"{{'rewards': [{len(prompt)} numbers]}}")
        return RewardModelOutput(rewards=torch.tensor(rewards, dtype=torch.float32))


@register_reward("remote")
class RemotePointwiseRewardModel(_RemoteReward, PointwiseRewardModel):
    """Scores each sample on a remote reward server (``ff-reward-server``)."""


@register_reward("remote_groupwise")
class RemoteGroupwiseRewardModel(_RemoteReward, GroupwiseRewardModel):
    """Sends each whole group to a remote reward server in one request."""

    _group = True
