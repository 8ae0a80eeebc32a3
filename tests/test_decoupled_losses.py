"""NFT, AWM and DPO losses against hand-computed values; gradient signs on one parameter;
the decoupled micro-batches (pairs share noise and sigma, x0 is the rollout's last latent)."""

import math

import pytest
import torch

from flow_factory.algorithms import AWM, DPO, NFT, NoisedBatch, awm_log_prob, best_and_worst, dpo_loss, nft_loss
from flow_factory.config.train import TrainConfig
from flow_factory.dynamics import ODE

from helpers_algorithms import rollouts_of

X0 = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
NOISE = torch.tensor([[0.0, 1.0], [1.0, 0.0]])  # targets eps - x0: [-1, 1] and [1, -2]
SIGMA = torch.tensor([0.5, 0.25])
V = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
V_OLD = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
ADV = torch.tensor([1.0, -3.0])  # with adv_clip_range 2: r = 0.75 and 0 (clipped to -2)
BATCH = NoisedBatch(X0, NOISE, SIGMA, ADV, {})


def cfg(**kw):
    base = dict(nft_beta=0.5, nft_weighting="adaptive", adv_clip_range=2.0, kl_beta=0.0, outside_kl_beta=0.0,
                clip_range=0.2, awm_weighting="Uniform", ghuber_power=0.25, ema_kl_beta=0.0, beta=2.0,
                num_train_timesteps=1, time_sampling_strategy="uniform", time_shift=1.0, timestep_range=1.0,
                num_inference_steps=4)
    base.update(kw)
    return TrainConfig(**base)


# ------------------------------------------------------------------------ NFT
@pytest.mark.parametrize("weighting,expected", [
    # sample 1 (r = .75, sigma .5): v+ = [.5, .5], v- = [1.5, 1.5]; sample 2 (r = 0, sigma .25): v- = [-.5, -.5]
    # uniform: L+ = 1.25, L- = 3.25 -> 2 (.75 1.25 + .25 3.25) / .5 = 7; L- = 2.25 -> 2 2.25 / .5 = 9
    ("uniform", (7.0 + 9.0) / 2),
    # adaptive: x0_u - x0 = sigma (target - u); s1: pos [-.75, .25] -> .3125 / .5 = .625,
    # neg [-1.25, -.25] -> .8125 / .75; s2 neg [.375, -.375] -> .140625 / .375 = .375
    ("adaptive", (4 * (0.75 * 0.625 + 0.25 * 0.8125 / 0.75) + 4 * 0.375) / 2),
])
def test_nft_loss_equals_hand_computed_value(weighting, expected):
    loss, metrics = nft_loss(V, V_OLD, BATCH, beta=0.5, adv_clip_range=2.0, weighting=weighting)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["r_mean"].item() == pytest.approx(0.375)


@pytest.mark.parametrize("weighting", ["uniform", "adaptive"])
def test_nft_gradient_pulls_good_samples_to_the_target_and_pushes_bad_ones_away(weighting):
    """v = theta, v_old = 0, target eps - x0 = 1: a good sample (r = 1) raises theta, a bad one lowers it."""
    x0, noise, sigma = torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([0.6])
    grads = {}
    for adv in (2.0, -2.0):
        theta = torch.zeros((), requires_grad=True)
        batch = NoisedBatch(x0, noise, sigma, torch.tensor([adv]), {})
        loss, _ = nft_loss(theta.expand(1, 3), torch.zeros(1, 3), batch, 1.0, 2.0, weighting)
        loss.backward()
        grads[adv] = theta.grad.item()
    assert grads[2.0] < 0 < grads[-2.0]


def test_nft_unknown_weighting_is_named():
    with pytest.raises(ValueError, match=r"train.nft_weighting: unknown 'l1'"):
        nft_loss(V, V_OLD, BATCH, 0.5, 2.0, "l1")


# ------------------------------------------------------------------------ AWM
TARGET = torch.tensor([[1.0, 1.0], [1.0, 3.0]])  # with V: errors e = [1, 2]
EPS4 = 1e-10 ** 0.25


