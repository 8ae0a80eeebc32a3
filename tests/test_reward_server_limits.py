"""The reward server under hostile or unlucky traffic: pixel limits checked from image
headers before decoding (413) with memory measured to stay within the in-flight budget,
a failing request that does not fail the others merged with it, mixed image sizes on a
tensor-input reward, malformed bodies (4xx), authentication before the body is read,
token sources, and a client that refuses non-finite or non-numeric rewards.

Requests are made to merge without timing: the first compute_reward call is held until
/health says the other requests are queued behind it."""

import base64
import http.server
import json
import struct
import threading
import time
import zlib
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
import torch
import uvicorn
from PIL import Image

from flow_factory.reward_server import RewardServer
from flow_factory.reward_server.app import create_app
from flow_factory.rewards.http_client import RemoteRewardError
from flow_factory.rewards.remote import RemotePointwiseRewardModel
from flow_factory.wire import MAX_PIXELS, encode_image

from reward_servers import free_port, start_server, stop_server

ECHO = "reward_servers.MeanPixelServer"  # bench/reward_servers.py


# ---------------------------------------------------------------- helpers

@contextmanager
def serving(server: RewardServer, wrap=lambda app: app, **options):
    """``server`` behind uvicorn on a free loopback port, in a thread of this process (so a
    test can read the server object); ``wrap`` may wrap the ASGI app. Yields the base URL."""
    port = free_port()
    config = uvicorn.Config(wrap(create_app(server, **options)), host="127.0.0.1", port=port, log_level="warning")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    wait_until(lambda: uv.started, "uvicorn to start")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


