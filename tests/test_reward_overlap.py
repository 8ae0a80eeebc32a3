"""train.reward_optimization_overlap: optimisation starts while the async rewards are still scored, and ends with
the weights of a run without it (same micro-batches, same order, same accumulation); the configs it cannot keep
that update for are refused, each with why."""

import threading
import time

import pytest
import torch

from flow_factory.config import ConfigError, parse_config
from flow_factory.rewards import PointwiseRewardModel, RewardModelOutput
from flow_factory.rewards.async_pool import RewardJob
from flow_factory.trainer.overlap import StreamedAdvantages
from flow_factory.timer import PhaseTimer

from helpers_runs import ff_train_in_this_process, tiny_run_config, write_config

EVENTS: list[tuple[str, float]] = []  # ("scored" / "trained", time), in the order they happened
LOCK = threading.Lock()


class SlowBrightness(PointwiseRewardModel):
    """Each image's mean brightness, after a sleep that grows with the call: the first samples are scored first,
    the last well after sampling ends."""

    required_fields = ("prompt", "image")
    use_tensor_inputs = True

    def __init__(self, delay: float = 0.3, nan_call: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.delay, self.nan_call, self.calls = delay, nan_call, 0

    def __call__(self, prompt, image):
        with LOCK:
            self.calls += 1
            k = self.calls
        time.sleep(self.delay * k)
        with LOCK:
            EVENTS.append(("scored", time.perf_counter()))
        scores = image.float().mean(dim=(1, 2, 3))
        return RewardModelOutput(rewards=scores * float("nan") if k == self.nan_call else scores)


def overlap_config(tmp, path, overlap: bool, **train) -> dict:
    config = tiny_run_config(tmp, "sd3-5", path, global_std=False, advantage_aggregation="sum",
                             reward_optimization_overlap=overlap, unique_sample_num_per_epoch=3, group_size=2,
                             per_device_batch_size=1, gradient_step_per_epoch=2, max_epochs=2, **train)
    config["eval"]["eval_freq"] = 0
    config["log"] |= {"logging_backend": "none", "save_freq": 0}
    config["rewards"] = [{"name": "slow", "reward_model": f"{__name__}.SlowBrightness", "async_reward": True,
                          "num_workers": 2, "batch_size": 1, "delay": 0.15}]
    return config


def train_and_load(tmp, config, monkeypatch) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from flow_factory.trainer import optimize

    train_on = optimize._EpochSteps.train_on

    def timed(self, *args, **kwargs):
        with LOCK:
            EVENTS.append(("trained", time.perf_counter()))
        return train_on(self, *args, **kwargs)

    monkeypatch.setattr(optimize._EpochSteps, "train_on", timed)
    EVENTS.clear()
    (out, err), code = ff_train_in_this_process([write_config(tmp, config)])
    assert code == 0, err
    return load_file(tmp / "saves" / "run" / "checkpoints" / "epoch_2" / "pytorch_lora_weights.safetensors")


def trained_before_the_last_score() -> bool:
    """Whether, in the first epoch, a micro-batch trained before that epoch's last score came in."""
    first_train = next(t for kind, t in EVENTS if kind == "trained")
    scores = [t for kind, t in EVENTS if kind == "scored"]
    return first_train < max(scores[:6])  # the first epoch: 6 samples, one a call


@pytest.mark.parametrize("train", [{"shuffle_samples": False},
                                   {"shuffle_samples": True, "num_inner_epochs": 2}], ids=["in-order", "shuffled"])
def test_overlap_trains_early_and_ends_with_the_same_weights(tmp_path, tiny_sd3_path, monkeypatch, train):
    without = train_and_load(tmp_path / "a", overlap_config(tmp_path / "a", tiny_sd3_path, False, **train),
                             monkeypatch)
    assert not trained_before_the_last_score()
    with_overlap = train_and_load(tmp_path / "b", overlap_config(tmp_path / "b", tiny_sd3_path, True, **train),
                                  monkeypatch)
    if not train["shuffle_samples"]:  # the first group is scored long before the last
        assert trained_before_the_last_score()
    assert without.keys() == with_overlap.keys()
    moved = max(float(v.abs().max()) for v in without.values())
    assert moved > 0
    for name in without:
        torch.testing.assert_close(with_overlap[name], without[name], rtol=0, atol=1e-6)


def test_a_nan_scored_while_training_stops_the_rest_of_the_update(tmp_path, tiny_sd3_path, monkeypatch):
    """The last group of epoch 0 is scored NaN after its first groups trained an optimizer step: the rest of the
    epoch's update is skipped, nothing non-finite reaches the weights, and epoch 1 trains."""
    import json

    config = overlap_config(tmp_path, tiny_sd3_path, True, shuffle_samples=False)
    config["rewards"][0]["nan_call"] = 6  # the sixth sample of epoch 0: group 2
    weights = train_and_load(tmp_path, config, monkeypatch)
    assert all(bool(torch.isfinite(v).all()) for v in weights.values())
    history = json.loads((tmp_path / "saves" / "run" / "history.json").read_text())["train"]
    assert history[0]["train/skipped_updates"] == 1 and history[0]["reward/slow/nonfinite"] == 1
    assert "train/loss" in history[0]  # groups 0 and 1 trained before group 2 was scored
    assert "advantage/mean" not in history[0] and "advantage/mean" in history[1]
    assert history[1]["train/skipped_updates"] == 0


class Fixed(PointwiseRewardModel):
    required_fields = ("prompt",)

    def __init__(self, values, **kwargs):
        super().__init__(**kwargs)
        self.values = values

    def __call__(self, prompt):
        return RewardModelOutput(rewards=torch.tensor([self.values[p] for p in prompt], dtype=torch.float32))


def test_streamed_advantages_equal_the_whole_batch_and_stop_at_a_nan():
    from concurrent.futures import ThreadPoolExecutor

    from flow_factory.advantages import combine_advantages

    values = {f"s{i}": float(v) for i, v in enumerate([3.0, 1.0, 0.5, 4.0, 2.0, 2.5])}
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2])
    with ThreadPoolExecutor(2) as pool:
        job = RewardJob({"r": Fixed(values)}, {"r": pool}, group_ids)
        for i in range(6):
            job.add([f"s{i}"])
        streamed = StreamedAdvantages(job, group_ids, {"r": 2.0}, {"r": torch.ones(6, dtype=torch.bool)},
                                      PhaseTimer())
        assert streamed.ready(torch.tensor([3]))  # group 1 only
        assert streamed.final.tolist() == [False, False, True, True, False, False]
        assert streamed.ready(torch.tensor([0, 5]))
    whole = combine_advantages({"r": torch.tensor(list(values.values()))}, {"r": 2.0}, group_ids, "sum", False)
    assert torch.equal(streamed.values, whole)

    values["s4"] = float("nan")
    with ThreadPoolExecutor(2) as pool:
        job = RewardJob({"r": Fixed(values)}, {"r": pool}, group_ids)
        for i in range(6):
            job.add([f"s{i}"])
        streamed = StreamedAdvantages(job, group_ids, {"r": 1.0}, {"r": torch.ones(6, dtype=torch.bool)},
                                      PhaseTimer())
        assert streamed.ready(torch.tensor([0]))
        assert not streamed.ready(torch.tensor([4]))
        assert "reward 'r' is NaN or inf for 1 of 2 samples" in streamed.problem
        assert not streamed.ready(torch.tensor([2]))  # the rest of the epoch is skipped


