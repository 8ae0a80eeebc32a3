"""DGPO (arXiv:2510.08425): the group loss against a hand-computed value, the clip mask,
the gradient sign on one parameter, whole groups with shared noise in a micro-batch, and
the config's refusals (the toy learning test and ff-train runs live with the others)."""

import math

import pytest
import torch
from helpers_algorithms import toy_rollouts
from test_config import minimal as base_config

from flow_factory.algorithms import DGPO, dgpo_loss, dsm_clip_mask, group_members
from flow_factory.config.train import TrainConfig
from flow_factory.dynamics import ODE


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_dgpo_loss_equals_hand_computed_value():
    err = torch.tensor([1.0, 2.0, 0.5, 3.0])
    err_ref = torch.tensor([1.5, 1.0, 0.5, 2.0])
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5])
    group = torch.tensor([0, 0, 1, 1])
    beta, g = 4.0, 2
    # group 0: 4 / 2 (1 (1 - 1.5) + (-1)(2 - 1)) = -3; group 1: 2 (2 * 0 + (-.5)(3 - 2)) = -1
    s0, s1 = -3.0, -1.0
    expected = (sig(s0) * 1 * 1.0 + sig(s0) * -1 * 2.0 + sig(s1) * 2 * 0.5 + sig(s1) * -0.5 * 3.0) / 4
    loss, metrics = dgpo_loss(err, err_ref, adv, group, g, beta)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["implicit_accuracy"].item() == 1.0


def test_the_gradient_is_the_group_dpo_gradient():
    """d L / d e_i = sigmoid(s_g) A_i / B, the gradient of -log sigmoid(-s_g) over dpo_beta / G."""
    err = torch.tensor([1.0, 2.0, 0.5, 3.0], requires_grad=True)
    err_ref = torch.tensor([1.5, 1.0, 0.5, 2.0])
    adv = torch.tensor([1.0, -1.0, 2.0, -0.5])
    group = torch.tensor([0, 0, 1, 1])
    dgpo_loss(err, err_ref, adv, group, 2, 4.0)[0].backward()
    e = err.detach().clone().requires_grad_(True)
    s = torch.stack([(adv[:2] * (e[:2] - err_ref[:2])).sum(), (adv[2:] * (e[2:] - err_ref[2:])).sum()]) * 4.0 / 2
    (-torch.nn.functional.logsigmoid(-s).sum() / 4 / (4.0 / 2)).backward()
    torch.testing.assert_close(err.grad, e.grad)


def test_clip_mask_follows_the_advantage_sign():
    err = torch.tensor([1.0, 1.0, 1.0, 1.0])
    err_old = torch.tensor([1.5, 1.5, 0.5, 1.0])  # ratio e^.5, e^.5, e^-.5, 1
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    assert dsm_clip_mask(err, err_old, adv, 0.2).tolist() == [True, False, True, False]


class OneParameter:
    """v = w * (eps - x0): w = 1 fits every sample exactly; the reference is w = 0.5."""

    def __init__(self, w):
        self.w = torch.tensor(w, requires_grad=True)

    def velocity(self, x_t, sigma, cond):
        return self.w * self.target

    def reference_velocity(self, x_t, sigma, cond):
        return 0.5 * self.target

    def sampling_velocity(self, x_t, sigma, cond):
        return self.w.detach() * self.target


def cfg(**kw):
    base = dict(trainer_type="dgpo", group_size=2, per_device_batch_size=4, dpo_beta=1.0, clip_range=0.2,
                num_train_timesteps=1, time_sampling_strategy="uniform", time_shift=1.0, timestep_range=1.0,
                num_inference_steps=4)
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("clip_dsm", [True, False])
def test_preferred_samples_likelihood_goes_up(clip_dsm):
    """Only the preferred sample of the group moves w: its error (w - 1)^2 |target|^2 falls as w
    goes from 0.8 toward 1, so the gradient on w is negative."""
    algo = DGPO(cfg(clip_dsm=clip_dsm), ODE())
    rollouts = toy_rollouts(2)
    units = group_members(torch.tensor([7, 7]))
    batch = next(algo.micro_batches(rollouts, torch.tensor([1.0, 0.0]), units, torch.Generator().manual_seed(1)))
    policy = OneParameter(0.8)
    policy.target = batch.target
    loss, _ = algo.loss(policy, batch)
    loss.backward()
    assert policy.w.grad < 0
    policy = OneParameter(0.8)  # the dispreferred sample alone: its likelihood goes down
    policy.target = batch.target
    batch.advantages = torch.tensor([0.0, -1.0])
    algo.loss(policy, batch)[0].backward()
    assert policy.w.grad > 0


