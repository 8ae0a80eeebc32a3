"""The FastAPI app around a ``RewardServer``, and ``serve`` (the CLI's and ``RewardServer.run``'s).

POST /score takes a ``ScoreRequest`` and answers ``{"rewards": [...]}``; POST /compute takes
Flow-Factory's ``ComputeRequest`` (``flow_factory.wire``) and answers the same, under the same
token, limits and checks, each request computed alone (Flow-Factory's requests carry no group
mark, and a groupwise server must not see two groups merged). GET /health says what is
served, how many requests and batches it has computed, what is waiting, and the limits.

Order of work on a request, cheapest check first: the declared body size
(Content-Length), the bearer token (before any of the body is read, so an unauthenticated
client cannot make the server read or parse anything), the body's size as it arrives, the
JSON, each image's header (format, width, height), the request's pixels, then a wait for
room in the pixels in flight, and only then decoding.

Memory is bounded: a body holds at most ``max_request_bytes``; one request's images at
most ``max_request_pixels`` (as their headers declare, checked before decoding); and the
images of all requests decoded and not yet answered at most ``max_pixels_in_flight``: a
request that would pass it waits until others are answered. PIL keeps 4 bytes a pixel for
RGB (8 for a moment while another mode is converted).

Concurrent requests are merged: a single worker takes every request waiting in the queue
(up to ``max_batch_size`` samples, same kwargs, not marked as groups) and computes them in
one ``compute_reward`` call in a thread, so the event loop keeps accepting requests and a
model sees larger batches under load. One call runs at a time: models need not be
thread-safe. When a merged call raises, each of its requests is computed again alone, so
only a request that fails by itself gets an error.

Errors (``detail`` says what is wrong and what is valid): 401 wrong or missing bearer
token; 413 body over the byte limit, an image over ``MAX_PIXELS``, or a request's images
over the pixel limit; 422 a body that is not UTF-8 JSON of the request's shape, or an
image that is not valid base64 PNG/JPEG/WebP; 500 ``compute_reward`` raised on this
request alone or returned non-finite rewards. None of them stops the server.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import ValidationError

from ..wire import (MAX_PIXELS, ComputeRequest, OpenedRequest, ScoreRequest, ScoreResponse, TooManyPixels,
                    open_request)


class Served(Protocol):
    """What the app reads of a ``RewardServer`` (``base.py``, which imports this module to ``run``)."""

    batchable: bool
    max_batch_size: int
    name: str | None

    def compute_reward(self, prompts, images, videos, **kwargs): ...


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


class PixelBudget:
    """Pixels decoded and not yet answered, across concurrent requests. ``reserve(n)`` waits
    until ``n`` more fit under ``limit``. Waiters go in arrival order (asyncio.Lock is FIFO),
    so a large request is not starved by a stream of small ones."""

    def __init__(self, limit: int):
        self.limit, self.in_use = limit, 0
        self._turn = asyncio.Lock()
        self._freed = asyncio.Condition()

    @asynccontextmanager
    async def reserve(self, pixels: int):
        if pixels > self.limit:  # would wait forever; create_app keeps the request limit below
            raise ValueError(f"{pixels} pixels can never fit in a budget of {self.limit}")
        async with self._turn:
            async with self._freed:
                await self._freed.wait_for(lambda: self.in_use + pixels <= self.limit)
                self.in_use += pixels
        try:
            yield
        finally:
            async with self._freed:
                self.in_use -= pixels
                self._freed.notify_all()


class ComputeFailed(Exception):
    """``compute_reward`` raised on a request computed alone; the message names the error."""


@dataclass
class _Job:
    args: dict | None  # the decoded media; dropped once answered, so the pixel budget holds true
    kwargs: dict
    group: bool
    future: asyncio.Future
    size: int = field(init=False)

    def __post_init__(self):
        self.size = len(self.args["prompts"])

    def answer(self, rewards: list[float] | None = None, error: str | None = None) -> None:
        self.args = None
        if self.future.done():  # the client went away
            return
        if error is None:
            self.future.set_result(rewards)
        else:
            self.future.set_exception(ComputeFailed(error))


class Batcher:
    def __init__(self, server: Served):
        self.server = server
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()
        self.requests = 0  # answered with rewards
        self.batches = 0  # compute_reward calls that returned

    def submit(self, args: dict, kwargs: dict, group: bool) -> asyncio.Future:
        """Queue a request; the future gets its rewards, or ComputeFailed."""
        job = _Job(args, kwargs, group, asyncio.get_running_loop().create_future())
        self.queue.put_nowait(job)
        return job.future

    async def run(self) -> None:
        while True:
            await self._compute_waiting()

    async def _compute_waiting(self) -> None:
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
        rewards, error = await self._try_call(batch)
        if error is None:
            self.batches += 1
            self.requests += len(batch)
            start = 0
            for job in batch:
                job.answer(rewards[start:start + job.size])
                start += job.size
        elif len(batch) == 1:
            batch[0].answer(error=error)
        else:
            # One request may be what failed: compute each alone, so the others still get rewards
            # (a training client does not retry a 500, and the batch may hold other runs' requests).
            for job in batch:
                await self._compute([job])

    async def _try_call(self, batch: list[_Job]) -> tuple[list[float] | None, str | None]:
        """(rewards, None) for the batch's requests merged into one call, or (None, the error)."""
        merged = {k: None if batch[0].args[k] is None else [x for j in batch for x in j.args[k]]
                  for k in batch[0].args}
        try:
            return await asyncio.to_thread(self._call, merged, batch[0].kwargs), None
        except Exception as e:  # noqa: BLE001 - reported to the client(s)
            # a message, not the exception: its traceback would keep the batch's images alive
            return None, f"{type(e).__name__}: {e}"

    def _call(self, args: dict, kwargs: dict) -> list[float]:
        # condition media are passed only when sent: a compute_reward(prompts, images, videos)
        # without **kwargs (as Flow-Factory's guide writes one) still serves plain requests
        conds = {k: args.pop(k) for k in ("condition_images", "condition_videos")}
        extra = dict(kwargs) | {k: v for k, v in conds.items() if v is not None}
        out = self.server.compute_reward(args["prompts"], args["images"], args["videos"], **extra)
        out = out.get("rewards") if isinstance(out, dict) else out
        rewards = [float(x) for x in (out.tolist() if hasattr(out, "tolist") else out)]
        if len(rewards) != len(args["prompts"]):
            raise ValueError(f"{type(self.server).__name__}.compute_reward returned {len(rewards)} rewards "
                             f"for {len(args['prompts'])} prompts")
        return rewards


