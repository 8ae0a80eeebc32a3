"""What Flow-Factory's users write, as they write it: its ``clap`` reward (a tiny ClapModel built from config,
against the model's own forward), the class paths of its built-in rewards, its built-ins this version lacks
(refused with what they are), its ``register_reward_model`` decorator, its reward guide's ``reward`` /
``eval_reward`` layout and its ``flow-factory-train`` command."""

import numpy as np
import pytest
import torch

from flow_factory.rewards import (PointwiseRewardModel, RewardInputs, RewardSet, register_reward_model,
                                  resolve_reward_class)
from flow_factory.rewards.clap import CLAP_SAMPLE_RATE, ClapScore, mono_at
from flow_factory.rewards.registry import BUILTIN_REWARDS, FLOW_FACTORY_CLASS_PATHS, NOT_HERE
from flow_factory.testing import build_tiny_clap

PROMPTS = ["a dog barking", "rain on a tin roof", "a violin"]


@pytest.fixture(scope="module")
def clap_path(tmp_path_factory):
    return str(build_tiny_clap(tmp_path_factory.mktemp("clap") / "tiny-clap"))


def _waves(n: int, seconds: float, rate: int, seed: int = 0) -> torch.Tensor:
    """(n, 2, T) stereo noise in [-1, 1] whose two channels are equal (so its mono mix is either channel)."""
    mono = torch.rand(n, 1, int(seconds * rate), generator=torch.Generator().manual_seed(seed)) * 0.4 - 0.2
    return mono.expand(n, 2, -1).clone()


def _reference(clap_path, prompts, mono_48k: list[np.ndarray]) -> torch.Tensor:
    """Cosine of the model's own audio and text embeddings, from its own processor at 48 kHz."""
    from transformers import ClapModel, ClapProcessor

    model, processor = ClapModel.from_pretrained(clap_path).eval(), ClapProcessor.from_pretrained(clap_path)
    inputs = processor(text=prompts, audio=mono_48k, sampling_rate=CLAP_SAMPLE_RATE, return_tensors="pt",
                       padding=True)
    with torch.no_grad():
        out = model(**inputs)
    a, t = out.audio_embeds, out.text_embeds
    return (a * t).sum(-1) / (a.norm(dim=-1) * t.norm(dim=-1))


def test_clap_is_the_cosine_of_the_models_audio_and_text_embeddings(clap_path):
    audio = _waves(3, 1.0, CLAP_SAMPLE_RATE)
    rs = RewardSet.from_configs([{"reward_model": "clap", "model_name_or_path": clap_path, "batch_size": 2}])
    got = rs.score_inputs(RewardInputs(PROMPTS, audio=audio, audio_sample_rate=CLAP_SAMPLE_RATE))["clap"]
    want = _reference(clap_path, PROMPTS, [w[0].numpy() for w in audio])  # the stereo's channels are equal
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got.abs().max() <= 1


def test_clap_resamples_to_48_khz():
    """A 440 Hz tone written at LTX-2's 24 kHz comes out as the same tone sampled at 48 kHz."""
    rate, seconds = 24_000, 0.5
    tone = lambda r: np.sin(2 * np.pi * 440 * np.arange(int(seconds * r)) / r)  # noqa: E731
    stereo = np.stack([tone(rate), tone(rate)]).astype(np.float32)
    got = mono_at(stereo, rate)
    assert got.shape == (int(seconds * CLAP_SAMPLE_RATE),) and got.dtype == np.float32
    inner = slice(1000, -1000)  # away from the filter's edges
    np.testing.assert_allclose(got[inner], tone(CLAP_SAMPLE_RATE)[inner], atol=2e-3)


def test_clap_scores_a_soundtrack_at_another_rate_as_its_48_khz_resampling(clap_path):
    audio = _waves(2, 1.0, 16_000, seed=1)
    reward = ClapScore(clap_path)
    got = torch.as_tensor(reward(PROMPTS[:2], audio=list(audio.numpy()), audio_sample_rate=[16_000] * 2).rewards)
    want = _reference(clap_path, PROMPTS[:2], [mono_at(w.numpy(), 16_000) for w in audio])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_clap_without_audio_says_what_it_needs(clap_path):
    with pytest.raises(ValueError, match="needs the audio and its audio_sample_rate"):
        ClapScore(clap_path)(PROMPTS)


def test_flow_factorys_class_paths_of_its_builtins_resolve_to_ours():
    for path, name in FLOW_FACTORY_CLASS_PATHS.items():
        if name in NOT_HERE:
            continue
        assert name in BUILTIN_REWARDS, path
        assert resolve_reward_class(path) is resolve_reward_class(name), path
    assert resolve_reward_class("flow_factory.rewards.clap.CLAPRewardModel") is ClapScore


