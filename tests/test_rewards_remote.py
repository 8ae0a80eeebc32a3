"""Remote rewards against a real ff-reward-server (uvicorn, loopback): concurrency and order,
restart survival, timeouts, payload validation, auth, a served built-in, torch-free serving;
and against Flow-Factory's reward server template, started as its users start it."""

import base64
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from flow_factory.rewards import RewardInputs, RewardSet
from flow_factory.rewards.http_client import RemoteRewardError
from flow_factory.rewards.remote import RemoteGroupwiseRewardModel, RemotePointwiseRewardModel
from flow_factory.wire import encode_image

from reward_servers import child_env, free_port, start_process, start_server, stop_server

ECHO = "reward_servers.MeanPixelServer"  # bench/reward_servers.py
TOKEN = "s3cret"


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = start_server(ECHO, port, "--token", TOKEN, "--max-request-mb", "0.5")
    yield f"http://127.0.0.1:{port}"
    stop_server(proc)


def score(model, prompts, images) -> list[float]:
    return model.score(RewardInputs(list(prompts), images)).tolist()


def png(image: np.ndarray) -> str:
    return encode_image(Image.fromarray(image))


def good_payload(k: int = 0) -> dict:
    return {"prompts": [f"{k} a cat"], "images": [png(np.full((8, 8, 3), 51, np.uint8))]}


def post(url, payload, token=TOKEN, **kw):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(url + "/score", headers=headers, timeout=10, **kw, **({"json": payload} if payload is not None else {}))


def test_eight_clients_fifty_requests_each_all_answered_in_order(server):
    images = torch.rand(2, 3, 8, 8)
    expected_pixel = [float(np.rint(im.numpy() * 255).mean() / 255) for im in images]
    results: dict[int, list] = {}

    def client(i: int):
        model = RemotePointwiseRewardModel(server_url=server, api_key=TOKEN, timeout=20, batch_size=2)
        got = []
        for j in range(50):
            k = 1000 * i + 2 * j
            got.append(score(model, [f"{k} x", f"{k + 1} y"], images))
        results[i] = got

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(8))
    for i, got in results.items():
        assert len(got) == 50
        for j, scores in enumerate(got):
            k = 1000 * i + 2 * j
            np.testing.assert_allclose(scores, [k + expected_pixel[0], k + 1 + expected_pixel[1]], atol=1e-4)
    health = httpx.get(server + "/health").json()
    assert health["requests"] >= 400 and health["batches"] <= health["requests"]


def test_bad_payloads_get_4xx_with_the_reason_and_the_server_keeps_serving(server):
    cases = [
        ({"prompts": "a cat", "images": None}, 422, "prompts"),                       # wrong type
        ({"prompts": ["a", "b"], "images": [png(np.zeros((4, 4, 3), np.uint8))]}, 422, "1 images for 2 prompts"),
        ({"prompts": ["a"], "images": ["not base64!!"]}, 422, "images[0]: not valid base64"),
        ({"prompts": ["a"], "images": [base64.b64encode(b"\x89PNG\r\n\x1a\n garbage").decode()]}, 422,
         "images[0]: not a readable image"),
        ({"prompts": ["a"], "images": [png(np.zeros((4, 4, 3), np.uint8))], "exec": "rm -rf /"}, 422, "exec"),
        ({"prompts": ["a"], "images": [png(np.random.randint(0, 255, (600, 600, 3), np.uint8))]}, 413, "limit"),
    ]
    for payload, status, reason in cases:
        r = post(server, payload)
        assert r.status_code == status, (payload.keys(), r.text)
        assert reason in r.text
        ok = post(server, good_payload(7))
        assert ok.status_code == 200 and ok.json()["rewards"] == pytest.approx([7.2])
    assert post(server, good_payload(), token=None).status_code == 401
    assert post(server, good_payload(), token="wrong").status_code == 401
    assert post(server, None, content=b"{not json").status_code == 422
    assert post(server, good_payload(3)).json()["rewards"] == pytest.approx([3.2])


