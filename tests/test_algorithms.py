"""GRPO and GRPO-Guard losses, checked against hand-computed numbers.

The policies here have a one-parameter velocity ``v = theta * x`` so every gradient
can be written out by hand, and the dynamics in the GRPO tests is a small Gaussian
Euler step defined below (mean ``x + v dt``, scale ``a sqrt(-dt)``), independent of
the dynamics package's own SDEs.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from helpers_algorithms import batch_at_step

from flow_factory.algorithms import (
    ALGORITHMS, GRPO, GRPOGuard, clipped_surrogate, make_algorithm, normalized_log_ratio,
    v_based_kl, x_based_kl,
)
from flow_factory.config.train import TrainConfig
from flow_factory.dynamics import CPS, ODE, DanceSDE, FlowSDE
from flow_factory.dynamics.base import Dynamics, step_inputs
from flow_factory.dynamics.dpm_solver import DPMSolver2M
from flow_factory.trajectory import TrajectoryOptions, sample_trajectory
from flow_factory.sampling import Rollouts


def train_cfg(**overrides) -> TrainConfig:
    """The real train section (its defaults: clip_range 1e-4, adv_clip_range 5, no KL), v-based KL."""
    return TrainConfig(**{"kl_type": "v-based", **overrides})


class EulerGaussian(Dynamics):
    """x' = x + v dt + a sqrt(-dt) eps: the simplest Gaussian step, for hand gradients."""

    name = "euler-gaussian"

    def mean_and_std(self, x, v, sigma, sigma_next):
        x, v, sigma, sigma_next = step_inputs(x, v, sigma, sigma_next)  # (B,) sigmas as columns
        dt = sigma_next - sigma
        return x + v * dt, self.noise_level * torch.sqrt(-dt)


class LinearPolicy(torch.nn.Module):
    """v = theta * x, reference v = theta_ref * x.

    theta_ref requires grad on purpose: the algorithm, not the policy, must keep
    gradients out of the reference.
    """

    def __init__(self, theta: float, theta_ref: float):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.tensor(theta))
        self.theta_ref = torch.nn.Parameter(torch.tensor(theta_ref))

    def velocity(self, latents, sigma, cond):
        return self.theta * latents

    def reference_velocity(self, latents, sigma, cond):
        return self.theta_ref * latents

    # the adapter surface sample_trajectory calls
    def velocity_for_rollout(self, latents, sigma, cond, guidance_scale):
        return self.velocity(latents, sigma, cond)


def rollout(policy, dynamics, n, sigmas, seed=0, shape=(2, 3, 3)):
    """A trajectory of the project's own rollout loop."""
    adapter = SimpleNamespace(velocity=policy.velocity_for_rollout)
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(n, *shape, generator=g)
    return sample_trajectory(adapter, dynamics, {}, noise, sigmas, 1.0, generator=g)


def rollout_batch(policy, dynamics, advantages, sigmas, step, seed=0, shape=(2, 3, 3)):
    """A TrainBatch from the project's own rollout loop, as the trainer builds it."""
    traj = rollout(policy, dynamics, len(advantages), sigmas, seed, shape)
    return batch_at_step(traj.latents, traj.log_probs, advantages, traj.sigmas, {}, step)