def test_streamed_advantages_of_a_routed_reward_equal_the_whole_batch():
    """A reward scoring some datasets only (NaN elsewhere, weight 0 there), beside one that scores all."""
    from concurrent.futures import ThreadPoolExecutor

    from flow_factory.advantages import combine_advantages

    group_ids = torch.tensor([0, 0, 1, 1, 2, 2])
    a = {f"s{i}": v for i, v in enumerate([3.0, 1.0, 0.5, 4.0, 2.0, 2.5])}
    b = {f"s{i}": v for i, v in enumerate([1.0, 2.0, 5.0, 4.0, 0.0, 0.0])}
    routed = torch.tensor([True, True, True, True, False, False])
    weights = {"a": 1.0, "b": torch.where(routed, 0.5, 0.0)}
    with ThreadPoolExecutor(2) as pool:
        models = {"a": Fixed(a), "b": Fixed(b)}
        job = RewardJob(models, {"a": pool, "b": pool}, group_ids, {id(models["b"]): routed})
        for i in range(6):
            job.add([f"s{i}"])
        streamed = StreamedAdvantages(job, group_ids, weights, {"a": torch.ones(6, dtype=torch.bool), "b": routed},
                                      PhaseTimer())
        for i in (5, 0, 2):
            assert streamed.ready(torch.tensor([i]))
        scores = job.finish()
    assert torch.isnan(scores["b"][4:]).all()
    whole = combine_advantages(scores, weights, group_ids, "sum", False)
    assert torch.equal(streamed.values, whole)