def wait_until(condition, what: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {within:g} s for {what}")
        time.sleep(0.01)


def png(array: np.ndarray) -> str:
    return encode_image(Image.fromarray(array))


def solid_png(width: int, height: int, value: int = 51) -> str:
    """A single-colour PNG: a few KB on the wire, width*height*4 bytes once decoded."""
    return png(np.full((height, width, 3), value, np.uint8))


def header_only_png(width: int, height: int) -> str:
    """A PNG whose header declares width x height and whose pixel data is garbage: it can be
    measured but never decoded, so a 413 (not a 422) shows the size was checked first."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")
    return base64.b64encode(raw).decode()


def post(url: str, payload=None, token: str | None = None, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(f"{url}/score", headers=headers, timeout=60,
                      **({"json": payload} if payload is not None else {}), **kw)


def post_all(url: str, payloads: list[dict]) -> list[httpx.Response]:
    """Each payload from its own thread, all at once; the responses in payload order."""
    responses: list = [None] * len(payloads)

    def send(i):
        responses[i] = post(url, payloads[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return responses


class Gate:
    """Mixin: holds the first compute_reward call until ``release``, so requests sent
    meanwhile queue up and are merged into the next call. Records each call's prompts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[list[str]] = []
        self.released = threading.Event()

    def compute_reward(self, prompts, images, videos, **kwargs):
        self.calls.append(list(prompts))
        if len(self.calls) == 1:
            self.released.wait(timeout=60)
        return super().compute_reward(prompts, images, videos, **kwargs)


def merged_after_gate(url: str, server: Gate, payloads: list[dict]) -> list[httpx.Response]:
    """Sends ``payloads`` while a first request holds the gate, then opens it: they are
    computed in one merged call (the test asserts that from ``server.calls``)."""
    first = threading.Thread(target=post, args=(url, {"prompts": ["gate"], "images": [solid_png(8, 8)]}))
    first.start()
    wait_until(lambda: len(server.calls) == 1, "the first request to reach compute_reward")
    out: list = []
    senders = threading.Thread(target=lambda: out.extend(post_all(url, payloads)))
    senders.start()
    wait_until(lambda: httpx.get(f"{url}/health").json()["waiting"] == len(payloads),
               f"{len(payloads)} requests to queue behind the gate")
    server.released.set()
    senders.join()
    first.join()
    return out


# ---------------------------------------------------------------- pixel limits and memory

def rss_kib(pid: int, field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak so far) of a process, in KiB (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def test_a_request_over_the_pixel_budget_gets_413_and_memory_stays_within_the_in_flight_budget():
    side, per_request, in_flight = 1024, 8_000_000, 16_000_000  # --max-request-mpx 8, --max-inflight-mpx 16
    images_per_request = per_request // side**2  # 7: the most that fit
    image = solid_png(side, side)
    port = free_port()
    # One malloc arena, so RSS follows the memory the server holds: with glibc's default of an
    # arena per thread, each decoding thread's arena keeps what it freed for its next image
    # (bounded too, measured 100-150 MiB more here, but by the allocator, not by this server).
    proc = start_server(ECHO, port, "--max-request-mpx", "8", "--max-inflight-mpx", "16",
                        env={"MALLOC_ARENA_MAX": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        # 100 images: 105 Mpx (over 400 MB decoded) in a 0.4 MB body; refused from the headers
        r = post(url, {"prompts": ["a"] * 100, "images": [image] * 100})
        assert r.status_code == 413, r.text
        assert f"{100 * side**2} pixels" in r.text and f"limit of {per_request} pixels per request" in r.text
        # declared sizes are counted before decoding: these could not be decoded at all
        r = post(url, {"prompts": ["a"] * 3, "images": [header_only_png(2000, 2000)] * 3})
        assert r.status_code == 413 and "12000000 pixels" in r.text, r.text

        full = {"prompts": [f"{k} x" for k in range(images_per_request)], "images": [image] * images_per_request}
        assert post(url, full).status_code == 200  # warm-up: imports, thread pool, allocator
        baseline = rss_kib(proc.pid, "VmRSS") * 1024

        # 16 requests at once, each at the per-request limit: 117 Mpx, 470 MB were they all decoded
        # together; the in-flight budget lets only two be decoded at a time, the others wait.
        n_requests = 16
        responses = post_all(url, [full] * n_requests)
        assert [r.status_code for r in responses] == [200] * n_requests
        for r in responses:
            assert r.json()["rewards"] == pytest.approx([k + 51 / 255 for k in range(images_per_request)])
        peak = rss_kib(proc.pid, "VmHWM") * 1024
        health = httpx.get(f"{url}/health").json()
    finally:
        stop_server(proc)

    # PIL keeps 4 bytes a decoded RGB pixel (8 while converting from another mode); the rest of
    # a request (body, base64, compressed bytes) is a few hundred KB here: 32 MiB of slack.
    bound = baseline + 8 * in_flight + 32 * 2**20
    unbounded = 4 * n_requests * images_per_request * side**2
    assert unbounded > bound - baseline  # without the budget this test would fail
    assert peak <= bound, f"peak RSS {peak / 2**20:.0f} MiB over {bound / 2**20:.0f} MiB " \
                          f"(baseline {baseline / 2**20:.0f} MiB)"
    assert health["pixels_in_flight"] == 0 and health["limits"]["pixels_in_flight"] == in_flight


def test_one_image_over_the_per_image_limit_is_refused_from_its_header():
    with serving(MeanPixel()) as url:
        r = post(url, {"prompts": ["a"], "images": [header_only_png(5000, 5000)]})
        assert r.status_code == 413, r.text
        assert f"images[0]: 5000x5000 is over the {MAX_PIXELS}-pixel limit per image" in r.text


def test_the_in_flight_budget_must_hold_one_request():
    with pytest.raises(ValueError, match="a request must fit alone"):
        create_app(MeanPixel(), max_request_pixels=10, max_pixels_in_flight=5)


# ---------------------------------------------------------------- merged batches

class MeanPixel(RewardServer):
    def compute_reward(self, prompts, images, videos, **kwargs):
        return [float(np.asarray(im).mean() / 255) for im in images]


class FailsOnBadPrompt(Gate, MeanPixel):
    def compute_reward(self, prompts, images, videos, **kwargs):
        out = super().compute_reward(prompts, images, videos, **kwargs)
        if "bad" in prompts:
            raise ValueError("the prompt 'bad' cannot be scored")
        return out


def test_a_failing_request_merged_with_others_fails_alone():
    server = FailsOnBadPrompt()
    payloads = [{"prompts": [name], "images": [solid_png(8, 8, value)]}
                for name, value in [("one", 51), ("two", 102), ("bad", 0), ("three", 153)]]
    with serving(server) as url:
        responses = merged_after_gate(url, server, payloads)
        health = httpx.get(f"{url}/health").json()
    assert sorted(server.calls[1]) == ["bad", "one", "three", "two"]  # really merged into one call
    assert server.calls[2:] == [[p] for p in server.calls[1]]  # then each alone
    assert [r.status_code for r in responses] == [200, 200, 500, 200]
    assert [responses[i].json()["rewards"] for i in (0, 1, 3)] == [[0.2], [0.4], [0.6]]
    assert "ValueError: the prompt 'bad' cannot be scored" in responses[2].json()["detail"]
    assert health["requests"] == 4 and health["batches"] == 4  # the gate, then three alone


def test_mixed_image_sizes_on_a_tensor_input_reward_all_succeed():
    from flow_factory.reward_server.model_server import RewardModelServer
    from flow_factory.shapebench.reward import ShapeBenchReward

    class GatedShapeBench(Gate, RewardModelServer):
        pass

    def red_disc(size: int) -> np.ndarray:
        yy, xx = np.mgrid[:size, :size]
        image = np.full((size, size, 3), 255, np.uint8)
        image[(yy - size / 2) ** 2 + (xx - size / 2) ** 2 < (size / 4) ** 2] = (230, 30, 30)
        return image

    prompt = "a photo of a red circle"
    sizes = [64, 96, 64, 48]
    server = GatedShapeBench("shapebench")
    with serving(server) as url:
        responses = merged_after_gate(url, server, [{"prompts": [prompt], "images": [png(red_disc(s))]}
                                                    for s in sizes])
        one_request = post(url, {"prompts": [prompt] * 2, "images": [png(red_disc(64)), png(red_disc(80))]})
    assert len(server.calls[1]) == len(sizes)  # merged
    assert [r.status_code for r in responses] == [200] * len(sizes), [r.text for r in responses]
    assert one_request.status_code == 200, one_request.text
    local = ShapeBenchReward()
    expected = [local([prompt], torch.from_numpy(red_disc(s)).permute(2, 0, 1)[None] / 255).rewards.item()
                for s in sizes]
    assert [r.json()["rewards"][0] for r in responses] == pytest.approx(expected)
    assert max(expected) > 0


# ---------------------------------------------------------------- malformed bodies and authentication

def test_every_malformed_body_gets_422_with_the_reason():
    cases = [
        (b"\xff\xfe\x00{}", "body is not UTF-8 (byte 0xff at offset 0)"),
        (b'{"prompts": ["caf\xe9"]}', "body is not UTF-8 (byte 0xe9 at offset 17)"),
        (b"{not json", "Invalid JSON"),
        (b"", "Invalid JSON"),
        (b"[1, 2]", "Input should be an object"),
        (b'{"prompts": "a"}', "prompts: Input should be a valid array"),
        (b'{"prompts": ["a"], "images": ["x"], "pickle": "..."}', "pickle: Extra inputs are not permitted"),
        (b'{"prompts": ["a"], "images": ["not base64!!"]}', "images[0]: not valid base64"),
        (json.dumps({"prompts": ["a"], "images": [header_only_png(8, 8)]}).encode(),
         "images[0]: not a readable image"),
    ]
    with serving(MeanPixel()) as url:
        for body, reason in cases:
            r = httpx.post(f"{url}/score", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 422, (body[:40], r.status_code, r.text)
            assert reason in r.json()["detail"], (body[:40], r.text)
        assert post(url, {"prompts": ["a"], "images": [solid_png(4, 4, 51)]}).json() == {"rewards": [0.2]}


class BodyReads:
    """ASGI middleware (``wrap`` an app) counting the body messages the app asked for."""

    def __init__(self):
        self.app, self.count = None, 0

    def wrap(self, app):
        self.app = app
        return self

    async def __call__(self, scope, receive, send):
        async def counted_receive():
            message = await receive()
            self.count += message["type"] == "http.request"
            return message

        await self.app(scope, counted_receive, send)


def test_an_unauthenticated_request_is_refused_before_its_body_is_read():
    reads = BodyReads()
    garbage = b"\xff" * 2**20  # parsed, it would be a 422
    with serving(MeanPixel(), wrap=reads.wrap, token="s3cret") as url:
        for token in (None, "wrong"):
            r = post(url, token=token, content=garbage)
            assert r.status_code == 401, r.text
            assert "bearer token" in r.json()["detail"]
        assert reads.count == 0  # not a byte of the body was read
        assert post(url, token="s3cret", content=garbage).status_code == 422
        assert reads.count > 0


def test_the_token_comes_from_a_file_or_the_environment_and_stays_out_of_ps(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    env_port, file_port = free_port(), free_port()
    procs = [start_server(ECHO, env_port, env={"FF_REWARD_SERVER_TOKEN": "from-env"}),
             start_server(ECHO, file_port, "--token-file", str(token_file), env={"FF_REWARD_SERVER_TOKEN": ""})]
    try:
        payload = {"prompts": ["a"], "images": [solid_png(4, 4, 51)]}
        for port, token in [(env_port, "from-env"), (file_port, "from-file")]:
            url = f"http://127.0.0.1:{port}"
            assert post(url, payload).status_code == 401
            assert post(url, payload, token="wrong").status_code == 401
            assert post(url, payload, token=token).json() == {"rewards": [0.2]}
        for proc in procs:
            with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                assert b"from-" not in f.read()  # what `ps` shows
    finally:
        for proc in procs:
            stop_server(proc)

    from flow_factory.reward_server.cli import read_token

    def error(message):
        raise SystemExit(message)

    monkeypatch.setenv("FF_REWARD_SERVER_TOKEN", "from-env")
    assert read_token("given", None, error) == "given"
    assert read_token(None, token_file, error) == "from-file"
    assert read_token(None, None, error) == "from-env"
    monkeypatch.delenv("FF_REWARD_SERVER_TOKEN")
    assert read_token(None, None, error) is None
    with pytest.raises(SystemExit, match="not both"):
        read_token("given", token_file, error)
    with pytest.raises(SystemExit, match="cannot read it"):
        read_token(None, tmp_path / "missing", error)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SystemExit, match="empty file"):
        read_token(None, tmp_path / "empty", error)


# ---------------------------------------------------------------- the client

@contextmanager
def answering(body: bytes):
    """A stdlib HTTP server on loopback answering every POST with ``body`` (as JSON)."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("answer, bad", [
    ('{"rewards": [NaN, 1.0]}', "rewards[0] = nan (float)"),
    ('{"rewards": [1.0, Infinity]}', "rewards[1] = inf (float)"),
    ('{"rewards": [-Infinity, 1.0]}', "rewards[0] = -inf (float)"),
    ('{"rewards": [1e999, 1.0]}', "rewards[0] = inf (float)"),
    ('{"rewards": ["0.5", 1.0]}', "rewards[0] = '0.5' (str)"),
    ('{"rewards": [null, 1.0]}', "rewards[0] = None (NoneType)"),
    ('{"rewards": [true, 1.0]}', "rewards[0] = True (bool)"),
    ('{"rewards": [[1.0], 1.0]}', "rewards[0] = [1.0] (list)"),
    ('{"rewards": [1.0, 1%s]}' % ("0" * 400), "rewards[1] = 1000000000"),  # an int past the float range
])
def test_the_client_refuses_non_finite_or_non_numeric_rewards_naming_the_server(answer, bad):
    with answering(answer.encode()) as url:
        model = RemotePointwiseRewardModel(server_url=url, retry_attempts=0)
        with pytest.raises(RemoteRewardError) as info:
            model(["a", "b"], [Image.new("RGB", (4, 4))] * 2)
    message = str(info.value)
    assert f"{url}/score answered {bad}" in message and "expected a finite number" in message
