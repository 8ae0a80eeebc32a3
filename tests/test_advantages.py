"""Advantages: hand-computed values for group normalisation, sum and gdpo."""

import math
import statistics

import pytest
import torch

from flow_factory.advantages import combine_advantages, group_advantages

EPS = 1e-4
# two groups (prompts) of three samples each
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
R1 = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 10.0])  # weight 1.0; group 1 has no spread
R2 = torch.tensor([1.0, 0.0, 2.0, 0.0, 3.0, 3.0])  # weight 0.5
WEIGHTS = {"r1": 1.0, "r2": 0.5}


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), rtol=1e-6, atol=1e-6)


def test_per_group_std_matches_hand_values():
    # group 0: [1, 2, 3], mean 2, population std sqrt(2/3); group 1: constant -> advantage 0
    s = 1 / (math.sqrt(2 / 3) + EPS)
    close(group_advantages(R1, GROUPS, global_std=False), [-s, 0.0, s, 0.0, 0.0, 0.0])


def test_global_std_uses_the_whole_batch():
    std = statistics.pstdev(R1.tolist())  # population std over all six rewards
    s = 1 / (std + EPS)
    close(group_advantages(R1, GROUPS, global_std=True), [-s, 0.0, s, 0.0, 0.0, 0.0])


def test_sum_is_the_advantage_of_the_weighted_sum():
    # R = r1 + 0.5 r2 = [1.5, 2, 4 | 10, 11.5, 11.5]
    # group 0: mean 2.5, deviations [-1, -0.5, 1.5], variance 3.5 / 3
    # group 1: mean 11, deviations [-1, 0.5, 0.5], variance 1.5 / 3
    a = 1 / (math.sqrt(3.5 / 3) + EPS)
    b = 1 / (math.sqrt(0.5) + EPS)
    adv = combine_advantages({"r1": R1, "r2": R2}, WEIGHTS, GROUPS, aggregation="sum", global_std=False)
    close(adv, [-1 * a, -0.5 * a, 1.5 * a, -1 * b, 0.5 * b, 0.5 * b])


def test_sum_with_global_std():
    total = [1.5, 2.0, 4.0, 10.0, 11.5, 11.5]
    g = 1 / (statistics.pstdev(total) + EPS)
    adv = combine_advantages({"r1": R1, "r2": R2}, WEIGHTS, GROUPS, aggregation="sum", global_std=True)
    close(adv, [-1 * g, -0.5 * g, 1.5 * g, -1 * g, 0.5 * g, 0.5 * g])


def test_gdpo_normalises_each_reward_then_the_batch():
    # per-reward group advantages:
    #   r1: group 0 [1,2,3] -> [-1, 0, 1] * s, group 1 constant -> 0          (s = 1/(sqrt(2/3)+eps))
    #   r2: group 0 [1,0,2] -> [0, -1, 1] * s, group 1 [0,3,3]: mean 2, std sqrt(2) -> [-2, 1, 1] * t
    s = 1 / (math.sqrt(2 / 3) + EPS)
    t = 1 / (math.sqrt(2) + EPS)
    combined = [-s, -0.5 * s, 1.5 * s, -t, 0.5 * t, 0.5 * t]  # 1.0 * r1 + 0.5 * r2
    mean = sum(combined) / 6
    std = math.sqrt(sum((c - mean) ** 2 for c in combined) / 6)
    expected = [(c - mean) / (std + EPS) for c in combined]
    adv = combine_advantages({"r1": R1, "r2": R2}, WEIGHTS, GROUPS, aggregation="gdpo", global_std=False)
    close(adv, expected)
    # batch-normalised: zero mean, unit population std
    assert abs(adv.mean().item()) < 1e-6
    assert abs(adv.std(unbiased=False).item() - 1) < 1e-3


def test_gdpo_is_blind_to_a_reward_scale_and_sum_is_not():
    scaled = {"r1": R1, "r2": R2 * 1000}
    plain = {"r1": R1, "r2": R2}
    gdpo = lambda r: combine_advantages(r, WEIGHTS, GROUPS, aggregation="gdpo")  # noqa: E731
    summed = lambda r: combine_advantages(r, WEIGHTS, GROUPS, aggregation="sum")  # noqa: E731
    torch.testing.assert_close(gdpo(scaled), gdpo(plain), rtol=1e-3, atol=1e-3)
    assert (summed(scaled) - summed(plain)).abs().max() > 0.1


def test_single_reward_sum_equals_group_advantages():
    adv = combine_advantages({"r1": R2}, {"r1": 2.0}, GROUPS, aggregation="sum")
    # weight 2 scales rewards and std alike; only eps tells them apart
    torch.testing.assert_close(adv, group_advantages(R2, GROUPS), rtol=1e-4, atol=1e-4)


def test_interleaved_groups_give_the_same_advantages_as_contiguous_ones():
    perm = torch.tensor([3, 0, 4, 1, 5, 2])
    for global_std in (False, True):
        base = group_advantages(R2, GROUPS, global_std)
        shuffled = group_advantages(R2[perm], GROUPS[perm], global_std)
        torch.testing.assert_close(shuffled, base[perm])


def test_float64_arithmetic_keeps_large_nearly_equal_rewards_apart():
    # float32 spacing at 1e8 is 8: it cannot tell these apart; the advantages must still order them
    rewards = torch.tensor([1e8, 1e8 + 0.25, 1e8 + 0.5], dtype=torch.float64)
    assert rewards.float().unique().numel() == 1
    adv = group_advantages(rewards, torch.zeros(3, dtype=torch.long))
    s = 1 / (math.sqrt(1 / 24) + EPS)  # deviations +-0.25, population variance 0.125 / 3
    close(adv, [-0.25 * s, 0.0, 0.25 * s])


def test_errors():
    with pytest.raises(ValueError, match="gdpo"):
        combine_advantages({"r1": R1}, {"r1": 1.0}, GROUPS, aggregation="mean")
    with pytest.raises(ValueError, match=r"no weight for \['r2'\]"):
        combine_advantages({"r1": R1, "r2": R2}, {"r1": 1.0}, GROUPS)
    with pytest.raises(ValueError, match=r"no rewards for \['r3'\]"):
        combine_advantages({"r1": R1}, {"r1": 1.0, "r3": 1.0}, GROUPS)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        group_advantages(R1, GROUPS[:4])