def test_client_reports_4xx_without_retrying(server):
    model = RemotePointwiseRewardModel(server_url=server, api_key="wrong", retry_attempts=5, backoff=10)
    with pytest.raises(RemoteRewardError, match="answered HTTP 401: missing or wrong bearer token"):
        score(model, ["a"], torch.rand(1, 3, 8, 8))  # backoff 10 s: a retry would hang the test


def test_groupwise_client_sends_each_group_whole(server):
    model = RemoteGroupwiseRewardModel(server_url=server, api_key=TOKEN)
    rs = RewardSet({"g": model}, {"g": 1.0})
    images = torch.zeros(4, 3, 8, 8)
    scores = rs(["1 a", "2 b", "3 c", "4 d"], images=images, group_ids=torch.tensor([0, 1, 0, 1]))["g"]
    assert scores.tolist() == [1, 2, 3, 4]


def test_retries_carry_a_run_through_a_server_restart():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(ECHO, port)
    model = RemotePointwiseRewardModel(server_url=url, timeout=5, retry_attempts=8, backoff=0.1)
    images = torch.zeros(1, 3, 8, 8)
    assert score(model, ["1 a"], images) == pytest.approx([1.0])
    stop_server(proc)  # killed mid-run
    results, errors = [], []

    def run():
        try:
            for k in range(10):
                results.append(score(model, [f"{k} a"], images)[0])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()  # its first request finds no server and backs off
    proc = start_server(ECHO, port)
    thread.join(timeout=60)
    stop_server(proc)
    assert not errors and results == pytest.approx(list(range(10)))


def test_a_server_that_never_answers_times_out_with_a_clear_error():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections (the kernel does), never reads or answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    model = RemotePointwiseRewardModel(server_url=url, timeout=0.3, retry_attempts=1, backoff=0.0)
    try:
        with pytest.raises(RemoteRewardError, match=r"failed after 2 attempt\(s\) \(timeout 0.3 s each\): "
                                                     r"no answer within 0.3 s"):
            score(model, ["a"], torch.rand(1, 3, 8, 8))
    finally:
        listener.close()


def test_a_served_builtin_gives_the_local_scores():
    port = free_port()
    proc = start_server("jpeg_compressibility", port)
    try:
        images = torch.rand(3, 3, 16, 16)
        images[0] = 0.5
        remote = RemotePointwiseRewardModel(server_url=f"http://127.0.0.1:{port}")
        local = RewardSet.from_configs([{"reward_model": "jpeg_compressibility"}])
        np.testing.assert_allclose(score(remote, ["a", "b", "c"], images),
                                   local(["a", "b", "c"], images=images)["jpeg_compressibility"], rtol=1e-6)
    finally:
        stop_server(proc)