@pytest.mark.parametrize("name", ["hpsv2", "GenEval", "imagebind", "flow_factory.rewards.hpsv2_reward.HPSv2RewardModel"])
def test_flow_factorys_builtins_this_version_lacks_are_refused_with_what_they_are(name):
    key = FLOW_FACTORY_CLASS_PATHS.get(name, name.lower())
    with pytest.raises(ValueError, match=f"Flow-Factory's built-in reward {key} .*does not have; serve it with "
                                         "ff-reward-server"):
        resolve_reward_class(name)


@register_reward_model("MyLoudness")
class MyLoudness(PointwiseRewardModel):
    """A user's reward registered with Flow-Factory's decorator, as its reward guide writes it."""


def test_register_reward_model_is_flow_factorys_name_of_the_decorator():
    assert resolve_reward_class("myloudness") is MyLoudness


def test_the_reward_guides_first_layout_reward_and_eval_reward_are_our_lists():
    """Flow-Factory's early reward guide: ``reward:`` trains, ``eval_reward:`` evaluates, one mapping each."""
    from flow_factory.config import ConfigError, parse_config
    from test_config import minimal

    data = minimal(reward={"reward_model": "PickScore", "batch_size": 16},
                   eval_reward={"reward_model": "jpeg_compressibility", "batch_size": 8})
    del data["rewards"]
    cfg = parse_config(data)
    assert [r.reward_model for r in cfg.rewards] == ["PickScore"]
    assert [(r.reward_model, r.batch_size) for r in cfg.eval_rewards] == [("jpeg_compressibility", 8)]
    data["eval_rewards"] = [{"reward_model": "CLIP"}]
    with pytest.raises(ConfigError, match="eval_reward: .* and eval_rewards: .* are two spellings of one setting"):
        parse_config(data)


def test_flow_factorys_flow_factory_train_command_is_ff_train():
    """Flow-Factory installs ``flow-factory-train`` beside ``ff-train``, one entry point."""
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["flow-factory-train"] == scripts["ff-train"]


def test_clap_scores_an_ltx2_rollouts_soundtrack(clap_path, tiny_ltx2_path):
    """Through the sampler as a run scores it: the rollout's decoded audio, at the vocoder's rate, given to clap."""
    from flow_factory.data.prompts import PromptItem
    from flow_factory.dynamics import ODE
    from flow_factory.models import load_adapter
    from flow_factory.sampling import SamplingServices, SamplingSettings, collect_rollouts

    adapter = load_adapter("ltx2_t2av", tiny_ltx2_path)
    rewards = RewardSet.from_configs([{"reward_model": "clap", "model_name_or_path": clap_path}])
    settings = SamplingSettings(32, 32, 9, num_steps=2, guidance_scale=1.0, batch_size=2, seed=0)
    rollouts = collect_rollouts(adapter, ODE(), [PromptItem(p) for p in PROMPTS[:2]], torch.tensor([0, 1]), [0, 1],
                                settings, epoch=0, services=SamplingServices(rewards))
    waves, rate = adapter.decode_audio(rollouts.latents[:, -1])
    want = _reference(clap_path, PROMPTS[:2], [mono_at(w.numpy(), rate) for w in waves])
    torch.testing.assert_close(rollouts.rewards["clap"], want, rtol=1e-4, atol=1e-5)


def test_the_dataset_guides_audio_dir_loads_and_says_it_changes_nothing():
    """Flow-Factory's dataset guide sets ``audio_dir`` per dataset (and under ``data``); no model here reads a row's
    audio, so the config loads and the note names each one."""
    from flow_factory.config import ConfigError, parse_config
    from flow_factory.config.compat import without_effect
    from test_config import minimal

    upstream = {"name": "example", "dataset_dir": "dataset/example", "image_dir": "dataset/example",
                "video_dir": "/shared/videos", "audio_dir": "/shared/audio", "train": {"weight": 1}, "eval": {}}
    def with_data(data):
        config = minimal()
        config["data"] = data
        return config

    one = parse_config(with_data({"datasets": [upstream]}))
    assert one.data.audio_dir == "/shared/audio"
    two = parse_config(with_data({"datasets": [upstream, {**upstream, "name": "b", "audio_dir": None}]}))
    assert [d.audio_dir for d in two.data.datasets] == ["/shared/audio", None]
    for cfg, named in ((one, "data.audio_dir"), (two, "data.datasets[0].audio_dir")):
        notes = [n for n in without_effect(cfg) if "audio" in n]
        assert notes == [f"{named}: no model here reads a dataset row's audio / audios column (an sft or offline-dpo "
                         "record names its audio relative to dataset_dir), so it changes nothing"]
    assert not [n for n in without_effect(parse_config(minimal())) if "audio" in n]
    with pytest.raises(ConfigError, match="audio_dir: with datasets, set it per dataset"):
        parse_config(with_data({"audio_dir": "a", "datasets": [{"name": "a", "dataset_dir": "d"}]}))