@pytest.mark.parametrize("weighting,expected", [
    ("Uniform", [-1.0, -2.0]),
    ("t", [-0.5, -0.5]),
    ("t**2", [-0.25, -0.125]),
    ("huber", [-(1.0 - 1e-5) * 0.5, -(math.sqrt(2.0) - 1e-5) * 0.25]),
    ("ghuber", [-(1.0 - EPS4) * 0.5 / 0.25, -(2 ** 0.25 - EPS4) * 0.25 / 0.25]),
])
def test_awm_log_prob_each_weighting(weighting, expected):
    out = awm_log_prob(V, TARGET, SIGMA, weighting, 0.25)
    torch.testing.assert_close(out, torch.tensor(expected), rtol=1e-6, atol=1e-7)


class ScalarPolicy:
    """Velocity theta * ones (current, with grad); fixed sampling / reference / EMA velocities."""

    def __init__(self, theta, old, ref=None, ema=None):
        self.theta, self.old, self.ref, self.ema = theta, old, ref, ema

    def velocity(self, x, sigma, cond):
        return self.theta.reshape(-1, *([1] * (x.ndim - 1))).expand_as(x)

    def sampling_velocity(self, x, sigma, cond):
        return self.old.reshape(-1, *([1] * (x.ndim - 1))).expand_as(x)

    def reference_velocity(self, x, sigma, cond):
        return self.ref.reshape(-1, *([1] * (x.ndim - 1))).expand_as(x)

    def ema_velocity(self, x, sigma, cond):
        return self.ema.reshape(-1, *([1] * (x.ndim - 1))).expand_as(x)


def zero_target_batch(adv):
    z = torch.zeros(len(adv), 1)
    return NoisedBatch(x0=z, noise=z.clone(), sigma=torch.full((len(adv),), 0.5), advantages=torch.tensor(adv), cond={})


@pytest.mark.parametrize("clip_range,expected,clip_frac", [
    # log-ratios +0.5 (A = 1) and -0.5 (A = -1): r = e^.5 and e^-.5
    (0.2, (-1.2 + 0.8) / 2, 1.0),  # both clipped: -1 clip(1.65) = -1.2, max(.607, .8) = .8
    (1.0, (-math.exp(0.5) + math.exp(-0.5)) / 2, 0.0),  # clip range wide: nothing clipped
])
def test_awm_loss_with_and_without_active_clipping(clip_range, expected, clip_frac):
    # target 0, Uniform weighting: logp = -v^2. Sample 1: v = sqrt(.5), v_old = 1 -> +.5; sample 2: v_old = 0 -> -.5
    theta = torch.full((2,), math.sqrt(0.5), requires_grad=True)
    policy = ScalarPolicy(theta, torch.tensor([1.0, 0.0]))
    loss, metrics = AWM(cfg(clip_range=clip_range, adv_clip_range=5.0), ODE()).loss(policy, zero_target_batch([1.0, -1.0]))
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["clip_frac"].item() == clip_frac
    loss.backward()
    if clip_frac == 1.0:
        assert theta.grad.abs().max().item() == 0  # clipped terms give no gradient
    else:
        # d/dtheta of -A exp(logp - logp_old) / 2 with logp = -theta^2: A theta r
        r = torch.tensor([math.exp(0.5), math.exp(-0.5)])
        torch.testing.assert_close(theta.grad, torch.tensor([1.0, -1.0]) * theta.detach() * r, rtol=1e-5, atol=0)


def test_awm_gradient_sign_and_kl_terms():
    grads = {}
    for adv in (1.0, -1.0):
        theta = torch.tensor([0.5], requires_grad=True)
        AWM(cfg(), ODE()).loss(ScalarPolicy(theta, torch.tensor([0.5])), zero_target_batch([adv]))[0].backward()
        grads[adv] = theta.grad.item()
    assert grads[1.0] > 0 > grads[-1.0]  # a good sample pulls v toward the target 0, a bad one away
    theta = torch.tensor([0.5], requires_grad=True)
    policy = ScalarPolicy(theta, torch.tensor([0.5]), ref=torch.tensor([0.1]), ema=torch.tensor([0.3]))
    loss, metrics = AWM(cfg(kl_beta=2.0, ema_kl_beta=3.0), ODE()).loss(policy, zero_target_batch([0.0]))
    assert metrics["kl"].item() == pytest.approx(0.16) and metrics["ema_kl"].item() == pytest.approx(0.04)
    assert loss.item() == pytest.approx(2.0 * 0.16 + 3.0 * 0.04)