def test_micro_batches_hold_whole_groups_with_shared_noise():
    algo = DGPO(cfg(), ODE())
    assert algo.units_per_chunk(4) == 2
    group_ids = torch.tensor([3, 3, 5, 5, 9, 9])
    units = group_members(group_ids)
    assert units.tolist() == [[0, 1], [2, 3], [4, 5]]
    rollouts = toy_rollouts(6)
    batch = next(algo.micro_batches(rollouts, torch.zeros(6), units[[2, 0]], torch.Generator().manual_seed(0)))
    assert batch.group.tolist() == [0, 1, 0, 1]  # samples 4, 0, 5, 1
    torch.testing.assert_close(batch.x0, rollouts.latents[[4, 0, 5, 1], -1])
    torch.testing.assert_close(batch.noise[0], batch.noise[2])
    torch.testing.assert_close(batch.noise[1], batch.noise[3])
    assert not torch.allclose(batch.noise[0], batch.noise[1])
    independent = DGPO(cfg(use_shared_noise=False), ODE())
    batch = next(independent.micro_batches(rollouts, torch.zeros(6), units[[2, 0]], torch.Generator().manual_seed(0)))
    assert not torch.allclose(batch.noise[0], batch.noise[2])


# ------------------------------------------------------------------------ config
def minimal(**train) -> dict:
    return base_config(train={"trainer_type": "dgpo", "group_size": 2, "num_inference_steps": 10, **train})


def test_flow_factory_defaults():
    from flow_factory.config import parse_config

    train = parse_config(minimal()).train
    assert (train.dpo_beta, train.use_shared_noise, train.clip_dsm, train.clip_kl, train.kl_cfg) == (
        100.0, True, True, False, 1.0)
    assert (train.timestep_range, train.time_shift, train.time_sampling_strategy) == (0.6, 3.0, "discrete")
    assert (train.kl_type if "kl_type" in train.model_fields_set else "v-based") == "v-based"
    assert train.global_std and train.advantage_aggregation == "gdpo"
    cfg = parse_config(minimal(num_train_timesteps=0))
    assert cfg.trained_steps_per_sample == 6  # 10 steps x 0.6


@pytest.mark.parametrize("train,message", [
    ({"kl_cfg": 4.5}, "CFG on the frozen reference"),
    ({"use_ema_ref": True}, "fast old-policy EMA"),
    ({"switch_ema_ref": 200, "max_epochs": 300}, "this run takes 300"),
    ({"per_device_batch_size": 2, "group_size": 4}, "whole groups"),
    ({"ema_ref_max_decay": 0.3}, "fast old-policy EMA"),
    ({"trainer_type": "nft", "dpo_beta": 10.0}, "dgpo's"),
])
def test_what_is_not_here_is_refused_with_its_reason(train, message):
    from flow_factory.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=message):
        parse_config(minimal(**train))


def test_kl_cfg_one_and_an_unreached_switch_load():
    from flow_factory.config import parse_config

    train = parse_config(minimal(kl_cfg=1.0, switch_ema_ref=200, max_epochs=100)).train
    assert train.kl_cfg == 1.0 and train.switch_ema_ref == 200


def test_the_epoch_arithmetic_counts_the_micro_batches_dgpo_makes():
    from flow_factory.config import parse_config

    cfg = parse_config(minimal(num_train_timesteps=3, time_sampling_strategy="uniform"))
    algo = DGPO(cfg.train, ODE())
    n = cfg.samples_per_epoch
    units = algo.training_units(torch.arange(n) // cfg.train.group_size, torch.zeros(n))
    chunk = algo.units_per_chunk(cfg.train.per_device_batch_size)
    micro = sum(len(list(algo.micro_batches(toy_rollouts(n), torch.zeros(n), units[i:i + chunk],
                                            torch.Generator().manual_seed(i))))
                for i in range(0, len(units), chunk))
    assert micro == cfg.micro_steps_per_epoch == 6


def test_dgpo_keys_are_refused_for_a_coupled_trainer_too():
    from flow_factory.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="clip_dsm are dgpo's; grpo does not use them"):
        parse_config(minimal(trainer_type="grpo", clip_dsm=False))
