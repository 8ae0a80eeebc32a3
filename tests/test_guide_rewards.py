"""Rewards written to Flow-Factory's reward guide, as its users write them: ``from
flow_factory.hparams import RewardArguments``, ``__init__(self, config, accelerator)`` calling
``super().__init__(config, accelerator)``, and ``self.config.batch_size``, ``self.device``,
``self.dtype``, ``self.accelerator`` and the entry's own keys read from the config. A pointwise
and a groupwise one train two epochs on the tiny SD3, built from YAML entries as a run builds
them, and their rewards are the numbers their formulas give on the sampled images."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from helpers_runs import tiny_run_config
from PIL import Image

from flow_factory.config import parse_config
from flow_factory.hparams import RewardArguments
from flow_factory.rewards import GroupwiseRewardModel, PointwiseRewardModel, RewardModelOutput, RewardSet
from flow_factory.rewards.base import takes_config, to_uint8_hwc
from flow_factory.rewards.jpeg_compressibility import JpegCompressibility
from flow_factory.trainer import Trainer

RETURNED: list[float] = []  # every score GuideBrightness returned, in call order
BUILT: list[dict] = []  # what each guide reward saw at construction


def brightness(image: Image.Image) -> float:
    return float(np.asarray(image, dtype=np.float64).mean() / 255)


class GuideBrightness(PointwiseRewardModel):
    """The guide's pointwise form; reward = scale x mean pixel value, ``scale`` a key of its entry."""

    required_fields = ("prompt", "image")

    def __init__(self, config: RewardArguments, accelerator: Accelerator):
        super().__init__(config, accelerator)
        self.scale = self.config.scale
        BUILT.append({"name": config.name, "batch_size": self.config.batch_size, "device": self.device,
                      "dtype": self.dtype, "accelerator": self.accelerator, "path": config.model_name_or_path})

    @torch.no_grad()
    def __call__(self, prompt, image=None, video=None, condition_images=None, condition_videos=None):
        assert len(prompt) <= self.config.batch_size  # the guide: input length is at most batch_size
        rewards = torch.tensor([self.scale * brightness(im) for im in image], device=self.device)
        RETURNED.extend(rewards.tolist())
        return RewardModelOutput(rewards=rewards)


class GuideRank(GroupwiseRewardModel):
    """The guide's groupwise form: scores in chunks of ``self.config.batch_size``, reward = rank / group size."""

    required_fields = ("prompt", "image")

    def __init__(self, config: RewardArguments, accelerator: Accelerator):
        super().__init__(config, accelerator)
        BUILT.append({"name": config.name, "batch_size": self.config.batch_size, "device": self.device})
        self.chunks: list[int] = []

    def _score_batch(self, prompts, images):
        self.chunks.append(len(prompts))
        return torch.tensor([brightness(im) for im in images])

    @torch.no_grad()
    def __call__(self, prompt, image=None, video=None, condition_images=None, condition_videos=None):
        group_size = len(prompt)
        step = self.config.batch_size
        raw = torch.cat([self._score_batch(prompt[i:i + step], image[i:i + step]) for i in range(0, group_size, step)])
        return RewardModelOutput(rewards=raw.argsort().argsort().float() / group_size)


class NoInit(PointwiseRewardModel):
    """The guide's tensor-input example has no __init__: built as Flow-Factory builds it."""

    required_fields = ("prompt", "image")
    use_tensor_inputs = True

    def __call__(self, prompt, image=None):
        return RewardModelOutput(rewards=image.mean(dim=(1, 2, 3)).to(self.device))


def image_brightness(media: torch.Tensor) -> torch.Tensor:
    """Mean pixel value of each (3, H, W) image in [0, 1] after the uint8 rounding rewards see."""
    return torch.from_numpy(to_uint8_hwc(media).astype(np.float64).mean(axis=(1, 2, 3)) / 255)


def guide_trainer(tmp_path, model_path) -> Trainer:
    config = tiny_run_config(tmp_path, "sd3-5", model_path, max_epochs=2, group_size=3, per_device_batch_size=3,
                             unique_sample_num_per_epoch=2)
    config["eval"]["eval_freq"] = 0
    config["log"].update(logging_backend="none", save_freq=0)
    # as a user copies them from the guide: device "cuda" is this process's device (the CPU here)
    config["rewards"] = [
        {"name": "bright", "reward_model": f"{__name__}.GuideBrightness", "dtype": "bfloat16", "device": "cuda",
         "batch_size": 2, "scale": 2.0, "model_name_or_path": "weights/bright"},
        {"name": "rank", "reward_model": f"{__name__}.GuideRank", "batch_size": 2, "weight": 0.5},
    ]
    return Trainer(parse_config(config))