def base_config(tmp_path, **train) -> dict:
    (tmp_path / "train.txt").write_text("a\nb\n")
    return {"data": {"dataset_dir": str(tmp_path)},
            "model": {"model_name_or_path": "m", "model_type": "sd3-5"},
            "train": {"trainer_type": "grpo", "global_std": False, "advantage_aggregation": "sum",
                      "reward_optimization_overlap": True, "unique_sample_num_per_epoch": 2, "group_size": 2,
                      "per_device_batch_size": 2, **train},
            "rewards": [{"reward_model": "jpeg_compressibility", "async_reward": True}]}


@pytest.mark.parametrize(("change", "why"), [
    ({"train": {"global_std": True}}, r"global_std: true normalises every advantage by the std of the whole batch"),
    ({"train": {"advantage_aggregation": "gdpo"}}, r"advantage_aggregation: gdpo normalises .* over the whole batch"),
    ({"num_processes": 2}, r"num_processes: 2; the advantages are computed over the batch gathered"),
    ({"train": {"trainer_type": "dpo"}}, r"dpo's training pairs .* are made from the advantages of every group"),
])
def test_overlap_is_refused_where_it_cannot_keep_the_update(tmp_path, change, why):
    config = base_config(tmp_path)
    for section, values in change.items():
        if isinstance(values, dict):
            config[section] |= values
        else:
            config[section] = values
    with pytest.raises(ConfigError, match=r"train\.reward_optimization_overlap: " + why):
        parse_config(config)


def test_an_offline_run_has_no_rewards_to_overlap(tmp_path):
    from flow_factory.config.overlap import overlap_problems

    config = parse_config(base_config(tmp_path, reward_optimization_overlap=False))
    config.train.trainer_type, config.train.reward_optimization_overlap = "sft", True
    assert overlap_problems(config) == ["train.reward_optimization_overlap: sft trains from a dataset, with no "
                                        "rewards to overlap; remove the key"]


def test_overlap_settings_without_effect_are_noted(tmp_path):
    config = base_config(tmp_path, reward_optimization_overlap_mode="ready",
                         reward_optimization_overlap_poll_interval=0.1)
    config["rewards"][0]["async_reward"] = False
    notes = parse_config(config).notes()
    assert any(n.startswith("train.reward_optimization_overlap: no reward is async_reward") for n in notes)
    assert any(n.startswith("train.reward_optimization_overlap_mode: ready is read as ordered") for n in notes)
    assert any(n.startswith("train.reward_optimization_overlap_poll_interval:") for n in notes)
    plain = parse_config(base_config(tmp_path)).notes()
    assert not any("overlap" in n for n in plain)
