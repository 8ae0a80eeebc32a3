"""Rewards: the call contract (chunking, groups, fields, PIL vs tensor), the registry,
jpeg_compressibility against an independent computation, and RewardSet."""

import importlib.util
import io
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image

from flow_factory.config import ConfigError, RewardConfig
from flow_factory.rewards import (
    GroupwiseRewardModel,
    PointwiseRewardModel,
    RewardInputs,
    RewardModelOutput,
    RewardSet,
    register_reward,
    resolve_reward_class,
)
from flow_factory.rewards.jpeg_compressibility import JpegCompressibility
from flow_factory.rewards.registry import BUILTIN_REWARDS

CALLS: list[dict] = []  # what each test reward was called with


@pytest.fixture(autouse=True)
def clear_calls():
    CALLS.clear()


class PromptLength(PointwiseRewardModel):
    """Scores len(prompt); records every call's arguments."""

    required_fields = ("prompt",)

    def __call__(self, **kwargs):
        CALLS.append(kwargs)
        return RewardModelOutput(rewards=[float(len(p)) for p in kwargs["prompt"]])


class MeanPixel(PointwiseRewardModel):
    required_fields = ("prompt", "image", "video")
    use_tensor_inputs = True

    def __init__(self, offset: float = 0.0, **config):
        super().__init__(**config)
        self.offset = offset

    def __call__(self, prompt, image=None, video=None):
        CALLS.append({"prompt": prompt, "image": image, "video": video})
        return RewardModelOutput(rewards=image.mean(dim=(1, 2, 3)) + self.offset)


class PilRecorder(PointwiseRewardModel):
    required_fields = ("image", "video", "condition_images")

    def __call__(self, image=None, video=None, condition_images=None):
        CALLS.append({"image": image, "video": video, "condition_images": condition_images})
        return RewardModelOutput(rewards=np.zeros(len(image if image is not None else video)))


class RankInGroup(GroupwiseRewardModel):
    """Reward = rank of len(prompt) inside the group it is called with."""

    required_fields = ("prompt",)

    def __call__(self, prompt):
        CALLS.append({"prompt": prompt})
        lengths = torch.tensor([len(p) for p in prompt], dtype=torch.float32)
        return RewardModelOutput(rewards=lengths.argsort().argsort().float())


class WrongLength(PointwiseRewardModel):
    required_fields = ("prompt",)

    def __call__(self, prompt):
        return RewardModelOutput(rewards=[0.0])


# --- the call contract ------------------------------------------------------------------


def test_pointwise_is_called_in_chunks_of_batch_size():
    rs = RewardSet({"len": PromptLength(batch_size=2)}, {"len": 1.0})
    prompts = ["a", "bb", "ccc", "dddd", "eeeee"]
    scores = rs(prompts)["len"]
    assert [len(c["prompt"]) for c in CALLS] == [2, 2, 1]
    assert scores.tolist() == [1, 2, 3, 4, 5]  # stitched back in order
    assert scores.dtype == torch.float32


def test_groupwise_receives_each_whole_group_and_scores_go_back_in_place():
    rs = RewardSet({"rank": RankInGroup(batch_size=1)}, {"rank": 1.0})  # batch_size does not split groups
    prompts = ["x", "yyy", "xxx", "y", "zz", "z"]
    group_ids = torch.tensor([0, 1, 0, 1, 2, 2])  # interleaved groups
    scores = rs(prompts, group_ids=group_ids)["rank"]
    assert [c["prompt"] for c in CALLS] == [["x", "xxx"], ["yyy", "y"], ["zz", "z"]]
    assert scores.tolist() == [0, 1, 1, 0, 1, 0]


def test_groupwise_without_group_ids_is_an_error():
    rs = RewardSet({"rank": RankInGroup()}, {"rank": 1.0})
    with pytest.raises(ValueError, match=r"groupwise rewards \['rank'\] need group_ids"):
        rs(["a", "b"])


