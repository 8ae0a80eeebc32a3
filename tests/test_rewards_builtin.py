"""Built-in rewards on a tiny CLIPModel built from config and loaded through from_pretrained:
PickScore and CLIP against the model's own forward, PickScore_Rank ranks, aesthetic heads
against hand computation, ocr scoring by hand, and deduplication of identical entries."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from flow_factory.rewards import RewardSet
from flow_factory.rewards.ocr import levenshtein, ocr_reward, paddle_text
from flow_factory.testing.tiny_clip import build_tiny_clip

PROMPTS = ["a red cube", "two cats on a sofa", "a city at night", "an empty beach"]


@pytest.fixture(scope="module")
def clip_path(tmp_path_factory):
    return str(build_tiny_clip(tmp_path_factory.mktemp("clip") / "tiny-clip"))


@pytest.fixture(scope="module")
def images():
    torch.manual_seed(3)
    return torch.rand(4, 3, 40, 48)


def reference_logits(clip_path, prompts, images):
    """The model's own forward: logits_per_image = exp(logit_scale) * cosine, from its processor."""
    from transformers import AutoProcessor, CLIPModel

    from flow_factory.rewards import images_to_pil

    model, processor = CLIPModel.from_pretrained(clip_path).eval(), AutoProcessor.from_pretrained(clip_path)
    inputs = processor(text=prompts, images=images_to_pil(images), padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(**inputs)
    return out.logits_per_image.diagonal(), model.logit_scale.exp().item()


def test_pickscore_is_flow_grpo_scaled_logit(clip_path, images):
    rs = RewardSet.from_configs([{"reward_model": "PickScore", "model_name_or_path": clip_path, "batch_size": 3}])
    got = rs(PROMPTS, images=images)["PickScore"]
    logits, _ = reference_logits(clip_path, PROMPTS, images)
    torch.testing.assert_close(got, logits / 26, rtol=1e-5, atol=1e-6)


def test_clip_is_cosine_similarity(clip_path, images):
    rs = RewardSet.from_configs([{"reward_model": "CLIP", "model_name_or_path": clip_path}])
    got = rs(PROMPTS, images=images)["CLIP"]
    logits, scale = reference_logits(clip_path, PROMPTS, images)
    torch.testing.assert_close(got, logits / scale, rtol=1e-5, atol=1e-6)
    assert got.abs().max() <= 1


def test_video_scores_are_the_mean_over_frames(clip_path):
    videos = torch.rand(2, 3, 3, 32, 32)
    rs = RewardSet.from_configs([{"reward_model": "CLIP", "model_name_or_path": clip_path}])
    got = rs(PROMPTS[:2], videos=videos)["CLIP"]
    per_frame = [rs([PROMPTS[i]] * 3, images=videos[i])["CLIP"].mean() for i in range(2)]
    torch.testing.assert_close(got, torch.stack(per_frame), rtol=1e-5, atol=1e-6)


def test_pickscore_rank_is_rank_in_group_over_group_size(clip_path, images):
    rs = RewardSet.from_configs([
        {"name": "rank", "reward_model": "PickScore_Rank", "model_name_or_path": clip_path, "batch_size": 1},
        {"name": "pick", "reward_model": "PickScore", "model_name_or_path": clip_path},
    ])
    prompts = ["a red cube"] * 3 + ["an empty beach"] * 3
    six = torch.cat([images, images[:2].flip(-1)])
    group_ids = torch.tensor([0, 1, 0, 1, 0, 1])
    got = rs([prompts[i] for i in [0, 3, 1, 4, 2, 5]], images=six, group_ids=group_ids)
    pick = got["pick"]
    for g in (0, 1):
        members = (group_ids == g).nonzero().flatten()
        order = pick[members].argsort()  # worst first
        assert got["rank"][members[order]].tolist() == pytest.approx([0, 1 / 3, 2 / 3])


def test_aesthetic_linear_and_mlp_heads(clip_path, images, tmp_path):
    from transformers import AutoProcessor, CLIPModel

    from flow_factory.rewards import images_to_pil

    model, processor = CLIPModel.from_pretrained(clip_path), AutoProcessor.from_pretrained(clip_path)
    with torch.no_grad():
        emb = model(**processor(text=["x"], images=images_to_pil(images), return_tensors="pt")).image_embeds
    emb = emb / emb.norm(dim=-1, keepdim=True)  # (4, 16)
    g = torch.Generator().manual_seed(0)
    linear = {"weight": torch.randn(1, 16, generator=g), "bias": torch.randn(1, generator=g)}
    # LAION's MLP layout: Linear, Dropout, Linear, Dropout, Linear (indices 0, 2, 4 ... 10 sorts after 4)
    mlp = {"layers.0.weight": torch.randn(8, 16, generator=g), "layers.0.bias": torch.randn(8, generator=g),
           "layers.4.weight": torch.randn(4, 8, generator=g), "layers.4.bias": torch.randn(4, generator=g),
           "layers.10.weight": torch.randn(1, 4, generator=g), "layers.10.bias": torch.randn(1, generator=g)}
    save_file(linear, tmp_path / "linear.safetensors")
    torch.save(mlp, tmp_path / "mlp.pth")
    rs = RewardSet.from_configs([
        {"name": "lin", "reward_model": "aesthetic", "model_name_or_path": clip_path,
         "head_path": str(tmp_path / "linear.safetensors")},
        {"name": "mlp", "reward_model": "aesthetic", "model_name_or_path": clip_path,
         "head_path": str(tmp_path / "mlp.pth")},
    ])
    got = rs(PROMPTS, images=images)
    torch.testing.assert_close(got["lin"], emb @ linear["weight"][0] + linear["bias"][0], rtol=1e-5, atol=1e-5)
    h = emb @ mlp["layers.0.weight"].T + mlp["layers.0.bias"]
    h = h @ mlp["layers.4.weight"].T + mlp["layers.4.bias"]
    h = h @ mlp["layers.10.weight"].T + mlp["layers.10.bias"]
    torch.testing.assert_close(got["mlp"], h[:, 0], rtol=1e-5, atol=1e-5)


def test_aesthetic_head_errors(clip_path, tmp_path):
    with pytest.raises(ValueError, match="set head_path"):
        RewardSet.from_configs([{"reward_model": "aesthetic", "model_name_or_path": clip_path}])
    save_file({"weight": torch.zeros(1, 7)}, tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="takes 7-d inputs but the CLIP model .* embeds into 16"):
        RewardSet.from_configs([{"reward_model": "aesthetic", "model_name_or_path": clip_path,
                                 "head_path": str(tmp_path / "bad.safetensors")}])


def test_identical_entries_load_one_model_and_different_ones_two(clip_path, monkeypatch):
    from transformers import CLIPModel

    loads = []
    original = CLIPModel.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        loads.append(args[0])
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(CLIPModel, "from_pretrained", classmethod(counting))
    same = [{"name": "a", "reward_model": "PickScore", "model_name_or_path": clip_path, "weight": 1.0},
            {"name": "b", "reward_model": "pickscore", "model_name_or_path": clip_path, "weight": 0.5}]
    rs = RewardSet.from_configs(same)
    assert len(loads) == 1 and rs.models["a"] is rs.models["b"]
    loads.clear()
    RewardSet.from_configs([same[0], {**same[1], "dtype": "float16"}])
    assert len(loads) == 2


def test_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(OSError, match=r"PickScore: could not load the CLIP model .*nowhere"):
        RewardSet.from_configs([{"reward_model": "PickScore", "model_name_or_path": str(tmp_path / "nowhere")}])


# --- ocr -------------------------------------------------------------------------------------


def test_levenshtein_by_hand():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3 and levenshtein("abc", "abc") == 0
    assert levenshtein("flaw", "lawn") == 2


def test_ocr_reward_by_hand():
    prompt = 'a shop sign that says "Open Late"'
    assert ocr_reward(prompt, "OPEN LATE") == 1.0                 # case and spaces ignored
    assert ocr_reward(prompt, "xx openlate yy") == 1.0            # contained
    assert ocr_reward(prompt, "OpenLste") == pytest.approx(1 - 1 / 8)   # one substitution in 8 letters
    assert ocr_reward(prompt, "Open") == pytest.approx(1 - 4 / 8)       # four deletions
    assert ocr_reward(prompt, "") == 0.0
    assert ocr_reward(prompt, "completely different text here") == 0.0  # distance capped at the length
    assert ocr_reward("no quotes here", "anything") == 0.0


def test_paddle_result_to_text_drops_zero_confidence_lines():
    box = [[0, 0], [1, 0], [1, 1], [0, 1]]
    result = [[[box, ("OPEN", 0.98)], [box, ("noise", 0.0)], [box, ("LATE", 0.7)]]]
    assert paddle_text(result) == "OPENLATE"
    assert paddle_text([None]) == ""


def test_ocr_without_paddleocr_names_the_install_command():
    try:
        import paddleocr  # noqa: F401
        pytest.skip("paddleocr is installed here")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="pip install paddleocr paddlepaddle"):
        RewardSet.from_configs([{"reward_model": "ocr"}])


def test_scores_are_per_sample_whatever_the_chunking(clip_path, images):
    small = RewardSet.from_configs([{"reward_model": "PickScore", "model_name_or_path": clip_path, "batch_size": 1}])
    big = RewardSet.from_configs([{"reward_model": "PickScore", "model_name_or_path": clip_path, "batch_size": 16}])
    np.testing.assert_allclose(small(PROMPTS, images=images)["PickScore"], big(PROMPTS, images=images)["PickScore"],
                               rtol=1e-5, atol=1e-6)