def test_serving_a_plain_reward_server_imports_no_torch():
    code = ("import sys; from flow_factory.reward_server.cli import build_server; "
            "from flow_factory.reward_server.app import create_app; "
            f"create_app(build_server('{ECHO}', {{}})); "
            "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=child_env()).stdout
    assert out.strip() == "[]"


def test_config_errors_of_the_client():
    with pytest.raises(ValueError, match="set server_url"):
        RemotePointwiseRewardModel()
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        RemotePointwiseRewardModel(server_url="localhost:8000")


# ------------------------------------------- Flow-Factory's reward server template

# Its reward_server/example_server.py as of the snapshot (a0b2bc5): the stand-in written here
# (tests/upstream/compute_template_server.py says why and what it repeats), or upstream's own
# file where FF_UPSTREAM_EXAMPLE_SERVER names it.
TEMPLATE = Path(os.environ.get("FF_UPSTREAM_EXAMPLE_SERVER")
                or Path(__file__).parent / "upstream" / "compute_template_server.py")

# A server a user writes from the template: its RewardServer, subclassed as its docstring shows.
# reward = the prompt's number + the image's mean pixel + 10 x the first condition image's
# (or the video's mean pixel): each field the template reads shows in the score.
TEMPLATE_SUBCLASS = textwrap.dedent("""
    import importlib.util, sys
    import numpy as np

    spec = importlib.util.spec_from_file_location("example_server", sys.argv[1])
    template = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(template)

    def mean(images):
        return float(np.mean([np.asarray(im, dtype=np.float64).mean() / 255 for im in images]))

    class Brightness(template.RewardServer):
        def compute_reward(self, prompt, image=None, video=None, condition_images=None, condition_videos=None):
            shown = image if image is not None else [mean(frames) for frames in video]
            return [float(p) + (s if isinstance(s, float) else mean([s]))
                    + (10 * mean(c[:1]) if condition_images else 0.0)
                    for p, s, c in zip(prompt, shown, condition_images or [None] * len(prompt))]

    Brightness(host="127.0.0.1", port=int(sys.argv[2])).run()
""")


@pytest.fixture
def start_template(tmp_path):
    """Starts ``python <args>`` as a server on a free port; yields (url, its log's path)."""
    started = []

    def start(*args: str) -> tuple[str, Path]:
        port = free_port()
        log_path = tmp_path / f"server-{port}.log"
        log = open(log_path, "w")
        started.append((start_process([sys.executable, *args, str(port)], port, log=log), log))
        return f"http://127.0.0.1:{port}", log_path

    yield start
    for proc, log in started:
        stop_server(proc)
        log.close()


def template_requests(log_path: Path) -> list[str]:
    """The requests a template server answered, from uvicorn's access log: e.g. 'POST /compute 200'."""
    return [f"{method} {path} {status}" for method, path, status in
            re.findall(r'"(GET|POST) (\S+) HTTP/[\d.]+" (\d{3})', log_path.read_text())]


def test_flow_factorys_template_as_shipped_serves_the_yaml_entry_of_its_docstring(start_template):
    url, log = start_template(str(TEMPLATE), "--host", "127.0.0.1", "--port")
    rewards = RewardSet.from_configs([{  # the entry of the template's docstring, as written there
        "name": "my_reward", "reward_model": "flow_factory.rewards.remote.RemotePointwiseRewardModel",
        "server_url": url, "batch_size": 16}])
    scores = rewards([f"prompt {k}" for k in range(20)], images=torch.rand(20, 3, 8, 8))["my_reward"]
    # the template's example server scores each prompt with random.random()
    assert scores.shape == (20,) and bool(((scores >= 0) & (scores < 1)).all())
    assert len(set(scores.tolist())) == 20
    # one probe of /score (the template has no such route), then chunks of 16 and 4 to /compute
    assert template_requests(log) == ["GET /health 200", "POST /score 404", "POST /compute 200", "POST /compute 200"]


def test_a_server_subclassing_flow_factorys_template_gets_every_field_our_client_sends(start_template):
    url, _ = start_template("-c", TEMPLATE_SUBCLASS, str(TEMPLATE))
    model = RemotePointwiseRewardModel(server_url=url, batch_size=16)
    images = torch.rand(3, 3, 8, 8)
    conditions = [[Image.fromarray(np.full((4, 4, 3), 255 * k // 4, np.uint8))] for k in range(3)]
    got = model.score(RewardInputs(["0", "1", "2"], images, condition_images=conditions)).tolist()
    pixel_means = [float(np.rint(im.permute(1, 2, 0).numpy() * 255).mean() / 255) for im in images]
    condition_means = [(255 * k // 4) / 255 for k in range(3)]
    np.testing.assert_allclose(got, [k + pixel_means[k] + 10 * condition_means[k] for k in range(3)], atol=1e-6)

    video = torch.rand(2, 3, 3, 8, 8)  # 2 samples of 3 frames
    got = model.score(RewardInputs(["5", "6"], video=video)).tolist()
    frame_means = [float(np.rint(v.numpy() * 255).mean() / 255) for v in video]
    np.testing.assert_allclose(got, [5 + frame_means[0], 6 + frame_means[1]], atol=1e-6)
