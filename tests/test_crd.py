"""CRD (arXiv:2603.14128): the centered loss against hand-computed values in every centering
mode, the implicit reward, the whole loss with the reward-adaptive KL, the gradient sign on
one parameter, the decay schedules and the config's defaults and refusals (the toy learning
test and ff-train runs with exact resume live with the others)."""

import math

import pytest
import torch
from helpers_algorithms import toy_rollouts
from test_config import minimal as base_config

from flow_factory.algorithms import CRD, crd_policy_loss, decay_at, implicit_reward
from flow_factory.config.train import TrainConfig
from flow_factory.dynamics import ODE

R = torch.tensor([0.2, -0.1, 0.4, 0.0])
Q = torch.tensor([0.9, 0.3, 0.6, 0.2])


def test_uniform_mse_loss_equals_hand_computed_value():
    # means: r 0.125, q 0.5; 2 rc - qc = [-0.25, -0.25, 0.45, 0.05]
    loss = crd_policy_loss(R, Q, R, Q, 2.0, "mse", -1.0)
    assert loss.item() == pytest.approx((0.0625 + 0.0625 + 0.2025 + 0.0025) / 4, rel=1e-6)


def test_hard_two_direction_loss_equals_hand_computed_value():
    # weight_temp 0: the positive side (q > 1/2: samples 0, 2) centers on r 0.3, q 0.75 -> 2 rc - qc =
    # [-0.35, -0.35, 0.35, -0.05]; the negative side (1, 3) on r -0.05, q 0.25 -> [-0.15, -0.15, 0.55, 0.15]
    pos = (0.1225 * 3 + 0.0025) / 4
    neg = (0.0225 * 3 + 0.3025) / 4
    assert crd_policy_loss(R, Q, R, Q, 2.0, "mse", 0.0).item() == pytest.approx((pos + neg) / 2, rel=1e-6)


def test_softmax_two_direction_bce_loss_equals_hand_computed_value():
    beta, temp = 1.5, 0.5
    r, q = R.tolist(), Q.tolist()

    def direction(sign):
        e = [math.exp(sign * x / temp) for x in q]
        p = [x / sum(e) for x in e]
        r_c, q_c = sum(a * b for a, b in zip(p, r)), sum(a * b for a, b in zip(p, q))
        total = 0.0
        for ri, qi in zip(r, q):
            x, y = beta * (ri - r_c), 1 / (1 + math.exp(-(qi - q_c)))
            total += -(y * math.log(1 / (1 + math.exp(-x))) + (1 - y) * math.log(1 - 1 / (1 + math.exp(-x))))
        return total / len(r)

    expected = (direction(1) + direction(-1)) / 2
    assert crd_policy_loss(R, Q, R, Q, beta, "bce", temp).item() == pytest.approx(expected, rel=1e-5)


def test_implicit_reward_equals_hand_computed_value():
    target = torch.tensor([[1.0, -1.0], [2.0, 0.0]])
    v = torch.tensor([[1.5, -1.0], [2.0, 1.0]])  # errors: [0.5, 0], [0, 1]
    v_old = torch.tensor([[1.0, -2.0], [1.0, 0.0]])  # errors: [0, 1], [1, 0]
    # plain: -(mean e^2 - mean e_old^2) = -(0.125 - 0.5), -(0.5 - 0.5)
    torch.testing.assert_close(implicit_reward(v, v_old, target, False), torch.tensor([0.375, 0.0]))
    # adaptive: divided by mean |e|: sample 0 -(0.125 / 0.25 - 0.5 / 0.5), sample 1 -(0.5 / 0.5 - 0.5 / 0.5)
    torch.testing.assert_close(implicit_reward(v, v_old, target, True), torch.tensor([0.5, 0.0]))


class OneParameter:
    """Sample 0's velocity is ``w u``, every other sample's is the old model's ``0.8 u``."""

    def __init__(self, w, target):
        self.w = torch.tensor(w, requires_grad=True)
        self.target = target
        self.first = torch.zeros(len(target), *([1] * (target.ndim - 1)))
        self.first[0] = 1

    def velocity(self, x_t, sigma, cond):
        return self.target * (self.first * self.w + (1 - self.first) * 0.8)

    def snapshot_velocity(self, name, x_t, sigma, cond):
        assert name == CRD.OLD
        return 0.8 * self.target

    def reference_velocity(self, x_t, sigma, cond, guidance_scale=None):
        # the reference's conditional branch is 0.5 u, its unconditional one 0.2 u: CFG at g gives 0.2 + g 0.3
        return (0.5 if guidance_scale is None else 0.2 + guidance_scale * 0.3) * self.target


def cfg(**kw):
    base = dict(trainer_type="crd", group_size=2, per_device_batch_size=2, num_train_timesteps=1,
                time_sampling_strategy="uniform", time_shift=1.0, timestep_range=1.0, num_inference_steps=4)
    base.update(kw)
    return TrainConfig(**base)


