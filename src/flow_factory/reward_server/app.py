"""The FastAPI app around a ``RewardServer``.

POST /score takes a ``ScoreRequest`` and answers ``{"rewards": [...]}``; GET /health says
what is served and how many requests and batches it has computed.

Concurrent requests are merged: a single worker takes every request waiting in the queue
(up to ``max_batch_size`` samples, same kwargs, not marked as groups) and computes them in
one ``compute_reward`` call in a thread, so the event loop keeps accepting requests and a
model sees larger batches under load. One call runs at a time: models need not be
thread-safe.

Errors: 401 wrong or missing bearer token, 413 body over the size limit, 422 a payload
that fails validation (the reason in ``detail``), 500 ``compute_reward`` raised (its
message in ``detail``). None of them stops the server.
"""

from __future__ import annotations

import asyncio
import hmac
import math
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from .base import RewardServer
from .wire import ScoreRequest, ScoreResponse, decode_request


class BodyLimit:
    """ASGI middleware: 413 once a request body passes ``max_bytes`` (by Content-Length, or
    while streaming when there is none), before anything parses it."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._reject(send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send):
        body = f'{{"detail":"request body over the {self.max_bytes}-byte limit"}}'.encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


@dataclass
class _Job:
    args: dict
    kwargs: dict
    group: bool
    future: asyncio.Future
    size: int = field(init=False)

    def __post_init__(self):
        self.size = len(self.args["prompts"])


class Batcher:
    def __init__(self, server: RewardServer):
        self.server = server
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()
        self.requests = 0
        self.batches = 0

    async def submit(self, args: dict, kwargs: dict, group: bool) -> list[float]:
        job = _Job(args, kwargs, group, asyncio.get_running_loop().create_future())
        await self.queue.put(job)
        return await job.future

    async def run(self) -> None:
        while True:
            jobs = [await self.queue.get()]
            while not self.queue.empty():
                jobs.append(self.queue.get_nowait())
            for batch in self._merge(jobs):
                await self._compute(batch)

    def _merge(self, jobs: list[_Job]) -> list[list[_Job]]:
        """Consecutive compatible jobs in batches of at most max_batch_size samples."""
        if not self.server.batchable:
            return [[j] for j in jobs]
        batches: list[list[_Job]] = []
        for job in jobs:
            last = batches[-1] if batches else None
            if (last and not job.group and not last[0].group and job.kwargs == last[0].kwargs
                    and sum(j.size for j in last) + job.size <= self.server.max_batch_size
                    and all((j.args[k] is None) == (job.args[k] is None) for j in last for k in job.args)):
                last.append(job)
            else:
                batches.append([job])
        return batches

    async def _compute(self, batch: list[_Job]) -> None:
        merged = {k: None if batch[0].args[k] is None else [x for j in batch for x in j.args[k]]
                  for k in batch[0].args}
        try:
            rewards = await asyncio.to_thread(self._call, merged, batch[0].kwargs)
        except Exception as e:  # noqa: BLE001 - reported to each waiting client
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(e)
            return
        self.batches += 1
        self.requests += len(batch)
        start = 0
        for job in batch:
            if not job.future.done():
                job.future.set_result(rewards[start:start + job.size])
            start += job.size

    def _call(self, args: dict, kwargs: dict) -> list[float]:
        conds = args.pop("condition_images")
        extra = dict(kwargs) | ({"condition_images": conds} if conds is not None else {})
        out = self.server.compute_reward(args["prompts"], args["images"], args["videos"], **extra)
        out = out.get("rewards") if isinstance(out, dict) else out
        rewards = [float(x) for x in (out.tolist() if hasattr(out, "tolist") else out)]
        if len(rewards) != len(args["prompts"]):
            raise ValueError(f"{type(self.server).__name__}.compute_reward returned {len(rewards)} rewards "
                             f"for {len(args['prompts'])} prompts")
        return rewards


def create_app(server: RewardServer, token: str | None = None, max_request_bytes: int = 64 * 2**20):
    batcher = Batcher(server)

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()

    app = FastAPI(title="Flow-Factory reward server", lifespan=lifespan)

    def authorise(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "missing or wrong bearer token (header 'Authorization: Bearer <token>')")

    @app.get("/health")
    async def health():
        return {"status": "ok", "reward": server.name or type(server).__name__,
                "requests": batcher.requests, "batches": batcher.batches}

    @app.post("/score", response_model=ScoreResponse, dependencies=[Depends(authorise)])
    async def score(req: ScoreRequest):
        try:
            args = await asyncio.to_thread(decode_request, req)
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        try:
            rewards = await batcher.submit(args, dict(req.kwargs), req.group)
        except Exception as e:  # noqa: BLE001
            return JSONResponse({"detail": f"compute_reward failed: {type(e).__name__}: {e}"}, status_code=500)
        if not all(math.isfinite(r) for r in rewards):
            return JSONResponse({"detail": f"compute_reward returned non-finite rewards {rewards}"}, status_code=500)
        return {"rewards": rewards}

    app.state.batcher = batcher
    return BodyLimit(app, max_request_bytes)