def test_guide_rewards_train_two_epochs_with_their_formulas_rewards(tmp_path, tiny_sd3_path):
    BUILT.clear()
    trainer = guide_trainer(tmp_path, tiny_sd3_path)
    bright, rank = trainer.rewards.models["bright"], trainer.rewards.models["rank"]
    assert (type(bright), type(rank)) == (GuideBrightness, GuideRank)
    assert BUILT[0] == {"name": "bright", "batch_size": 2, "device": trainer.accelerator.device,
                        "dtype": torch.bfloat16, "accelerator": BUILT[0]["accelerator"], "path": "weights/bright"}
    assert isinstance(BUILT[0]["accelerator"], Accelerator)
    assert BUILT[0]["accelerator"].device == trainer.accelerator.device
    assert BUILT[1] == {"name": "rank", "batch_size": 2, "device": trainer.accelerator.device}

    RETURNED.clear()
    rollouts = trainer.sample_epoch(0)
    expected = 2.0 * image_brightness(rollouts.media)
    np.testing.assert_allclose(rollouts.rewards["bright"].numpy(), expected.numpy(), rtol=1e-6)
    assert RETURNED == pytest.approx(expected.tolist(), rel=1e-6)  # 6 samples in chunks of at most 2
    # the groupwise reward saw each whole group of 3 and chunked it by its own batch_size
    assert rank.chunks == [2, 1, 2, 1]
    for g in rollouts.group_ids.unique():
        members = rollouts.group_ids == g
        ranks = expected[members].argsort().argsort().float() / 3
        assert rollouts.rewards["rank"][members].tolist() == pytest.approx(ranks.tolist())

    RETURNED.clear()
    history = trainer.train()
    assert [record["epoch"] for record in history] == [0, 1]
    # epoch 0 samples what sample_epoch(0) sampled (same seeds, weights not yet updated)
    assert history[0]["reward/bright/mean"] == pytest.approx(expected.mean().item(), rel=1e-5)
    assert history[1]["reward/bright/mean"] == pytest.approx(float(np.mean(RETURNED[6:])), rel=1e-5)
    assert history[0]["reward/rank/mean"] == pytest.approx(1 / 3)  # ranks 0, 1/3, 2/3 in every group
    assert all(np.isfinite(record["train/loss"]) for record in history)


def test_the_builder_tells_the_two_constructor_forms_apart():
    assert takes_config(GuideBrightness) and takes_config(GuideRank) and takes_config(NoInit)
    assert not takes_config(JpegCompressibility)
    keyword = RewardSet.from_configs([{"name": "j", "reward_model": "jpeg_compressibility", "batch_size": 3}])
    assert keyword.models["j"].config is None and keyword.models["j"].batch_size == 3

    rs = RewardSet.from_configs([{"name": "n", "reward_model": f"{__name__}.NoInit", "device": "cpu"}])
    images = torch.rand(3, 3, 8, 8)
    np.testing.assert_allclose(rs(["a", "b", "c"], images=images)["n"].numpy(), images.mean(dim=(1, 2, 3)).numpy(),
                               rtol=1e-6)
    assert rs.models["n"].config.device == "cpu" and rs.models["n"].accelerator is not None


def test_reward_arguments_hold_the_entry_and_name_a_missing_key():
    config = RewardArguments(reward_model=f"{__name__}.GuideBrightness", batch_size=4, dtype="bf16", scale=0.5)
    assert (config.batch_size, config.dtype, config.scale, config["scale"], config.name) == (
        4, "bfloat16", 0.5, 0.5, f"{__name__}.GuideBrightness")
    assert config.to_dict()["scale"] == 0.5 and config.to_dict()["batch_size"] == 4
    with pytest.raises(AttributeError, match=r"has no key 'threshold'.*its own options: \['scale'\]"):
        _ = config.threshold
    # a guide reward reading a key its entry lacks fails when built, naming the entry
    with pytest.raises(AttributeError, match="no key 'scale'"):
        RewardSet.from_configs([{"name": "b", "reward_model": f"{__name__}.GuideBrightness"}])
    # direct construction, outside a run, as the guide's own tests would do it
    reward = GuideBrightness(config, Accelerator(cpu=True))
    image = Image.new("RGB", (4, 4), (255, 0, 0))
    assert reward(["x"], [image]).rewards.tolist() == pytest.approx([0.5 / 3])


def test_flow_factory_hparams_imports_no_torch():
    code = "import sys, flow_factory.hparams; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