def test_only_required_fields_are_passed():
    rs = RewardSet({"len": PromptLength()}, {"len": 1.0})
    rs(["ab", "c"], images=torch.rand(2, 3, 8, 8), videos=torch.rand(2, 2, 3, 8, 8))
    assert list(CALLS[0]) == ["prompt"]


def test_tensor_inputs_get_the_batch_tensor_chunk():
    images = torch.rand(3, 3, 8, 8)
    rs = RewardSet({"mean": MeanPixel(batch_size=2)}, {"mean": 1.0})
    scores = rs(["a", "b", "c"], images=images)["mean"]
    assert torch.equal(CALLS[0]["image"], images[:2]) and torch.equal(CALLS[1]["image"], images[2:])
    assert CALLS[0]["video"] is None  # requested but not provided
    torch.testing.assert_close(scores, images.mean(dim=(1, 2, 3)))


def test_pil_inputs_are_uint8_rgb_rounded_from_0_1():
    images = torch.rand(2, 3, 5, 7)
    videos = torch.rand(2, 4, 3, 5, 7)
    conds = [torch.rand(2, 3, 6, 6), [torch.rand(3, 4, 4)]]  # stacked, and a list of odd sizes
    rs = RewardSet({"pil": PilRecorder()}, {"pil": 1.0})
    rs(["a", "b"], images=images, videos=videos, condition_images=conds)
    got = CALLS[0]
    expected = np.clip(np.rint(images.numpy() * 255), 0, 255).astype(np.uint8).transpose(0, 2, 3, 1)
    assert all(isinstance(im, Image.Image) and im.mode == "RGB" and im.size == (7, 5) for im in got["image"])
    np.testing.assert_array_equal(np.stack([np.asarray(im) for im in got["image"]]), expected)
    assert [len(frames) for frames in got["video"]] == [4, 4]
    np.testing.assert_array_equal(np.asarray(got["video"][1][3]),
                                  np.rint(videos[1, 3].numpy() * 255).astype(np.uint8).transpose(1, 2, 0))
    assert [[im.size for im in c] for c in got["condition_images"]] == [[(6, 6), (6, 6)], [(4, 4)]]


def test_pil_inputs_of_several_sizes_reach_a_tensor_reward_one_size_per_call():
    """What the reward server hands ``score``: decoded PIL images, sizes mixed by merged requests."""
    arrays = [np.full((h, w, 3), v, np.uint8) for (h, w), v in [((8, 8), 51), ((6, 4), 102), ((8, 8), 153),
                                                                ((8, 8), 204), ((6, 4), 255)]]
    inputs = RewardInputs(list("abcde"), [Image.fromarray(a) for a in arrays])
    scores = MeanPixel(batch_size=2).score(inputs)
    assert [tuple(c["image"].shape) for c in CALLS] == [(2, 3, 8, 8), (1, 3, 8, 8), (2, 3, 6, 4)]
    torch.testing.assert_close(scores, torch.tensor([0.2, 0.4, 0.6, 0.8, 1.0]))
    CALLS.clear()
    PilRecorder().score(inputs)
    assert all(a is b for a, b in zip(CALLS[0]["image"], inputs.image))  # PIL goes through as it is


def test_a_reward_returning_the_wrong_count_is_an_error():
    rs = RewardSet({"bad": WrongLength()}, {"bad": 1.0})
    with pytest.raises(ValueError, match="WrongLength returned 1 rewards for 3 samples"):
        rs(["a", "b", "c"])


def test_inputs_must_have_one_entry_per_prompt():
    rs = RewardSet({"mean": MeanPixel()}, {"mean": 1.0})
    with pytest.raises(ValueError, match="3 image for 2 prompts"):
        rs(["a", "b"], images=torch.rand(3, 3, 4, 4))


# --- jpeg_compressibility --------------------------------------------------------------


def flow_grpo_jpeg(array_hwc_uint8):
    """Independent reference: flow_grpo's jpeg_compressibility on one uint8 HWC image."""
    buffer = io.BytesIO()
    Image.fromarray(array_hwc_uint8).save(buffer, format="JPEG", quality=95)
    return -(len(buffer.getvalue()) / 1000) / 500


