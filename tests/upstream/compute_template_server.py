"""A stand-in for Flow-Factory's reward server template, ``reward_server/example_server.py``
of https://github.com/X-GenGroup/Flow-Factory as of commit a0b2bc5 (2026-05-02), the
snapshot this project follows.

Written here, not copied (the stored copy of upstream's repository may be read but not
committed): it reads a request exactly as the template does, so a test against it shows what
a user of the template gets. What the template does, and this file repeats:

- GET /health answers ``{"status": "ok"}``; no other route exists (so POST /score is a 404).
- POST /compute takes any JSON object and reads ``data.get("prompt")``, then, when present
  and non-empty, ``image`` (base64 images), ``video`` (lists of base64 frames),
  ``condition_images`` and ``condition_videos``, each decoded to RGB PIL images; ``extra``
  is read but never passed on. A key it does not read (``prompts``, ``images``, ...) is
  ignored, so a request in another spelling reaches ``compute_reward`` with ``prompt=None``.
- It calls ``compute_reward(prompt=, image=, video=, condition_images=, condition_videos=)``
  and answers ``{"rewards": [...]}``; any exception is a 500 whose ``detail`` is its message.
- ``MyRewardServer`` scores each prompt with ``random.random()``; ``python THIS --host H
  --port P`` serves it.

To run the tests against upstream's own file instead, set ``FF_UPSTREAM_EXAMPLE_SERVER`` to
its path (tests/test_rewards_remote.py).
"""

import argparse
import base64
import io
import random
from typing import Any, Dict

import uvicorn
from fastapi import FastAPI, HTTPException
from PIL import Image


def decoded(media):
    """Nested lists of base64 strings -> the same lists of RGB PIL images."""
    if isinstance(media, str):
        return Image.open(io.BytesIO(base64.b64decode(media))).convert("RGB")
    return [decoded(item) for item in media]


class RewardServer:
    """Subclass and define ``compute_reward(prompt, image, video, condition_images, condition_videos)``."""

    def __init__(self, host: str = "0.0.0.0", port: int = 8000):
        self.host, self.port = host, port

    def compute_reward(self, prompt, image=None, video=None, condition_images=None, condition_videos=None):
        raise NotImplementedError

    def run(self):
        app = FastAPI(title="Reward Server")

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.post("/compute")
        async def compute(request: Dict[str, Any]):
            try:
                media = {key: decoded(request[key]) for key in
                         ("image", "video", "condition_images", "condition_videos") if request.get(key)}
                return {"rewards": self.compute_reward(prompt=request.get("prompt"), **media)}
            except Exception as e:  # as the template: every failure is a 500 with its message
                raise HTTPException(status_code=500, detail=str(e))

        uvicorn.run(app, host=self.host, port=self.port)


class MyRewardServer(RewardServer):
    def compute_reward(self, prompt, image=None, video=None, condition_images=None, condition_videos=None):
        return [random.random() for _ in prompt]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Reward Server")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    MyRewardServer(host=args.host, port=args.port).run()
