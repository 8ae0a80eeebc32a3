"""Flow-Factory's reward server contract and its wire protocol, both ways.

- A server written as the guide writes it (``RewardServer`` subclass, ``__init__(**kwargs)``,
  ``MyRewardServer(host=, port=).run()``), started as a script, serves a training run through
  both client paths the guide names (``flow_factory.rewards.remote.*`` and
  ``flow_factory.rewards.my_reward_remote.*``), under its token.
- A minimal server speaking only Flow-Factory's ``POST /compute`` (written here with
  http.server, importing nothing of this package, reading the fields Flow-Factory's server
  template reads) serves our client, from the guide's YAML entry with no ``protocol`` key.
- ``ff-reward-server``'s app answers the request Flow-Factory's client sends (its field names),
  with the token, the pixel limits and the per-request checks still applied.
"""

import base64
import http.server
import io
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from helpers_runs import tiny_run_config
from PIL import Image

from flow_factory.config import parse_config
from flow_factory.reward_server import RewardServer
from flow_factory.reward_server.app import create_app
from flow_factory.reward_server.model_server import RewardModelServer
from flow_factory.rewards import RewardInputs, RewardSet, my_reward_remote, remote
from flow_factory.rewards.base import to_uint8_hwc
from flow_factory.trainer import Trainer
from flow_factory.wire import encode_image

TOKEN = "guide-token"

# The guide's server file, as a user writes it (the model: mean pixel value plus 0.25).
GUIDE_SERVER = textwrap.dedent('''
    import argparse
    from typing import List, Optional

    import numpy as np
    from PIL import Image

    from flow_factory.reward_server import RewardServer


    class MyRewardServer(RewardServer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.offset = 0.25  # stands for a loaded model

        def compute_reward(
            self,
            prompts: List[str],
            images: Optional[List[Image.Image]] = None,
            videos: Optional[List[List[Image.Image]]] = None,
            **kwargs,
        ) -> List[float]:
            return [float(np.asarray(im, dtype=np.float64).mean() / 255) + self.offset for im in images]


    if __name__ == "__main__":
        parser = argparse.ArgumentParser(description="Reward Server")
        parser.add_argument("--host", default="0.0.0.0")
        parser.add_argument("--port", type=int, default=8000)
        args = parser.parse_args()

        server = MyRewardServer(host=args.host, port=args.port)
        server.run()
''')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def brightness(media: torch.Tensor) -> np.ndarray:
    """Mean pixel value of each image after the uint8 rounding the client sends (PNG, lossless)."""
    return to_uint8_hwc(media).astype(np.float64).mean(axis=(1, 2, 3)) / 255


def b64_png(value: int, size: int = 8) -> str:
    return encode_image(Image.new("RGB", (size, size), (value, value, value)))


def small_trainer(tmp_path, model_path, rewards: list[dict]) -> Trainer:
    config = tiny_run_config(tmp_path, "sd3-5", model_path, max_epochs=2)
    config["eval"]["eval_freq"] = 0
    config["log"].update(logging_backend="none", save_freq=0)
    config["rewards"] = rewards
    return Trainer(parse_config(config))


def train_and_check(trainer: Trainer, expected_of_media) -> dict:
    """Sample epoch 0 and check each reward against ``expected_of_media``; train 2 epochs, whose
    first samples the same images; return the sampled rewards."""
    rollouts = trainer.sample_epoch(0)
    expected = expected_of_media(rollouts.media)
    for name, scores in rollouts.rewards.items():
        np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-5, err_msg=name)
    history = trainer.train()
    assert [record["epoch"] for record in history] == [0, 1]
    for name in rollouts.rewards:
        assert history[0][f"reward/{name}/mean"] == pytest.approx(expected.mean(), rel=1e-5)
        assert np.isfinite(history[1][f"reward/{name}/mean"])
    return rollouts.rewards


# ------------------------------------------------------------ the guide's server, run()