def parse_request(body: bytes, shape: type[ScoreRequest] | type[ComputeRequest] = ScoreRequest):
    """``body`` as a ``shape`` (ScoreRequest or ComputeRequest), or 422 naming what is wrong with it."""
    try:
        return shape.model_validate_json(body)
    except ValidationError as e:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as u:
            raise HTTPException(422, f"body is not UTF-8 (byte {body[u.start]:#04x} at offset {u.start}); "
                                     "send a JSON object encoded as UTF-8") from None
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}"
                             for err in e.errors(include_url=False, include_input=False))
        raise HTTPException(422, f"{problems} (expected a JSON object with keys {sorted(shape.model_fields)}, "
                                 f"see flow_factory.wire.{shape.__name__})") from None


def create_app(server: Served, token: str | None = None, max_request_bytes: int = 64 * 2**20,
               max_request_pixels: int = 128 * 10**6, max_pixels_in_flight: int = 256 * 10**6):
    if not 0 < max_request_pixels <= max_pixels_in_flight:
        raise ValueError(f"need 0 < max_request_pixels <= max_pixels_in_flight (a request must fit alone), got "
                         f"{max_request_pixels} and {max_pixels_in_flight}")
    batcher = Batcher(server)
    budget = PixelBudget(max_pixels_in_flight)

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(batcher.run())
        yield
        task.cancel()

    app = FastAPI(title="Flow-Factory reward server", lifespan=lifespan)
    limits = {"request_bytes": max_request_bytes, "image_pixels": MAX_PIXELS,
              "request_pixels": max_request_pixels, "pixels_in_flight": max_pixels_in_flight}

    @app.get("/health")
    async def health():
        return {"status": "ok", "reward": server.name or type(server).__name__,
                "requests": batcher.requests, "batches": batcher.batches, "waiting": batcher.queue.qsize(),
                "pixels_in_flight": budget.in_use, "limits": limits}

    _add_scoring_routes(app, _authoriser(token), _answerer(batcher, budget, max_request_pixels))
    app.state.batcher = batcher
    app.state.pixel_budget = budget
    return BodyLimit(app, max_request_bytes)


