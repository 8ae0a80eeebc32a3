"""Async rewards: submitted per micro-batch while sampling goes on, groupwise ones on complete
groups, coexisting with sync rewards, errors re-raised on the main thread with the reward's name;
the config keys."""

import threading

import pytest
import torch

from flow_factory.config import ConfigError
from flow_factory.config.rewards import RewardConfig
from flow_factory.rewards import GroupwiseRewardModel, PointwiseRewardModel, RewardModelOutput, RewardSet
from flow_factory.rewards.async_pool import RewardError

SEEN: list = []


class SlowMean(PointwiseRewardModel):
    required_fields = ("prompt", "image")
    use_tensor_inputs = True

    def __call__(self, prompt, image):
        SEEN.append(("mean", threading.current_thread().name, list(prompt)))
        return RewardModelOutput(rewards=image.mean(dim=(1, 2, 3)))


class GroupRank(GroupwiseRewardModel):
    required_fields = ("prompt", "image")
    use_tensor_inputs = True

    def __call__(self, prompt, image):
        SEEN.append(("rank", threading.current_thread().name, list(prompt)))
        return RewardModelOutput(rewards=image.mean(dim=(1, 2, 3)).argsort().argsort().float() / len(prompt))


class Broken(PointwiseRewardModel):
    required_fields = ("prompt",)

    def __call__(self, prompt):
        raise KeyError("the model lost its head")


def micro_batches(n, size):
    return [(i, min(i + size, n)) for i in range(0, n, size)]


@pytest.fixture(autouse=True)
def clear():
    SEEN.clear()


def test_async_and_sync_rewards_give_the_sync_scores():
    torch.manual_seed(0)
    images = torch.rand(12, 3, 4, 4)
    prompts = [f"p{i // 4}" for i in range(12)]
    group_ids = torch.arange(12) // 4
    sync = RewardSet({"mean": SlowMean(), "rank": GroupRank()}, {"mean": 1.0, "rank": 1.0})
    expected = sync(prompts, images=images, group_ids=group_ids)
    mixed = RewardSet({"mean": SlowMean(), "rank": GroupRank(), "mean_sync": SlowMean(batch_size=100)},
                      {"mean": 1.0, "rank": 1.0, "mean_sync": 1.0}, async_workers={"mean": 3, "rank": 2})
    job = mixed.start(group_ids)
    for a, b in micro_batches(12, 5):  # micro-batches straddle groups
        job.add(prompts[a:b], images=images[a:b])
    got = job.finish()
    torch.testing.assert_close(got["mean"], expected["mean"])
    torch.testing.assert_close(got["rank"], expected["rank"])
    torch.testing.assert_close(got["mean_sync"], expected["mean"])
    async_calls = [s for s in SEEN if s[1].startswith("reward-")]
    assert {s[0] for s in async_calls} == {"mean", "rank"}
    # each groupwise call saw exactly one complete group of 4
    assert sorted(s[2] for s in SEEN if s[0] == "rank" and s[1].startswith("reward-")) == [["p0"] * 4, ["p1"] * 4,
                                                                                          ["p2"] * 4]
    mixed.close()


class MeetsOthers(PointwiseRewardModel):
    """Each call waits until ``parties`` calls are in flight together (a barrier)."""

    required_fields = ("prompt",)

    def __init__(self, parties: int, **config):
        super().__init__(**config)
        self.barrier = threading.Barrier(parties, timeout=10)

    def __call__(self, prompt):
        self.barrier.wait()  # BrokenBarrierError unless the calls really run at the same time
        return RewardModelOutput(rewards=[0.0] * len(prompt))


def test_micro_batches_are_scored_concurrently_while_adding_returns():
    rs = RewardSet({"meet": MeetsOthers(4)}, {"meet": 1.0}, async_workers={"meet": 4})
    job = rs.start()
    for a, b in micro_batches(8, 2):
        job.add(["x"] * (b - a))  # returns at once: were add scoring in place, the barrier would never fill
    assert job.finish()["meet"].tolist() == [0.0] * 8
    rs.close()


def test_a_worker_exception_stops_on_the_main_thread_with_the_name():
    rs = RewardSet({"judge": Broken()}, {"judge": 1.0}, async_workers={"judge": 2})
    job = rs.start()
    job.add(["a", "b"])
    with pytest.raises(RewardError, match=r"reward 'judge' failed in an async worker: KeyError: .*lost its head") as e:
        job.finish()
    assert isinstance(e.value.__cause__, KeyError)
    rs.close()


def test_shared_instance_is_scored_once_even_when_async():
    model = SlowMean()
    rs = RewardSet({"a": model, "b": model}, {"a": 1.0, "b": 2.0}, async_workers={"a": 2})
    job = rs.start()
    job.add(["x", "y"], images=torch.rand(2, 3, 2, 2))
    out = job.finish()
    assert len(SEEN) == 1 and torch.equal(out["a"], out["b"])
    rs.close()


def test_groupwise_async_needs_group_ids_and_the_count_must_match():
    rs = RewardSet({"rank": GroupRank()}, {"rank": 1.0}, async_workers={"rank": 1})
    with pytest.raises(ValueError, match=r"groupwise rewards \['rank'\] need group_ids"):
        rs.start()
    job = rs.start(torch.tensor([0, 0, 1, 1]))
    job.add(["a", "a", "b"], images=torch.rand(3, 3, 2, 2))
    with pytest.raises(ValueError, match="3 samples added for 4 group ids"):
        job.finish()
    rs.close()


def test_from_configs_reads_async_keys():
    entries = [RewardConfig(name="m", reward_model=f"{__name__}.SlowMean", async_reward=True, num_workers=3),
               RewardConfig(name="s", reward_model=f"{__name__}.SlowMean", batch_size=4)]
    rs = RewardSet.from_configs(entries)
    assert rs.is_async("m") and not rs.is_async("s")
    assert rs.pool(rs.models["m"])._max_workers == 3
    rs.close()


def test_num_workers_without_async_is_a_config_error():
    base = {"data": {"dataset_dir": "x"}, "model": {"model_name_or_path": "x", "model_type": "sd3-5"}}
    with pytest.raises(ConfigError, match=r"rewards.*num_workers: 4 threads only apply with async_reward: true"):
        from flow_factory.config import Config

        Config.from_dict({**base, "rewards": [{"reward_model": "jpeg_compressibility", "num_workers": 4}]})
    with pytest.raises(ConfigError, match=r"timeout"):
        from flow_factory.config import Config

        Config.from_dict({**base, "rewards": [{"reward_model": "remote", "timeout": -1}]})