def first_batch(algo, advantages):
    units = algo.training_units(torch.zeros(len(advantages)), advantages)
    return next(algo.micro_batches(toy_rollouts(len(advantages)), advantages, units, torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("loss_type", ["mse", "bce"])
def test_the_better_samples_implicit_reward_goes_up(loss_type):
    """At w = 0.8 both implicit rewards are 0; sample 0 has the higher advantage, so the loss
    raises its implicit reward: its error (w - 1)^2 |u|^2 falls as w moves toward 1 (gradient < 0)."""
    algo = CRD(cfg(crd_loss_type=loss_type, kl_beta=0.0), ODE())
    for advantage, sign in ((1.0, -1), (-1.0, 1)):
        batch = first_batch(algo, torch.tensor([advantage, 0.0]))
        policy = OneParameter(0.8, batch.target)
        algo.loss(policy, batch)[0].backward()
        assert torch.sign(policy.w.grad) == sign, (advantage, policy.w.grad)


@pytest.mark.parametrize("kl_cfg,w_ref", [(1.0, 0.5), (3.0, 0.2 + 3.0 * 0.3)])
def test_the_whole_loss_with_the_reward_adaptive_kl(kl_cfg, w_ref):
    """c L / beta + kl_beta mean((m + q (1 - m)) |v - v_ref|^2), computed here from the formulas; with
    kl_cfg 3 the KL's reference is the frozen model with CFG at 3."""
    c, beta, kl_beta = 5.0, 2.0, 0.1
    algo = CRD(cfg(crd_beta=beta, kl_beta=kl_beta, adaptive_logp=False, adv_clip_range=c, kl_cfg=kl_cfg), ODE())
    adv = torch.tensor([2.5, -5.0])
    batch = first_batch(algo, adv)
    policy = OneParameter(0.6, batch.target)
    loss, metrics = algo.loss(policy, batch)
    u = batch.target.flatten(1)
    r = torch.stack([-(((0.6 - 1) ** 2 - (0.8 - 1) ** 2) * u[0] ** 2).mean(), torch.tensor(0.0)])
    q = torch.tensor([2.5 / 5 / 2 + 0.5, 0.0])  # 0.75, 0 (clipped at -c)
    rc, qc = r - r.mean(), q - q.mean()
    policy_loss = c * ((beta * rc - qc) ** 2).mean() / beta
    kl = torch.stack([((0.6 - w_ref) * u[0]).pow(2).mean(), ((0.8 - w_ref) * u[1]).pow(2).mean()])
    m = 1e-4 / kl_beta
    expected = policy_loss + kl_beta * ((m + q * (1 - m)) * kl).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["policy_loss"].item() == pytest.approx(policy_loss.item(), rel=1e-5)


def test_the_old_model_is_the_reference_without_use_old_for_loss():
    algo = CRD(cfg(use_old_for_loss=False, kl_beta=0.0), ODE())
    assert algo.needs_reference and set(algo.weight_snapshots) == {CRD.SAMPLING}
    assert algo.rollout_snapshot == CRD.SAMPLING
    with_old = CRD(cfg(kl_beta=0.0), ODE())
    assert not with_old.needs_reference and set(with_old.weight_snapshots) == {CRD.OLD, CRD.SAMPLING}


def test_decay_schedules():
    assert [decay_at("0-0.25-0.005-0.999", s) for s in (0, 10, 1000)] == pytest.approx([0.25, 0.3, 0.999])
    assert [decay_at("75-0.0-0.0075-0.999", s) for s in (0, 74, 75, 80)] == pytest.approx([0, 0, 0, 0.0375])
    assert decay_at("medium", 80) == decay_at(2, 80) == decay_at("75-0.0-0.0075-0.999", 80)
    assert decay_at("offline", 3) == 1.0 and decay_at("none", 3) == 0.0


# ------------------------------------------------------------------------ config
def minimal(**train) -> dict:
    return base_config(train={"trainer_type": "crd", "group_size": 2, "num_inference_steps": 10, **train})


def test_flow_factory_defaults():
    from flow_factory.config import parse_config

    cfg = parse_config(minimal())
    train = cfg.train
    assert (train.crd_beta, train.crd_loss_type, train.use_old_for_loss, train.adaptive_logp, train.weight_temp) == (
        1.0, "mse", True, True, -1.0)
    assert (train.old_model_decay, train.sampling_model_decay) == ("0-0.25-0.005-0.999", "75-0.0-0.0075-0.999")
    assert (train.kl_beta, train.reward_adaptive_kl, train.kl_cfg) == (0.1, True, 4.5)
    assert (train.timestep_range, train.time_shift, train.time_sampling_strategy) == (0.99, 3.0, "discrete")
    assert train.global_std and train.advantage_aggregation == "gdpo"
    assert cfg.trained_steps_per_sample == 9  # 10 steps x 0.99
    assert parse_config(minimal(kl_beta=0.0, sampling_model_decay=2)).train.sampling_model_decay == "2"


@pytest.mark.parametrize("train,message", [
    ({"old_model_decay": "0-0.25-0.005"}, "start_step-start_value-slope-end_value"),
    ({"sampling_model_decay": "0-1.5-0-1"}, r"values in \[0, 1\]"),
    ({"off_policy": True}, "its own sampling model"),
    ({"trainer_type": "nft", "crd_beta": 2.0}, "crd's; nft does not use them"),
    ({"trainer_type": "dgpo", "weight_temp": 0.5}, "crd's; dgpo does not use them"),
])
def test_what_is_not_here_is_refused_with_its_reason(train, message):
    from flow_factory.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=message):
        parse_config(minimal(**train))
