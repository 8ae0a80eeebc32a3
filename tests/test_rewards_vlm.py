"""VLM judges against an OpenAI-compatible server started here on loopback: rewards equal what
the served logprobs and rubric text give by hand; malformed replies error or fall back."""

import math
import re
import threading
import time

import numpy as np
import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request

from flow_factory.rewards import RewardSet
from flow_factory.rewards.vlm.base import UnscorableReply
from flow_factory.rewards.vlm.rubric import parse_aspect_scores

from reward_servers import free_port

# prompt -> what the fake VLM answers (a top_logprobs list, or the reply's text)
LOGPROBS = {
    "cat": [{"token": "Yes", "logprob": math.log(0.6)}, {"token": " yes", "logprob": math.log(0.1)},
            {"token": "No", "logprob": math.log(0.2)}, {"token": "Maybe", "logprob": math.log(0.1)}],
    "dog": [{"token": "NO", "logprob": -0.1}, {"token": "yes", "logprob": -3.0}],
    "fish": [{"token": "Perhaps", "logprob": -0.1}, {"token": "The", "logprob": -2.0}],
}
TEXTS = {
    "cat": 'alignment is good.\n{"alignment": 2, "quality": 1}\nFinal: {"alignment": 9, "quality": 7, "aesthetics": 4}',
    "dog": "Reasoning...\n**Alignment**: 10\n- quality: 5.5\naesthetics = 1",
    "fish": "I cannot judge this image.",
    "make it red": '{"instruction_following": 8, "consistency": 10, "quality": 6}',
}
REQUESTS: list[dict] = []


def fake_vlm() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        REQUESTS.append(body)
        text = body["messages"][0]["content"][-1]["text"]
        key = re.search(r'"([^"]+)"', text).group(1)
        if body.get("logprobs"):
            if key == "broken":
                return {"choices": [{"message": {"content": "Yes"}}]}  # no logprobs
            return {"choices": [{"message": {"content": LOGPROBS[key][0]["token"]},
                                 "logprobs": {"content": [{"token": LOGPROBS[key][0]["token"],
                                                           "top_logprobs": LOGPROBS[key]}]}}]}
        return {"choices": [{"message": {"role": "assistant", "content": TEXTS[key]}}]}

    return app