@pytest.fixture(scope="module")
def guide_server(tmp_path_factory):
    script = tmp_path_factory.mktemp("guide") / "my_reward_server.py"
    script.write_text(GUIDE_SERVER)
    port = free_port()
    env = {**os.environ, "FF_REWARD_SERVER_TOKEN": TOKEN}  # run() takes the token from the environment
    proc = subprocess.Popen([sys.executable, str(script), "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the guide's server exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError("the guide's server did not answer /health within 60 s") from None
            time.sleep(0.05)
    yield url
    proc.kill()
    proc.wait(timeout=10)
    proc.stdout.close()


def test_the_guides_server_run_serves_training_through_both_client_paths(guide_server, tmp_path, tiny_sd3_path):
    common = {"server_url": guide_server, "api_key": TOKEN}
    trainer = small_trainer(tmp_path, tiny_sd3_path, [
        {"name": "remote", "reward_model": "flow_factory.rewards.remote.RemotePointwiseRewardModel",
         "batch_size": 2, **common},
        {"name": "guide_path", "reward_model": "flow_factory.rewards.my_reward_remote.RemotePointwiseRewardModel",
         "batch_size": 1, "async_reward": True, "num_workers": 2, "timeout": 30.0, "retry_attempts": 1, **common},
        {"name": "group", "reward_model": "flow_factory.rewards.my_reward_remote.RemoteGroupwiseRewardModel",
         **common},
    ])
    models = trainer.rewards.models
    assert type(models["remote"]) is type(models["guide_path"]) is remote.RemotePointwiseRewardModel
    assert my_reward_remote.RemoteGroupwiseRewardModel is remote.RemoteGroupwiseRewardModel
    train_and_check(trainer, lambda media: brightness(media) + 0.25)
    # our server: the client found /score and stayed on it
    assert {m.protocol for m in models.values()} == {"score"}


def test_the_guides_server_applies_its_token_and_answers_flow_factorys_request_shape(guide_server):
    upstream = {"prompt": ["a", "b"], "image": [b64_png(51), b64_png(102)], "video": None,
                "condition_images": None, "condition_videos": None, "kwargs": None}
    assert httpx.post(guide_server + "/compute", json=upstream, timeout=10).status_code == 401
    answer = httpx.post(guide_server + "/compute", json=upstream, timeout=10,
                        headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200
    assert answer.json()["rewards"] == pytest.approx([0.2 + 0.25, 0.4 + 0.25])


# ------------------------------------------------- a server that speaks only /compute


class UpstreamOnlyHandler(http.server.BaseHTTPRequestHandler):
    """Flow-Factory's server template (at the snapshot, a0b2bc5), redone with the standard library:
    GET /health, and POST /compute reading ``prompt``, ``image`` (base64) and ``extra``; nothing
    else exists. (The template itself never passes ``extra`` on; reading it here shows it arrives.)"""

    paths: list[str] = []  # every request's method and path, in order
    extras: list[dict] = []

    def do_GET(self):
        self._reply(200, {"status": "ok"}) if self.path == "/health" else self._reply(404, {"detail": "Not Found"})

    def do_POST(self):
        type(self).paths.append(f"POST {self.path}")
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path != "/compute":
            return self._reply(404, {"detail": "Not Found"})
        data = json.loads(body)
        images = [Image.open(io.BytesIO(base64.b64decode(b))).convert("RGB") for b in data.get("image") or []]
        extra = data.get("extra") or {}
        type(self).extras.append(extra)
        rewards = [float(np.asarray(im, dtype=np.float64).mean() / 255) * extra.get("scale", 1.0) for im in images]
        assert len(rewards) == len(data["prompt"])
        self._reply(200, {"rewards": rewards})

    def _reply(self, status: int, payload: dict):
        raw = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args):  # quiet
        pass


@contextmanager
def upstream_only_server():
    UpstreamOnlyHandler.paths, UpstreamOnlyHandler.extras = [], []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), UpstreamOnlyHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_compute_only_server_serves_the_guides_yaml_entry_with_no_protocol_key():
    with upstream_only_server() as url:
        # the guide's entry, as written there
        rs = RewardSet.from_configs([{
            "name": "remote_reward_1", "reward_model": "flow_factory.rewards.my_reward_remote.RemotePointwiseRewardModel",
            "server_url": url, "batch_size": 2, "async_reward": True, "num_workers": 4, "timeout": 60.0,
            "retry_attempts": 3}])
        images = torch.rand(5, 3, 8, 8)
        scores = rs(["a", "b", "c", "d", "e"], images=images)["remote_reward_1"]
        np.testing.assert_allclose(scores.numpy(), brightness(images), rtol=1e-6)
        # one probe of /score (404), then every chunk of 2 to /compute
        assert UpstreamOnlyHandler.paths == ["POST /score"] + ["POST /compute"] * 3

        explicit = remote.RemotePointwiseRewardModel(server_url=url, protocol="compute", request_kwargs={"scale": 2.0})
        got = explicit.score(RewardInputs(["a", "b"], images[:2])).numpy()
        np.testing.assert_allclose(got, 2 * brightness(images[:2]), rtol=1e-6)
        assert UpstreamOnlyHandler.paths[-1] == "POST /compute" and UpstreamOnlyHandler.extras[-1] == {"scale": 2.0}


def test_a_compute_only_server_serves_training(tmp_path, tiny_sd3_path):
    with upstream_only_server() as url:
        trainer = small_trainer(tmp_path, tiny_sd3_path, [
            {"name": "upstream", "reward_model": "flow_factory.rewards.my_reward_remote.RemotePointwiseRewardModel",
             "server_url": url, "batch_size": 2},
            {"name": "upstream_group", "reward_model": "flow_factory.rewards.remote.RemoteGroupwiseRewardModel",
             "server_url": url}])
        train_and_check(trainer, brightness)
        assert UpstreamOnlyHandler.paths.count("POST /score") == 2  # one probe per client, then only /compute


def test_an_unknown_protocol_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"protocol must be one of \['auto', 'score', 'compute'\]"):
        remote.RemotePointwiseRewardModel(server_url="http://127.0.0.1:1", protocol="pickle")