def _authoriser(token: str | None):
    """The dependency that refuses a request without ``Authorization: Bearer <token>`` (none when no token)."""
    def authorise(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise HTTPException(401, "missing or wrong bearer token (header 'Authorization: Bearer <token>')")
    return authorise


def _answerer(batcher: Batcher, budget: PixelBudget, max_request_pixels: int):
    """``answer(req, kwargs, group)``: the work of both routes once the body is parsed: headers, pixel limit,
    budget, decode, compute."""
    def check_pixels(opened: OpenedRequest) -> None:
        if opened.pixels > max_request_pixels:
            raise HTTPException(413, f"the request's images hold {opened.pixels} pixels, over the limit of "
                                     f"{max_request_pixels} pixels per request (ff-reward-server "
                                     f"--max-request-mpx); send fewer or smaller images per request "
                                     f"(e.g. a smaller batch_size)")

    async def decode_and_score(opened: OpenedRequest, kwargs: dict, group: bool) -> list[float]:
        try:
            args = await asyncio.to_thread(opened.decode)
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        answer = batcher.submit(args, kwargs, group)
        del args  # only the queued job holds the images now; it drops them once answered
        try:
            return await answer
        except ComputeFailed as e:
            raise HTTPException(500, f"compute_reward failed: {e}") from None

    async def answer(req: ScoreRequest | ComputeRequest, kwargs: dict, group: bool) -> dict:
        try:
            opened = await asyncio.to_thread(open_request, req)
        except TooManyPixels as e:
            raise HTTPException(413, str(e)) from None
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        check_pixels(opened)
        async with budget.reserve(opened.pixels):
            rewards = await decode_and_score(opened, kwargs, group)
        if not all(math.isfinite(r) for r in rewards):
            raise HTTPException(500, f"compute_reward returned non-finite rewards {rewards}")
        return {"rewards": rewards}
    return answer


def _add_scoring_routes(app: FastAPI, authorise, answer) -> None:
    """``/score`` (this project's) and ``/compute`` (Flow-Factory's), both answered by ``answer``."""
    def documented_body(shape) -> dict:
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": shape.model_json_schema()}}}}

    # The body is read inside the handler, not declared as a parameter: FastAPI would read
    # and parse a declared body before running the authorise dependency.
    @app.post("/score", response_model=ScoreResponse, dependencies=[Depends(authorise)],
              openapi_extra=documented_body(ScoreRequest))
    async def score(request: Request):
        req = parse_request(await request.body(), ScoreRequest)
        return await answer(req, dict(req.kwargs), req.group)

    @app.post("/compute", response_model=ScoreResponse, dependencies=[Depends(authorise)],
              openapi_extra=documented_body(ComputeRequest))
    async def compute(request: Request):
        req = parse_request(await request.body(), ComputeRequest)
        return await answer(req, dict(req.extra), group=True)


def serve(server: Served, host: str, port: int, token: str | None = None, max_request_mb: float = 64.0,
          max_request_mpx: float = 128.0, max_inflight_mpx: float = 256.0) -> None:
    """Serve ``server`` with uvicorn until stopped: ``ff-reward-server`` and ``RewardServer.run`` both end here."""
    import uvicorn

    app = create_app(server, token=token, max_request_bytes=int(max_request_mb * 2**20),
                     max_request_pixels=int(max_request_mpx * 10**6),
                     max_pixels_in_flight=int(max_inflight_mpx * 10**6))
    print(f"ff-reward-server: serving {server.name or type(server).__name__} on http://{host}:{port}"
          f" ({'bearer token required' if token else 'no token: anyone who can connect may score'})",
          file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
