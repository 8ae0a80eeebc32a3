"""What a served reward implements."""

from __future__ import annotations

from typing import Any, Sequence

from PIL import Image


class RewardServer:
    """Subclass and implement ``compute_reward``; ``ff-reward-server --reward pkg.mod.MyServer``
    serves it. Constructor keyword options come from ``--option key=value``.

    ``compute_reward(prompts, images, videos, **kwargs)`` gets one entry per prompt:
    ``images`` a list of RGB PIL images or None, ``videos`` a list of frame lists or None,
    and in ``kwargs`` ``condition_images`` (a list per sample, or None) plus the request's
    own ``kwargs`` (JSON values). It returns one float per prompt.

    ``batchable``: concurrent requests may be concatenated into one call (a pointwise
    reward); a request marked as a group is always computed alone.
    """

    batchable: bool = True
    max_batch_size: int = 64  # samples per combined call
    name: str | None = None  # shown by /health; defaults to the class name

    def compute_reward(self, prompts: list[str], images: list[Image.Image] | None,
                       videos: list[list[Image.Image]] | None, **kwargs: Any) -> Sequence[float]:
        raise NotImplementedError(f"{type(self).__name__} must implement compute_reward")