def guard_rollout(dynamics, v_fn, advantages, sigmas, seed=0, shape=(2, 3, 3)):
    """Rollout that also records each step's mean and noise (what GRPO-Guard needs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(advantages), *shape, generator=g)
    latents, log_probs, means, noises = [x], [], [], []
    for i in range(len(sigmas) - 1):
        eps = torch.randn(x.shape, generator=g)
        out = dynamics.step(x, v_fn(x), sigmas[i], sigmas[i + 1], noise=eps)
        x = out.sample
        latents.append(x), log_probs.append(out.log_prob), means.append(out.mean), noises.append(eps)
    trajectory = dict(latents=torch.stack(latents, 1), old_log_probs=torch.stack(log_probs, 1),
                      advantages=advantages, sigmas=sigmas, cond={}, old_means=torch.stack(means, 1))
    return trajectory, torch.stack(noises, 1)


SIGMAS = torch.tensor([1.0, 0.8, 0.5, 0.2, 0.0])


# ----------------------------------------------------------------- clipped loss
def test_clipped_surrogate_matches_hand_computed_values():
    # clip_range 0.2 -> ratios clipped to [0.8, 1.2]; advantages clipped to [-2, 2]
    #   r = 1.1, A =  1.0 (inside):             max(-1.1,       -1.1)       = -1.1
    #   r = 1.5, A =  3.0 -> 2.0 (adv clipped): max(-2*1.5=-3.0, -2*1.2=-2.4) = -2.4  clipped
    #   r = 0.5, A = -1.0:                      max( 0.5,        0.8)        =  0.8  clipped
    #   r = 0.7, A =  0.5 (below, but A > 0):   max(-0.35,      -0.4)        = -0.35
    # loss = (-1.1 - 2.4 + 0.8 - 0.35) / 4 = -3.05 / 4 = -0.7625
    ratios = [1.1, 1.5, 0.5, 0.7]
    old = torch.tensor([-1.0, -2.0, 0.5, 0.0])
    logp = (old + torch.log(torch.tensor(ratios))).requires_grad_()
    adv = torch.tensor([1.0, 3.0, -1.0, 0.5])
    loss, m = clipped_surrogate(logp - old, adv, clip_range=0.2, adv_clip_range=2.0)
    assert loss.item() == pytest.approx(-0.7625, abs=1e-6)
    assert m["ratio_mean"].item() == pytest.approx(0.95, abs=1e-6)  # 3.8 / 4
    assert m["ratio_min"].item() == pytest.approx(0.5, abs=1e-6)
    assert m["ratio_max"].item() == pytest.approx(1.5, abs=1e-6)
    assert m["clip_frac"].item() == pytest.approx(0.5)  # samples 2 and 3
    assert all(t.ndim == 0 and not t.requires_grad for t in m.values())

    # d loss / d logp_b = -A_b r_b / 4 where the unclipped term is active, else 0:
    # (-1 * 1.1 / 4, 0, 0, -0.5 * 0.7 / 4)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-0.275, 0.0, 0.0, -0.0875]))


def test_clipped_surrogate_rejects_misshaped_advantages():
    with pytest.raises(ValueError, match="does not match"):
        clipped_surrogate(torch.zeros(4), torch.zeros(4, 1), 0.2, 2.0)


# --------------------------------------------------------------------------- KL
def test_x_based_kl_literal_values():
    mean = torch.tensor([[1.0, 2.0], [0.5, 0.5]])
    mean_ref = torch.tensor([[0.0, 1.0], [0.5, -0.5]])
    # diff^2 = [[1, 1], [0, 1]]; / (2 * 0.5^2) = [[2, 2], [0, 2]]; per-sample mean [2, 1]
    torch.testing.assert_close(x_based_kl(mean, mean_ref, 0.5), torch.tensor([2.0, 1.0]))
    # per-sample std column [0.5, 1.0]: sample 2 is [0, 1] / 2 -> mean 0.25
    std = torch.tensor([[0.5], [1.0]])
    torch.testing.assert_close(x_based_kl(mean, mean_ref, std), torch.tensor([2.0, 0.25]))


def test_v_based_kl_literal_values():
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    v_ref = torch.tensor([[1.0, 0.0], [0.0, 4.0]])
    # diff^2 = [[0, 4], [9, 0]] -> per-sample mean [2, 4.5]
    torch.testing.assert_close(v_based_kl(v, v_ref), torch.tensor([2.0, 4.5]))


# ------------------------------------------------------------------------- GRPO
def hand_dlogp_dtheta(batch, theta, a):
    """d logp_b / d theta for EulerGaussian with v = theta x: mean_j((x' - mu) x dt / s^2)."""
    x, x_next = batch.x, batch.x_next
    dt = float(batch.sigma_next[0] - batch.sigma[0])
    s2 = a**2 * (-dt)
    mu = x + theta * x * dt
    return ((x_next - mu) * x * dt / s2).reshape(len(x), -1).mean(1)


@pytest.mark.parametrize("step", [0, 2])
def test_grpo_on_policy_ratio_is_one_and_gradient_follows_advantage(step):
    a, theta = 0.7, 0.3
    policy = LinearPolicy(theta, theta_ref=theta)
    dyn = EulerGaussian(a)
    adv = torch.tensor([1.5, -0.5, 0.0])
    batch = rollout_batch(policy, dyn, adv, SIGMAS, step)
    loss, m = GRPO(train_cfg(), dyn).loss(policy, batch)
    for k in ("ratio_mean", "ratio_min", "ratio_max"):
        assert abs(m[k].item() - 1.0) <= 1e-6
    assert m["clip_frac"].item() == 0.0
    assert m["policy_loss"].item() == pytest.approx(-adv.mean().item(), abs=1e-6)  # mean(-A * 1)
    assert m["advantage_max"].item() == 1.5 and m["advantage_min"].item() == -0.5

    loss.backward()
    # on-policy, inside the clip: dL/dtheta = -(1/B) sum_b A_b dlogp_b/dtheta
    expected = -(adv * hand_dlogp_dtheta(batch, theta, a)).mean()
    assert policy.theta.grad.item() == pytest.approx(expected.item(), rel=1e-4)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_grpo_descent_step_raises_logprob_of_positive_advantage(advantage):
    a, theta = 0.7, 0.3
    policy = LinearPolicy(theta, theta_ref=theta)
    dyn = EulerGaussian(a)
    batch = rollout_batch(policy, dyn, torch.tensor([advantage]), SIGMAS, step=1)
    loss, _ = GRPO(train_cfg(), dyn).loss(policy, batch)
    loss.backward()
    before = hand_dlogp_dtheta(batch, theta, a)  # direction that raises this sample's log-prob
    assert torch.sign(-policy.theta.grad) == torch.sign(before) * math.copysign(1, advantage)

    with torch.no_grad():
        policy.theta -= 1e-3 * policy.theta.grad
        x = batch.x
        mean, std = dyn.mean_and_std(x, policy.velocity(x, None, {}), SIGMAS[1], SIGMAS[2])
        new_logp = dyn.log_prob(batch.x_next, mean, std)
    old_logp = batch.old_log_prob
    assert (new_logp > old_logp).item() == (advantage > 0)


def test_grpo_v_based_kl_adds_to_loss_and_keeps_reference_frozen():
    a, theta, theta_ref, beta = 0.7, 0.3, 0.1, 0.5
    policy = LinearPolicy(theta, theta_ref)
    dyn = EulerGaussian(a)
    adv = torch.tensor([1.0, -1.0])
    batch = rollout_batch(policy, dyn, adv, SIGMAS, step=1)
    loss, m = GRPO(train_cfg(kl_type="v-based", kl_beta=beta), dyn).loss(policy, batch)
    x = batch.x
    # v - v_ref = (theta - theta_ref) x -> KL = mean(0.2^2 x^2) = 0.04 mean(x^2)
    expected_kl = (0.04 * x**2).mean()
    assert m["kl"].item() == pytest.approx(expected_kl.item(), rel=1e-5)
    assert loss.item() == pytest.approx(m["policy_loss"].item() + beta * expected_kl.item(), rel=1e-5)

    loss.backward()
    assert policy.theta_ref.grad is None
    # dKL/dtheta = mean(2 (theta - theta_ref) x^2); the policy part as in the on-policy test
    expected = -(adv * hand_dlogp_dtheta(batch, theta, a)).mean() + beta * (2 * 0.2 * x**2).mean()
    assert policy.theta.grad.item() == pytest.approx(expected.item(), rel=1e-4)


class SigmaLinearPolicy(LinearPolicy):
    """v = theta * sigma * x: the velocity depends on the step, so a wrong sigma shows."""

    def velocity(self, latents, sigma, cond):
        return self.theta * torch.as_tensor(sigma).reshape(-1, 1, 1, 1) * latents

    def reference_velocity(self, latents, sigma, cond):
        return self.theta_ref * torch.as_tensor(sigma).reshape(-1, 1, 1, 1) * latents


def test_outside_kl_is_the_v_based_kl_at_each_samples_untrained_step():
    theta, theta_ref, beta = 0.3, 0.1, 0.5
    policy = SigmaLinearPolicy(theta, theta_ref)
    dyn = EulerGaussian(0.7)
    adv = torch.tensor([1.0, -1.0])
    traj = rollout(policy, dyn, len(adv), SIGMAS)
    batch = batch_at_step(traj.latents, traj.log_probs, adv, traj.sigmas, {}, 1)
    plain, _ = GRPO(train_cfg(), dyn).loss(policy, batch)
    # sample 0 at step 0 (sigma 1.0), sample 1 at step 3 (sigma 0.2); v - v_ref = 0.2 sigma x
    batch.outside_x, batch.outside_sigma = traj.latents[[0, 1], [0, 3]], torch.tensor([1.0, 0.2])
    loss, m = GRPO(train_cfg(outside_kl_beta=beta), dyn).loss(policy, batch)
    per_sample = [((0.2 * s * traj.latents[b, k]) ** 2).mean() for b, (k, s) in enumerate([(0, 1.0), (3, 0.2)])]
    expected = torch.stack(per_sample).mean()
    assert m["outside_kl"].item() == pytest.approx(expected.item(), rel=1e-5)
    assert loss.item() == pytest.approx(plain.item() + beta * expected.item(), rel=1e-5)
    loss.backward()
    assert policy.theta_ref.grad is None


def test_micro_batches_draw_outside_steps_from_the_untrained_steps_only():
    state = torch.arange(5.0).view(1, 5, 1, 1, 1).expand(64, 5, 1, 2, 2)  # each state holds its index
    rollouts = Rollouts(prompts=[""] * 64, group_ids=torch.arange(64), latents=state, log_probs=torch.zeros(64, 4),
                        sigmas=SIGMAS, sde_steps=[1], cond={}, media=torch.empty(0))
    units = torch.arange(64).unsqueeze(1)
    adv = torch.zeros(64)
    with_kl = GRPO(train_cfg(outside_kl_beta=0.1), FlowSDE(0.7))
    (batch,) = with_kl.micro_batches(rollouts, adv, units, torch.Generator().manual_seed(0))
    assert batch.step.tolist() == [1] * 64 and batch.x.unique().tolist() == [1.0]
    assert batch.x_next.unique().tolist() == [2.0]
    assert set(batch.outside_x.flatten().tolist()) == {0, 2, 3}
    torch.testing.assert_close(batch.outside_sigma, SIGMAS[batch.outside_x[:, 0, 0, 0].long()])
    (batch,) = GRPO(train_cfg(), FlowSDE(0.7)).micro_batches(rollouts, adv, units, torch.Generator())
    assert batch.outside_x is None
    rollouts.sde_steps = [0, 1, 2, 3]
    with pytest.raises(ValueError, match="train.outside_kl_beta: every step of this rollout was trained"):
        list(with_kl.micro_batches(rollouts, adv, units, torch.Generator()))


def test_grpo_x_based_kl_is_gaussian_kl_of_the_step():
    a, theta, theta_ref = 0.7, 0.3, 0.1
    policy = LinearPolicy(theta, theta_ref)
    dyn = EulerGaussian(a)
    batch = rollout_batch(policy, dyn, torch.tensor([1.0, -1.0]), SIGMAS, step=2)
    _, m = GRPO(train_cfg(kl_type="x-based", kl_beta=0.1), dyn).loss(policy, batch)
    x = batch.x
    dt = 0.2 - 0.5
    # mu - mu_ref = (theta - theta_ref) x dt; scale^2 = a^2 (-dt)
    expected = ((0.2 * x * dt) ** 2).mean() / (2 * a**2 * (-dt))
    assert m["kl"].item() == pytest.approx(expected.item(), rel=1e-5)


def test_x_based_kl_refuses_a_zero_std_step():
    policy = LinearPolicy(0.3, 0.1)
    dyn = CPS(0.5)  # its last step has std = sigma_next sin(.) = 0
    batch = rollout_batch(policy, dyn, torch.tensor([1.0, -1.0]), SIGMAS, step=3)
    with pytest.raises(ValueError, match="x-based KL divides by the step's std"):
        GRPO(train_cfg(kl_type="x-based", kl_beta=0.1), dyn).loss(policy, batch)


# ------------------------------------------------------------------ GRPO-Guard
def test_normalized_log_ratio_hand_example():
    # s = 0.5, old mean (0, 0), new mean (0.1, 0.2), sample x' = (0.5, 0.25)
    # raw log-ratio = mean(-(x' - mu)^2 + (x' - mu_old)^2) / (2 s^2)
    #               = mean(-0.16 + 0.25, -0.0025 + 0.0625) / 0.5 = 0.075 / 0.5 = 0.15
    # normalised    = s * 0.15 + mean(0.1^2, 0.2^2) / (2 s) = 0.075 + 0.025 = 0.1
    # (= mean(eps d) with eps = (1, 0.5), d = (0.1, 0.2): mean(0.1, 0.1) = 0.1)
    out = normalized_log_ratio(
        log_prob=torch.tensor([-0.85]), old_log_prob=torch.tensor([-1.0]),
        mean=torch.tensor([[0.1, 0.2]]), old_mean=torch.tensor([[0.0, 0.0]]), std=0.5)
    torch.testing.assert_close(out, torch.tensor([0.1]))
    assert math.exp(out.item()) == pytest.approx(1.1051709, abs=1e-6)  # the guarded ratio


def test_normalized_log_ratio_removes_mean_bias_and_equalises_spread():
    g = torch.Generator().manual_seed(0)
    d = torch.tensor([0.02, -0.01, 0.03, 0.0])  # policy drift of the step mean
    msd = (d**2).mean().item()  # 3.5e-4
    m = 20000
    old_mean = torch.randn(m, 4, generator=g)
    gauss = EulerGaussian(1.0)  # only its Gaussian log_prob is used
    norm_stds = []
    for s in (0.05, 0.5):
        x_next = old_mean + s * torch.randn(m, 4, generator=g)
        raw = gauss.log_prob(x_next, old_mean + d, s) - gauss.log_prob(x_next, old_mean, s)
        norm = normalized_log_ratio(gauss.log_prob(x_next, old_mean + d, s),
                                    gauss.log_prob(x_next, old_mean, s), old_mean + d, old_mean, s)
        raw_se = math.sqrt(msd / 4) / s / math.sqrt(m)
        norm_se = math.sqrt(msd / 4) / math.sqrt(m)
        # raw: biased by -mean(d^2) / (2 s^2) (-0.07 at s = 0.05)
        assert abs(raw.mean().item() + msd / (2 * s**2)) < 4 * raw_se
        assert abs(norm.mean().item()) < 4 * norm_se
        norm_stds.append(norm.std().item())
    # spread sqrt(mean(d^2) / N) at both noise scales, a tenfold range of s
    for std in norm_stds:
        assert std == pytest.approx(math.sqrt(msd / 4), rel=0.03)


def test_grpo_guard_on_policy_ratio_one_and_equal_gradient_across_steps():
    a, theta = 0.7, 0.3
    dyn = FlowSDE(a)
    adv = torch.tensor([1.0, -0.5])
    trajectory, noises = guard_rollout(dyn, lambda x: theta * x, adv, SIGMAS)
    algo = GRPOGuard(train_cfg(clip_range=1e-6), dyn)
    n = trajectory["latents"][0, 0].numel()
    for step in (1, 3):  # sigma < 1, where Flow-SDE's dmu/dv is exactly (1 + a^2 / 2) dt
        batch = batch_at_step(**trajectory, step=step)
        v_leaf = (theta * batch.x).detach().requires_grad_()
        policy = SimpleNamespace(velocity=lambda x, sigma, cond: v_leaf)
        loss, m = algo.loss(policy, batch)
        for k in ("ratio_mean", "ratio_min", "ratio_max"):
            assert m[k].item() == 1.0
        # mean(-A * 1) / (sigma - sigma_next) = -0.25 / (sigma - sigma_next)
        dsigma = float(SIGMAS[step] - SIGMAS[step + 1])
        assert loss.item() == pytest.approx(-0.25 / dsigma, rel=1e-6)
        loss.backward()
        # d loss / d v = A eps (1 + a^2 / 2) / (B N): no trace of the step's sigma or dt
        expected = adv.view(-1, 1, 1, 1) * noises[:, step] * (1 + a**2 / 2) / (len(adv) * n)
        torch.testing.assert_close(v_leaf.grad, expected, rtol=1e-4, atol=1e-9)


def test_grpo_guard_needs_recorded_means_and_flow_sde():
    dyn = FlowSDE(0.7)
    policy = LinearPolicy(0.3, 0.3)
    batch = rollout_batch(policy, dyn, torch.tensor([1.0, -1.0]), SIGMAS, step=1)
    assert batch.old_mean is None
    with pytest.raises(ValueError, match="needs the rollout's step means"):
        GRPOGuard(train_cfg(), dyn).loss(policy, batch)
    assert GRPOGuard.records_step_means and not GRPO.records_step_means
    with pytest.raises(ValueError, match="scheduler.dynamics_type: Flow-SDE"):
        GRPOGuard(train_cfg(), DanceSDE(0.7))


# ----------------------------------------------------------------- the registry
def test_make_algorithm_registry_and_config_errors():
    assert set(ALGORITHMS) == {"grpo", "grpo-guard", "dppo", "nft", "awm", "dpo", "dgpo", "crd", "sft", "offline-dpo",
                               "dmd2", "tdm", "tdm-r1", "diffusion-opd"}
    assert type(make_algorithm("grpo-guard", train_cfg(), FlowSDE(0.7))) is GRPOGuard
    assert type(make_algorithm("grpo", train_cfg(), DanceSDE(0.7))) is GRPO
    with pytest.raises(ValueError, match=r"unknown 'ppo'; valid: \['awm', 'crd', 'dgpo', 'diffusion-opd', 'dmd2', 'dpo', 'dppo', 'grpo', 'grpo-guard', 'nft', 'offline-dpo', 'sft', 'tdm', 'tdm-r1'\]"):
        make_algorithm("ppo", train_cfg(), FlowSDE(0.7))
    with pytest.raises(ValueError, match="deterministic"):
        make_algorithm("grpo", train_cfg(), ODE())


@pytest.mark.parametrize("dynamics,sde_steps", [(FlowSDE(0.7), [2]), (FlowSDE(0.7), [0, 3]), (CPS(0.7), [3]),
                                                (ODE(), None), (DPMSolver2M(), None)])
def test_shared_prefix_is_the_same_trajectory_with_fewer_rows(dynamics, sde_steps):
    """Groups sharing noise and prompt (same_latent): the steps before the first stochastic one are
    integrated once per group, and every output matches integrating each row."""
    rows_seen = []

    def velocity(x, sigma, cond, guidance_scale):
        rows_seen.append(len(x))
        return cond["c"][:, None, None] * x + cond["d"] * sigma

    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    c, d = torch.tensor([0.5, -1.0, 2.0])[groups], torch.randn(3, 2, 2)[groups]
    noise = torch.randn(3, 2, 2, generator=torch.Generator().manual_seed(0))[groups]
    adapter = SimpleNamespace(velocity=velocity)
    sigmas = torch.linspace(1.0, 0.0, 6)

    def run(shared):
        rows_seen.clear()
        traj = sample_trajectory(adapter, dynamics, {"c": c, "d": d}, noise, sigmas, 1.0,
                                 generator=torch.Generator().manual_seed(1),
                                 options=TrajectoryOptions(sde_steps, record_means=True, shared_rows=shared))
        return traj, list(rows_seen)

    (alone, rows_alone), (shared, rows_shared) = run(None), run(groups)
    for name in ["latents", "log_probs", "means"]:
        torch.testing.assert_close(getattr(shared, name), getattr(alone, name), rtol=0, atol=1e-6)
    assert shared.sde_steps == alone.sde_steps and rows_alone == [8] * 5
    prefix = min(sde_steps) if sde_steps else 5
    assert rows_shared == [3] * prefix + [8] * (5 - prefix)
