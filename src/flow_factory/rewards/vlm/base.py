"""What the VLM judges share: the chat-completions client, image data URLs, one request per
sample sent concurrently, and the fallback policy for replies that cannot be scored."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch
from PIL import Image

from ...wire import encode_image
from ..base import PointwiseRewardModel, RewardModelOutput
from ..http_client import JsonClient


class UnscorableReply(ValueError):
    """The VLM's reply has not what the reward needs (message says what, with an excerpt)."""


def image_part(image: Image.Image) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + encode_image(image, "PNG")}}


@dataclass(frozen=True)
class JudgeOptions:
    """A VLM judge's own options: ``api_base_url`` (e.g. http://127.0.0.1:8000/v1), ``vlm_model``,
    ``api_key``, ``extra_kwargs`` (merged into every request), ``timeout``,
    ``retry_attempts``, ``max_concurrency`` (requests in flight per batch), and
    ``fallback_score``: the reward of a reply that cannot be scored; null (default) makes
    such a reply an error instead."""

    api_base_url: str | None = None
    vlm_model: str | None = None
    api_key: str | None = None
    extra_kwargs: dict | None = None
    timeout: float = 120.0
    retry_attempts: int = 2
    max_concurrency: int = 8
    fallback_score: float | None = None


class VLMJudge(PointwiseRewardModel):
    """Constructor options: the fields of ``JudgeOptions`` (and a subclass's own keywords)."""

    @classmethod
    def models_to_load(cls, options: dict) -> list[str]:
        return []  # model_name_or_path names the model the API serves

    @classmethod
    def servers_to_reach(cls, options: dict) -> list[str]:
        return [options["api_base_url"]] if options.get("api_base_url") else []

    def __init__(self, model_name_or_path=None, device="cpu", dtype=torch.float32, batch_size: int = 16,
                 **options):
        """``options``: the fields of ``JudgeOptions``; another name is a TypeError, as a misspelt keyword."""
        super().__init__(model_name_or_path, device, dtype, batch_size)
        o, name = JudgeOptions(**options), type(self).__name__
        if not o.api_base_url:
            raise ValueError(f"{name}: set api_base_url, the OpenAI-compatible API (e.g. http://127.0.0.1:8000/v1)")
        self.vlm_model = o.vlm_model or model_name_or_path
        if not self.vlm_model:
            raise ValueError(f"{name}: set vlm_model, the model name the API serves")
        if int(o.max_concurrency) < 1:
            raise ValueError(f"{name}: max_concurrency must be >= 1, got {o.max_concurrency}")
        self.client = JsonClient(o.api_base_url, o.timeout, o.retry_attempts, token=o.api_key, what="VLM API")
        self.extra_kwargs = dict(o.extra_kwargs or {})
        self.max_concurrency = int(o.max_concurrency)
        self.fallback_score = None if o.fallback_score is None else float(o.fallback_score)

    def chat(self, content: list[dict], **request: Any) -> dict:
        payload = {"model": self.vlm_model, "messages": [{"role": "user", "content": content}], **request,
                   **self.extra_kwargs}
        return self.client.post("/chat/completions", payload)

    def score_each(self, n: int, one: Callable[[int], float]) -> RewardModelOutput:
        """``one(i)`` for every sample, concurrently; unscorable replies get ``fallback_score``."""
        def safe(i: int) -> tuple[float, str | None]:
            try:
                return float(one(i)), None
            except UnscorableReply as e:
                if self.fallback_score is None:
                    raise UnscorableReply(f"{type(self).__name__}: sample {i}: {e} (set fallback_score to "
                                          f"score such replies instead of stopping)") from None
                return self.fallback_score, str(e)

        with ThreadPoolExecutor(min(self.max_concurrency, max(n, 1))) as pool:
            results = list(pool.map(safe, range(n)))
        return RewardModelOutput(rewards=torch.tensor([r for r, _ in results], dtype=torch.float32),
                                 extra_info={"unscorable": [e for _, e in results]})


def reply_text(body: Any) -> str:
    try:
        text = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise UnscorableReply(f"no choices[0].message.content in the reply {str(body)[:200]!r}") from None
    if not isinstance(text, str):
        raise UnscorableReply(f"choices[0].message.content is {type(text).__name__}, not text")
    return text