# ----------------------------------- ff-reward-server's app answers Flow-Factory's client


class MeanPixelPlusKwargs(RewardServer):
    """Reward = mean pixel value (plus ``offset`` from the request's kwargs); records its calls."""

    def __init__(self):
        self.calls = []

    def compute_reward(self, prompts, images, videos, **kwargs):
        self.calls.append({"n": len(prompts), **{k: v for k, v in kwargs.items() if not k.startswith("condition")},
                           "conditions": sorted(k for k in kwargs if k.startswith("condition"))})
        return [float(np.asarray(im, dtype=np.float64).mean() / 255) + kwargs.get("offset", 0.0) for im in images]


@contextmanager
def app_client(server, **limits):
    with TestClient(create_app(server, token=TOKEN, **limits)) as client:
        yield client


def flow_factory_client_body(values, **fields) -> dict:
    """What Flow-Factory's client (rewards/my_reward_remote.py) posts: its field names, nulls included."""
    body = {"prompt": [f"p{v}" for v in values], "image": [b64_png(v) for v in values], "video": None,
            "condition_images": None, "condition_videos": None, "kwargs": None}
    return body | fields


def test_ff_reward_server_answers_flow_factorys_client_under_its_token_and_limits():
    server = MeanPixelPlusKwargs()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with app_client(server, max_request_pixels=300, max_pixels_in_flight=300) as client:
        body = flow_factory_client_body([51, 102, 153])
        assert client.post("/compute", json=body).status_code == 401  # Flow-Factory's client sends no token
        answer = client.post("/compute", json=body, headers=auth)
        assert answer.status_code == 200 and answer.json() == {"rewards": pytest.approx([0.2, 0.4, 0.6])}

        # the early template's spelling (696af07), with extra kwargs and condition images
        template = {"prompts": ["a"], "images": [b64_png(51)], "extra": {"offset": 1.0},
                    "condition_images": [[b64_png(0, 4)]]}
        answer = client.post("/compute", json=template, headers=auth)
        assert answer.json()["rewards"] == pytest.approx([1.2])
        assert server.calls[-1] == {"n": 1, "offset": 1.0, "conditions": ["condition_images"]}

        # over the pixel budget: 5 images of 64 pixels = 320 > 300, refused before decoding
        over = client.post("/compute", json=flow_factory_client_body([1, 2, 3, 4, 5]), headers=auth)
        assert over.status_code == 413 and "over the limit of 300 pixels per request" in over.json()["detail"]
        # condition videos count too: 2 frames of 64 + 4 x 64 images = 384
        videos = flow_factory_client_body([1, 2], condition_videos=[[[b64_png(0), b64_png(0)]], [[b64_png(0)]]])
        assert client.post("/compute", json=videos, headers=auth).status_code == 413

        for bad, reason in [({"prompt": ["a"], "prompts": ["a"]}, "both 'prompt' and 'prompts'"),
                            ({"prompt": ["a", "b"], "image": [b64_png(1)]}, "1 images for 2 prompts"),
                            ({"prompt": ["a"], "image": ["bm90IGFuIGltYWdl"]}, "images[0]: not a readable image"),
                            ({"prompt": ["a"], "pickle": "gASV"}, "pickle")]:
            refused = client.post("/compute", json=bad, headers=auth)
            assert refused.status_code == 422 and reason in refused.json()["detail"], refused.json()
        assert len(server.calls) == 2  # nothing refused reached compute_reward