def test_jpeg_matches_flow_grpo_and_prefers_flat_images():
    g = torch.Generator().manual_seed(0)
    noise = torch.rand(1, 3, 64, 64, generator=g)
    flat = torch.full((1, 3, 64, 64), 0.5)
    images = torch.cat([noise, flat])
    reward = resolve_reward_class("jpeg_compressibility")()
    assert isinstance(reward, JpegCompressibility)
    scores = RewardSet({"jpeg": reward}, {"jpeg": 1.0})(["", ""], images=images)["jpeg"]
    arrays = np.rint(images.numpy() * 255).astype(np.uint8).transpose(0, 2, 3, 1)
    expected = torch.tensor([flow_grpo_jpeg(a) for a in arrays], dtype=torch.float32)
    torch.testing.assert_close(scores, expected, rtol=0, atol=0)
    assert scores[1] > scores[0]  # the flat image compresses better, so it scores higher
    assert (scores < 0).all()


def test_jpeg_video_is_the_mean_over_frames():
    videos = torch.rand(2, 3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    scores = RewardSet.from_configs([{"name": "jpeg", "reward_model": "jpeg_compressibility"}])(
        ["a", "b"], videos=videos)["jpeg"]
    arrays = np.rint(videos.numpy() * 255).astype(np.uint8).transpose(0, 1, 3, 4, 2)
    expected = [np.mean([flow_grpo_jpeg(f) for f in clip]) for clip in arrays]
    torch.testing.assert_close(scores, torch.tensor(expected, dtype=torch.float32))


# --- registry ---------------------------------------------------------------------------


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's own reward module on sys.path, plus one that needs a package not installed."""
    (tmp_path / "my_rewards_mod.py").write_text(textwrap.dedent("""
        from flow_factory.rewards import PointwiseRewardModel, RewardModelOutput

        class Constant(PointwiseRewardModel):
            required_fields = ("prompt",)
            def __call__(self, prompt):
                return RewardModelOutput(rewards=[3.0] * len(prompt))

        class NotAReward:
            pass
    """))
    (tmp_path / "needs_missing_dep.py").write_text("import surely_not_installed_pkg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("my_rewards_mod", "needs_missing_dep"):
        sys.modules.pop(name, None)


def test_class_paths_with_dot_or_colon(user_module):
    dotted = resolve_reward_class("my_rewards_mod.Constant")
    assert dotted is resolve_reward_class("my_rewards_mod:Constant")
    assert RewardSet.from_configs([{"name": "c", "reward_model": "my_rewards_mod.Constant"}])(["x"])["c"].item() == 3


def test_registered_names_are_case_insensitive():
    assert resolve_reward_class("JPEG_Compressibility") is JpegCompressibility


def test_unknown_name_lists_registered_names_and_a_close_match():
    with pytest.raises(ValueError, match=r"unknown reward 'jpeg_compresibility'.*Registered rewards: "
                                         r"\[.*'jpeg_compressibility'.*did you mean 'jpeg_compressibility'"):
        resolve_reward_class("jpeg_compresibility")


def test_bad_class_paths_name_the_module_or_attribute(user_module):
    with pytest.raises(ImportError, match="no module named 'no_such_pkg.rewards'"):
        resolve_reward_class("no_such_pkg.rewards.Foo")
    with pytest.raises(ImportError, match=r"module 'my_rewards_mod' has no attribute 'Constnt'.*'Constant'"):
        resolve_reward_class("my_rewards_mod.Constnt")
    with pytest.raises(ImportError, match=r"module 'needs_missing_dep' was found but importing it "
                                          r"failed.*surely_not_installed_pkg"):
        resolve_reward_class("needs_missing_dep.Reward")
    with pytest.raises(TypeError, match="not a subclass of PointwiseRewardModel"):
        resolve_reward_class("my_rewards_mod.NotAReward")


def test_register_reward_refuses_a_taken_name():
    with pytest.raises(ValueError, match="already registered"):
        register_reward("jpeg_compressibility")(PromptLength)


def test_every_builtin_name_points_at_a_class_of_its_module():
    """Read as source, not imported: the table must not need transformers to be checked."""
    for name, path in BUILTIN_REWARDS.items():
        assert name == name.lower(), name  # looked up lower-cased
        module, _, cls = path.partition(":")
        source = importlib.util.find_spec(module).origin
        with open(source, encoding="utf-8") as f:
            assert f"\nclass {cls}(" in f.read(), f"{name}: no class {cls} in {source}"


def test_a_user_registration_adds_a_name(user_module):
    from my_rewards_mod import Constant

    register_reward("my_constant")(Constant)
    assert resolve_reward_class("My_Constant") is Constant


def test_resolving_a_builtin_imports_only_its_module():
    code = ("import sys; from flow_factory.rewards import resolve_reward_class; "
            "resolve_reward_class('jpeg_compressibility'); "
            "print(sorted(m for m in sys.modules if m.startswith('flow_factory.rewards.'))); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    modules, transformers_loaded = out.strip().splitlines()
    assert modules == str(["flow_factory.rewards.async_pool", "flow_factory.rewards.base",
                           "flow_factory.rewards.jpeg_compressibility", "flow_factory.rewards.registry",
                           "flow_factory.rewards.reward_set"])
    assert transformers_loaded == "False"


# --- RewardSet.from_configs ---------------------------------------------------------------


def test_from_configs_takes_reward_configs_and_mappings_read_by_reward_config():
    path = f"{__name__}.MeanPixel"
    rs = RewardSet.from_configs([
        {"name": "plain", "reward_model": path, "weight": 2.0, "offset": 1.0},
        RewardConfig(name="typed", reward_model=path, weight=0.5, batch_size=4, dtype="fp32",
                     kwargs={"offset": 2.0}),
        {"name": "old", "reward_model": path, "weight": -1.0, "reward_model_kwargs": {"offset": 3.0}},
    ])
    assert rs.weights == {"plain": 2.0, "typed": 0.5, "old": -1.0}
    assert rs.models["typed"].batch_size == 4 and rs.models["plain"].batch_size == 16  # RewardConfig's default
    images = torch.zeros(2, 3, 4, 4)
    scores = rs(["a", "b"], images=images)
    assert {k: v.tolist() for k, v in scores.items()} == {"plain": [1.0, 1.0], "typed": [2.0, 2.0], "old": [3.0, 3.0]}
    one = RewardSet.from_configs({"reward_model": path})  # one entry alone, named by its reward_model
    assert one.names == [path]


def test_constructor_options_are_every_field_the_set_does_not_read():
    """A field added to RewardConfig reaches the constructor with no list to update."""
    config = RewardConfig(name="n", reward_model="remote", weight=2.0, async_reward=True, num_workers=2,
                          server_url="http://h:1", timeout=5.0, image_format="JPEG")
    assert config.constructor_options() == {"batch_size": 16, "dtype": "float32", "server_url": "http://h:1",
                                            "timeout": 5.0, "image_format": "JPEG"}


def test_identical_models_are_built_and_scored_once():
    entry = {"reward_model": f"{__name__}.PromptLength", "batch_size": 8, "dtype": "bf16"}
    rs = RewardSet.from_configs([{**entry, "name": "a", "weight": 1.0},
                                 {**entry, "name": "b", "weight": 3.0, "dtype": "bfloat16"},
                                 {**entry, "name": "c", "batch_size": 4}])
    assert rs.models["a"] is rs.models["b"] and rs.models["c"] is not rs.models["a"]
    scores = rs(["xy", "z"])
    assert len(CALLS) == 2  # a/b share one call, c its own
    assert scores["a"].tolist() == scores["b"].tolist() == scores["c"].tolist() == [2.0, 1.0]


def test_config_errors_name_the_reward():
    with pytest.raises(TypeError, match=r"reward 'j' \(jpeg_compressibility\) could not be built.*qualty"):
        RewardSet.from_configs([{"name": "j", "reward_model": "jpeg_compressibility", "qualty": 80}])
    with pytest.raises(ConfigError, match=r"two entries are named 'j' \(entries 0 and 1\)"):
        RewardSet.from_configs([{"name": "j", "reward_model": "jpeg_compressibility"}] * 2)
    with pytest.raises(ConfigError, match=r"rewards\[1\]\.weight: expected a number or a mapping, got nan"):
        RewardSet.from_configs([{"reward_model": "jpeg_compressibility"},
                                {"name": "j", "reward_model": "jpeg_compressibility", "weight": float("nan")}])


def test_pil_conversion_happens_once_per_batch_for_all_rewards():
    rs = RewardSet({"one": PilRecorder(batch_size=1), "two": PilRecorder(batch_size=2)},
                   {"one": 1.0, "two": 1.0})
    rs(["a", "b"], images=torch.rand(2, 3, 4, 4))
    chunked = [im for call in CALLS[:2] for im in call["image"]]
    assert len(CALLS) == 3 and all(a is b for a, b in zip(chunked, CALLS[2]["image"]))


def test_shapebench_rewards_resolve_by_name_in_a_fresh_process():
    """`reward_model: shapebench` in an ff-train config works without importing anything first."""
    code = textwrap.dedent("""
        from flow_factory.rewards.registry import resolve_reward_class
        print(resolve_reward_class("shapebench").__name__, resolve_reward_class("shapebench_strict").__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["ShapeBenchReward", "ShapeBenchStrictReward"]


def test_an_eval_reward_that_is_a_training_reward_shares_its_model():
    """A run's eval rewards and training rewards are two sets, held for the whole run: an eval entry naming the same
    model with the same options (its name, weight and routing aside) shares the training set's instance instead of
    loading it again (a PickScore twice is 1.8 GiB more on the GPU). One that differs by its batch size alone (as in
    Flow-Factory's examples: 16 to train, 32 to evaluate) is a copy sharing its weights, scoring its own batches;
    another dtype, a model of its own."""
    entry = {"reward_model": f"{__name__}.PromptLength", "batch_size": 8}
    built = {}
    train = RewardSet.from_configs([{**entry, "name": "a"}], built=built)
    weights = train.models["a"].weights = object()  # what a copy must share
    evaluation = RewardSet.from_configs([{**entry, "name": "e", "weight": 2.0}, {**entry, "name": "f", "batch_size": 32},
                                         {**entry, "name": "g", "dtype": "bf16"}], built=built)
    a, e, f, g = train.models["a"], evaluation.models["e"], evaluation.models["f"], evaluation.models["g"]
    assert e is a and f is not a and f.weights is weights and (a.batch_size, f.batch_size) == (8, 32)
    assert not hasattr(g, "weights")
    assert not hasattr(RewardSet.from_configs([{**entry, "name": "e"}]).models["e"], "weights")  # no built: its own
    assert evaluation(["xy", "z"])["f"].tolist() == [2.0, 1.0]


def test_the_trainer_builds_its_eval_rewards_beside_its_training_rewards_once(tmp_path):
    """``Trainer._setup_rewards``, the wiring of the test above."""
    from types import SimpleNamespace

    from flow_factory.config import parse_config
    from flow_factory.trainer import Trainer
    from helpers_runs import tiny_run_config

    config = tiny_run_config(tmp_path, "sd3-5", tmp_path / "model")
    config["eval_rewards"] = [{"name": "jpeg_eval", "reward_model": "jpeg_compressibility", "weight": 2.0}]
    rewards, eval_rewards = Trainer._setup_rewards(SimpleNamespace(cfg=parse_config(config), accelerator=None))
    assert eval_rewards is not rewards and eval_rewards.models["jpeg_eval"] is rewards.models["jpeg"]