# ------------------------------------------------------------------------ DPO
def test_dpo_loss_equals_hand_computed_value():
    # winner error .25, loser 1, reference 1 and 1: inside = -beta / 2 (-.75 - 0) = .75 with beta = 2
    v, v_ref, target = torch.tensor([[0.5], [1.0]]), torch.tensor([[1.0], [1.0]]), torch.zeros(2, 1)
    loss, metrics = dpo_loss(v, v_ref, target, beta=2.0)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.75)), rel=1e-6)
    assert metrics["implicit_accuracy"].item() == 1.0
    loss, _ = dpo_loss(v, v_ref, target, 2.0, pair_weight=torch.tensor([False]))
    assert loss.item() == 0.0  # a tied pair prefers nothing


def test_dpo_gradient_fits_the_winner_and_unfits_the_loser():
    target, v_ref = torch.zeros(2, 1), torch.full((2, 1), 0.5)
    theta = torch.tensor(0.5, requires_grad=True)
    dpo_loss(torch.stack([theta, torch.tensor(0.5)]).reshape(2, 1), v_ref, target, 2.0)[0].backward()
    assert theta.grad.item() > 0  # winner: its error must fall, theta -> 0
    theta = torch.tensor(0.5, requires_grad=True)
    dpo_loss(torch.stack([torch.tensor(0.5), theta]).reshape(2, 1), v_ref, target, 2.0)[0].backward()
    assert theta.grad.item() < 0  # loser: its error must rise


def test_dpo_pairs_best_and_worst_per_group_with_shared_noise_and_sigma():
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = torch.tensor([0.1, 0.9, -1.0, 2.0, -2.0, 0.0])
    units = best_and_worst(group_ids, adv)
    assert units.tolist() == [[1, 2], [3, 4]]
    latents = torch.arange(6 * 3 * 2, dtype=torch.float32).reshape(6, 3, 2)  # (N, T + 1, 2)
    rollouts = rollouts_of(latents, torch.tensor([1.0, 0.5, 0.0]), {"c": torch.arange(6.0).unsqueeze(1)})
    algo = DPO(cfg(num_train_timesteps=3), ODE())
    batches = list(algo.micro_batches(rollouts, adv, units, torch.Generator().manual_seed(0)))
    assert len(batches) == 3
    for b in batches:
        torch.testing.assert_close(b.x0, latents[[1, 3, 2, 4], -1])  # winners, then losers; x0 = last latent
        torch.testing.assert_close(b.noise[:2], b.noise[2:])
        assert b.sigma.unique().numel() == 1
        assert b.cond["c"].flatten().tolist() == [1.0, 3.0, 2.0, 4.0]
    assert not torch.equal(batches[0].noise, batches[1].noise)  # fresh noise per training timestep


def test_nft_micro_batches_draw_fresh_noise_per_sample_and_follow_the_generator():
    rollouts = rollouts_of(torch.randn(4, 3, 2), torch.tensor([1.0, 0.5, 0.0]), {})
    algo = NFT(cfg(num_train_timesteps=2), ODE())
    units = torch.arange(4).unsqueeze(1)
    a = list(algo.micro_batches(rollouts, torch.zeros(4), units, torch.Generator().manual_seed(5)))
    b = list(algo.micro_batches(rollouts, torch.zeros(4), units, torch.Generator().manual_seed(5)))
    assert len(a) == 2 and not torch.equal(a[0].noise[0], a[0].noise[1])
    for x, y in zip(a, b):
        assert torch.equal(x.noise, y.noise) and torch.equal(x.sigma, y.sigma)
    torch.testing.assert_close(a[0].x_t, (1 - a[0].sigma[:, None]) * a[0].x0 + a[0].sigma[:, None] * a[0].noise)