@pytest.fixture(scope="module")
def api():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake_vlm(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(autouse=True)
def clear():
    REQUESTS.clear()


def judge(api, reward_model, **options):
    entry = {"name": "j", "reward_model": reward_model, "api_base_url": api, "vlm_model": "tiny-vl",
             "extra_kwargs": {"top_k": 5}, **options}
    return RewardSet.from_configs([entry])


def test_yes_no_reward_from_logprobs_by_hand(api):
    got = judge(api, "vllm_evaluate")(["cat", "dog"], images=torch.rand(2, 3, 8, 8))["j"]
    cat = (0.6 + 0.1) / (0.6 + 0.1 + 0.2)
    dog = math.exp(-3.0) / (math.exp(-3.0) + math.exp(-0.1))
    torch.testing.assert_close(got, torch.tensor([cat, dog]))
    body = REQUESTS[0]
    assert body["model"] == "tiny-vl" and body["top_k"] == 5 and body["max_tokens"] == 1 and body["logprobs"]
    assert body["messages"][0]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")


def test_yes_no_without_yes_or_no_errors_or_falls_back(api):
    with pytest.raises(UnscorableReply, match=r"sample 1: neither Yes nor No among the top tokens "
                                              r"\['Perhaps', 'The'\].*fallback_score"):
        judge(api, "vllm_evaluate")(["cat", "fish"], images=torch.rand(2, 3, 8, 8))
    got = judge(api, "vllm_evaluate", fallback_score=0.5)(["fish", "broken"], images=torch.rand(2, 3, 8, 8))["j"]
    assert got.tolist() == [0.5, 0.5]


def test_rubric_t2i_by_hand(api):
    got = judge(api, "rational_rewards_t2i", aspects={"alignment": 2, "quality": 1, "aesthetics": 1})(
        ["cat", "dog"], images=torch.rand(2, 3, 8, 8))["j"]
    # cat: the last JSON holding every aspect (9, 7, 4); dog: the "aspect: score" lines (10, 5.5, 1)
    norm = lambda s: (s - 1) / 9  # noqa: E731
    cat = (2 * norm(9) + norm(7) + norm(4)) / 4
    dog = (2 * norm(10) + norm(5.5) + norm(1)) / 4
    torch.testing.assert_close(got, torch.tensor([cat, dog]))


def test_rubric_unparseable_reply(api):
    with pytest.raises(UnscorableReply, match="no score for aspect 'alignment'"):
        judge(api, "rational_rewards_t2i")(["fish"], images=torch.rand(1, 3, 8, 8))
    got = judge(api, "rational_rewards_t2i", fallback_score=0.0)(["fish", "cat"], images=torch.rand(2, 3, 8, 8))["j"]
    assert got[0] == 0.0 and got[1] == pytest.approx((8 / 9 + 6 / 9 + 3 / 9) / 3)


def test_rubric_edit_sends_source_then_edited(api):
    source, edited = torch.zeros(1, 3, 8, 8), torch.ones(1, 3, 8, 8)
    got = judge(api, "rational_rewards_edit")(["make it red"], images=edited, condition_images=[source])["j"]
    assert got.item() == pytest.approx((7 / 9 + 9 / 9 + 5 / 9) / 3)
    content = REQUESTS[0]["messages"][0]["content"]
    assert [c["type"] for c in content] == ["image_url", "image_url", "text"]


def test_parse_rejects_scores_out_of_range_and_non_numbers(api):
    with pytest.raises(UnscorableReply, match="outside"):
        judge(api, "rational_rewards_t2i", score_range=[1, 5])(["cat"], images=torch.rand(1, 3, 8, 8))
    with pytest.raises(UnscorableReply, match="non-numeric"):
        parse_aspect_scores('{"a": "great"}', ["a"])


def test_missing_settings_are_named():
    with pytest.raises(ValueError, match="set api_base_url"):
        RewardSet.from_configs([{"reward_model": "vllm_evaluate", "vlm_model": "m"}])
    with pytest.raises(ValueError, match="set vlm_model"):
        RewardSet.from_configs([{"reward_model": "vllm_evaluate", "api_base_url": "http://127.0.0.1:1/v1"}])


def test_rational_rewards_edit_judges_a_kontext_run_from_source_and_edit(api, tmp_path, tiny_flux_kontext_path):
    """End to end on an editing model: ff-train samples FLUX.1 Kontext edits of the dataset's source images;
    every judge request holds the source as the model saw it (resized to condition_image_size), then the edit,
    and the epoch's reward is the one the rubric reply gives by hand."""
    import base64
    import io
    import json

    from helpers_runs import tiny_run_config, write_config
    from PIL import Image

    from flow_factory.train import main as ff_train

    config = tiny_run_config(tmp_path, "flux1-kontext", tiny_flux_kontext_path, max_epochs=1,
                             condition_image_size=[48, 80])
    config["eval"]["eval_freq"] = 0
    config["rewards"] = [{"name": "edit", "reward_model": "rational_rewards_edit", "api_base_url": api,
                          "vlm_model": "tiny-vl"}]
    train = tmp_path / "data" / "train.jsonl"
    rows = [{**json.loads(line), "prompt": "make it red"} for line in train.read_text().splitlines()]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ff_train([str(write_config(tmp_path, config))]) == 0

    images = tmp_path / "data" / "images"
    sources = [np.asarray(Image.open(f).convert("RGB").resize((80, 48), Image.LANCZOS)) for f in images.iterdir()]
    history = json.loads((tmp_path / "saves" / "run" / "history.json").read_text())["train"]
    assert history[0]["reward/edit/mean"] == pytest.approx((7 / 9 + 9 / 9 + 5 / 9) / 3)
    assert len(REQUESTS) == 4  # 2 prompts x group 2
    for body in REQUESTS:
        source, edit = (Image.open(io.BytesIO(base64.b64decode(part["image_url"]["url"].split(",", 1)[1])))
                        for part in body["messages"][0]["content"][:2])
        assert edit.size == (64, 64)
        assert any(np.array_equal(np.asarray(source.convert("RGB")), s) for s in sources)  # a row's own source
