"""Rewards computed by a reward server (``ff-reward-server``, or anything speaking its
JSON: POST ``{server_url}/score``, see ``flow_factory.wire``).

``RemotePointwiseRewardModel`` sends each chunk of ``batch_size`` samples as one
request; ``RemoteGroupwiseRewardModel`` sends each group as one request marked as a
group, which the server computes alone. Images travel as PNG (lossless: the server sees
exactly the uint8 pixels a local reward would). Pair with ``async_reward: true`` to
overlap requests with sampling. An answer whose rewards are not all finite numbers
(``NaN``, ``Infinity``, a string, null, a bool) is an error naming the server's URL.
"""

from __future__ import annotations

import math

import torch

from ..wire import ScoreRequest, encode_image
from .base import GroupwiseRewardModel, PointwiseRewardModel, RewardModelOutput
from .http_client import JsonClient, RemoteRewardError


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
        def each(images):
            return None if images is None else [encode_image(im, self.image_format) for im in images]

        # built with the server's own request model: a payload it would refuse fails here, before sending
        request = ScoreRequest(prompts=list(prompt), group=self._group, kwargs=self.request_kwargs,
                               images=each(image), videos=None if video is None else [each(f) for f in video],
                               condition_images=None if condition_images is None else [
                                   each(c) for c in condition_images])
        body = self.client.post("/score", request.model_dump(exclude_none=True))
        return RewardModelOutput(rewards=torch.tensor(self._rewards_in(body, len(prompt)), dtype=torch.float32))

    def _rewards_in(self, body, n: int) -> list[float]:
        """The ``n`` rewards of a /score answer, or RemoteRewardError naming the server and the bad value.
        Python's json reads ``NaN`` and ``Infinity``: one of them would reach the loss, so each is checked."""
        url = f"{self.client.base_url}/score"
        rewards = body.get("rewards") if isinstance(body, dict) else None
        if not isinstance(rewards, list) or len(rewards) != n:
            raise RemoteRewardError(f"{url} answered {str(body)[:200]}; expected {{'rewards': [{n} numbers]}}")
        for i, reward in enumerate(rewards):
            if not _finite_number(reward):
                raise RemoteRewardError(f"{url} answered rewards[{i}] = {repr(reward)[:80]} "
                                        f"({type(reward).__name__}); expected a finite number for each "
                                        f"of the {n} samples")
        return rewards


def _finite_number(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond the float range
        return False


class RemotePointwiseRewardModel(_RemoteReward, PointwiseRewardModel):
    """Scores each sample on a remote reward server (``ff-reward-server``)."""


class RemoteGroupwiseRewardModel(_RemoteReward, GroupwiseRewardModel):
    """Sends each whole group to a remote reward server in one request."""

    _group = True