class HeldFirstCall(MeanPixelPlusKwargs):
    """Holds its first call until ``release`` is set, so the requests sent meanwhile queue up
    behind it and the batcher sees them together; fails any call holding the prompt 'bad'."""

    def __init__(self):
        super().__init__()
        self.started, self.release = threading.Event(), threading.Event()

    def compute_reward(self, prompts, images, videos, **kwargs):
        if not self.started.is_set():
            self.started.set()
            self.release.wait(timeout=30)
        if "bad" in prompts:
            self.calls.append({"n": len(prompts), "failed": True})
            raise ValueError("cannot score 'bad'")
        return super().compute_reward(prompts, images, videos, **kwargs)


@pytest.mark.parametrize("route", ["/compute", "/score"])
def test_flow_factory_requests_are_never_merged_and_a_failing_one_fails_alone(route):
    def body(prompt, value):
        if route == "/compute":
            return {"prompt": [prompt], "image": [b64_png(value)]}  # Flow-Factory's client's spelling
        return {"prompts": [prompt], "images": [b64_png(value)]}

    server = HeldFirstCall()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with app_client(server) as client:
        results = {}

        def post(name, prompt, value):
            results[name] = client.post(route, json=body(prompt, value), headers=auth)

        first = threading.Thread(target=post, args=("first", "p", 51))
        first.start()
        assert server.started.wait(timeout=30)  # the first request is being computed (held)
        others = [threading.Thread(target=post, args=(f"good{i}", "p", 102)) for i in range(2)]
        others.append(threading.Thread(target=post, args=("bad", "bad", 1)))
        for t in others:
            t.start()
        deadline = time.monotonic() + 30
        while client.get("/health").json()["waiting"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        server.release.set()
        for t in [first, *others]:
            t.join()
    assert results["first"].json()["rewards"] == pytest.approx([0.2])
    assert [results[f"good{i}"].json()["rewards"] for i in range(2)] == [pytest.approx([0.4])] * 2
    assert results["bad"].status_code == 500 and "cannot score 'bad'" in results["bad"].json()["detail"]
    sizes = [call["n"] for call in server.calls]
    if route == "/compute":
        assert sizes == [1, 1, 1, 1]  # each alone, as Flow-Factory's servers compute them
    else:
        assert sizes == [1, 3, 1, 1, 1]  # /score merged the three queued, then retried each alone


def test_ff_reward_server_serves_a_reward_written_to_the_guide():
    # the same builder as a run: Flow-Factory's (config, accelerator) form, the entry's own key as an option
    served = RewardModelServer("test_guide_rewards.GuideBrightness", scale=3.0, batch_size=2)
    images = [Image.new("RGB", (4, 4), (v, v, v)) for v in (51, 102, 153)]
    assert served.compute_reward(["a", "b", "c"], images, None) == pytest.approx([0.6, 1.2, 1.8])
