"""What a served reward implements, and how it starts on its own (``run``)."""

from __future__ import annotations

import os
from typing import Any, Sequence

from PIL import Image


class RewardServer:
    """Subclass and implement ``compute_reward``; serve it with ``ff-reward-server --reward
    pkg.mod.MyServer`` (constructor options from ``--option key=value``) or, as Flow-Factory's
    guide does, ``MyServer(host=..., port=...).run()``.

    ``compute_reward(prompts, images, videos, **kwargs)`` gets one entry per prompt:
    ``images`` a list of RGB PIL images or None, ``videos`` a list of frame lists or None,
    and in ``kwargs`` ``condition_images`` / ``condition_videos`` (a list per sample) when a
    client sent them, plus the request's own ``kwargs`` (JSON values). The three first
    arguments are passed by position, so Flow-Factory's spelling (``prompt, image, video``)
    works too. It returns one float per prompt.

    ``batchable``: concurrent requests may be concatenated into one call (a pointwise
    reward); a request marked as a group, and every Flow-Factory ``/compute`` request, is
    computed alone.

    The constructor's arguments are what ``run`` serves with; a subclass that does not call
    ``super().__init__`` gets the class defaults. The limits are ``ff-reward-server``'s
    (``--max-request-mb`` and so on, ``app.py``), and the token, when none is given, comes
    from ``$FF_REWARD_SERVER_TOKEN``. ``host`` defaults to loopback, unlike Flow-Factory's
    ``0.0.0.0``: pass ``host="0.0.0.0"`` (with a token) to serve other machines.
    """

    batchable: bool = True
    max_batch_size: int = 64  # samples per combined call
    name: str | None = None  # shown by /health; defaults to the class name
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    max_request_mb: float = 64.0
    max_request_mpx: float = 128.0
    max_inflight_mpx: float = 256.0

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, *, token: str | None = None,
                 max_request_mb: float = 64.0, max_request_mpx: float = 128.0, max_inflight_mpx: float = 256.0):
        self.host, self.port, self.token = host, int(port), token
        self.max_request_mb, self.max_request_mpx = max_request_mb, max_request_mpx
        self.max_inflight_mpx = max_inflight_mpx

    def compute_reward(self, prompts: list[str], images: list[Image.Image] | None,
                       videos: list[list[Image.Image]] | None, **kwargs: Any) -> Sequence[float]:
        raise NotImplementedError(f"{type(self).__name__} must implement compute_reward")

    def run(self) -> None:
        """Serve on ``host:port`` until stopped, as ``ff-reward-server`` would: both routes
        (``/score`` and Flow-Factory's ``/compute``), the token, the limits."""
        from .app import serve  # FastAPI and uvicorn: only a server that runs needs them

        serve(self, self.host, self.port, self.token or os.environ.get("FF_REWARD_SERVER_TOKEN") or None,
              self.max_request_mb, self.max_request_mpx, self.max_inflight_mpx)
