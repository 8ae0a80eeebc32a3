"""Rewards computed by a reward server: ``ff-reward-server`` (or any ``RewardServer`` here), or a
server written for Flow-Factory, which speaks its ``/compute`` protocol (``flow_factory.wire``).

``RemotePointwiseRewardModel`` sends each chunk of ``batch_size`` samples as one request;
``RemoteGroupwiseRewardModel`` sends each group as one request (marked as a group on
``/score``; Flow-Factory's servers compute every request alone anyway). Images travel as PNG
(lossless: the server sees exactly the uint8 pixels a local reward would). Pair with
``async_reward: true`` to overlap requests with sampling. An answer whose rewards are not all
finite numbers (``NaN``, ``Infinity``, a string, null, a bool), or that carries an ``error``,
is an error naming the server's URL.

``protocol`` picks the route: ``score`` (this project's), ``compute`` (Flow-Factory's, in the
field names of its server template: ``prompt``, ``image``, ... see ``flow_factory.wire``), or
``auto`` (the default): before the first request, one empty POST to ``/score`` tells them
apart, since a server without that route answers 404 (or 405) and ours answers anything else
(422 for the empty body, 401 without the token). So a YAML entry copied from Flow-Factory's
guide, with no ``protocol`` key, works against either server.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from ..wire import ComputeRequest, ScoreRequest, encode_image
from .base import GroupwiseRewardModel, PointwiseRewardModel, RewardModelOutput
from .http_client import JsonClient, RemoteRewardError

PROTOCOLS = ("auto", "score", "compute")
NO_ROUTE = (404, 405)  # what a server without /score answers the probe


@dataclass(frozen=True)
class RemoteOptions:
    """A remote reward's own options (the reward entry's keys beyond the four every reward takes)."""

    server_url: str | None = None
    timeout: float = 60.0
    retry_attempts: int = 3
    backoff: float = 0.5
    api_key: str | None = None
    request_kwargs: dict | None = None
    image_format: str = "PNG"
    protocol: str = "auto"


class _RemoteReward:
    required_fields = ("prompt", "image", "video", "condition_images")
    use_tensor_inputs = False
    _group = False

    @classmethod
    def models_to_load(cls, options: dict) -> list[str]:
        return []  # the server loads its model

    @classmethod
    def servers_to_reach(cls, options: dict) -> list[str]:
        return [options["server_url"]] if options.get("server_url") else []

    def __init__(self, model_name_or_path=None, device="cpu", dtype=torch.float32, batch_size: int = 16,
                 **options):
        """``options``: the fields of ``RemoteOptions``; another name is a TypeError, as a misspelt keyword."""
        super().__init__(model_name_or_path, device, dtype, batch_size)
        o = RemoteOptions(**options)
        if o.server_url is None:
            raise ValueError(f"{type(self).__name__}: set server_url (e.g. http://127.0.0.1:8000)")
        if o.image_format.upper() not in ("PNG", "JPEG", "WEBP"):
            raise ValueError(f"image_format must be PNG, JPEG or WEBP, got {o.image_format!r}")
        if o.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {list(PROTOCOLS)} (score: ff-reward-server's /score; "
                             f"compute: Flow-Factory's /compute; auto: ask the server), got {o.protocol!r}")
        self.client = JsonClient(o.server_url, o.timeout, o.retry_attempts, o.backoff, o.api_key)
        self.request_kwargs = dict(o.request_kwargs or {})
        self.image_format = o.image_format.upper()
        self.protocol = o.protocol
        self._probing = threading.Lock()  # async workers share this model: one probe, not one per thread

    def __call__(self, prompt, image=None, video=None, condition_images=None) -> RewardModelOutput:
        def each(images):
            return None if images is None else [encode_image(im, self.image_format) for im in images]

        media = {"images": each(image), "videos": None if video is None else [each(f) for f in video],
                 "condition_images": None if condition_images is None else [each(c) for c in condition_images]}
        # built with the server's own request models: a payload it would refuse fails here, before sending
        if self.route() == "score":
            request = ScoreRequest(prompts=list(prompt), group=self._group, kwargs=self.request_kwargs, **media)
        else:
            request = ComputeRequest(prompts=list(prompt), extra=self.request_kwargs, **media)
        path = f"/{self.route()}"
        payload = request.model_dump(exclude_none=True) if path == "/score" else request.template_body()
        body = self.client.post(path, payload)
        rewards = self._rewards_in(body, len(prompt), path)
        return RewardModelOutput(rewards=torch.tensor(rewards, dtype=torch.float32))

    def route(self) -> str:
        """``score`` or ``compute``: as configured, or for ``auto`` what the server answers an
        empty POST to /score (asked once; a probe that fails is asked again next time)."""
        with self._probing:
            if self.protocol == "auto":
                status = self.client.status("/score", {})
                self.protocol = "compute" if status in NO_ROUTE else "score"
            return self.protocol

    def _rewards_in(self, body, n: int, path: str) -> list[float]:
        """The ``n`` rewards of an answer, or RemoteRewardError naming the server and the bad value.
        Python's json reads ``NaN`` and ``Infinity``: one of them would reach the loss, so each is checked."""
        url = f"{self.client.base_url}{path}"
        if isinstance(body, dict) and body.get("error"):  # how Flow-Factory's servers may report a failure
            raise RemoteRewardError(f"{url} answered error {str(body['error'])[:300]}")
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
    """Scores each sample on a remote reward server."""


class RemoteGroupwiseRewardModel(_RemoteReward, GroupwiseRewardModel):
    """Sends each whole group to a remote reward server in one request."""

    _group = True
