"""The few-step distillation losses (issue 39; flow_factory.algorithms.distillation) against hand-computed
values on small tensors, and the direction of their gradients on one-parameter examples: the generator
moves towards the teacher's distribution, the fake score towards the generator's, the surrogate towards
the preferred samples. Conventions: x_t = (1 - sigma) x0 + sigma eps, v = eps - x0."""

import math

import pytest
import torch

from flow_factory.algorithms.distillation import (
    add_noise, cfg_reward_correction, clean_from_velocity, conditional_renoise, denoising_errors,
    distribution_matching_direction, dmd2_generator_loss, fake_score_loss, guided_velocity, noise_from_velocity,
    query_interval, revised_x0_loss, runaway_mask, sample_boundary_index, sample_perturbation_sigma,
    sample_query_sigma, slow_surrogate_decay, snr_weight, TDMR1Settings, student_prediction, surrogate_loss, surrogate_masks,
    tdm_fake_loss, tdm_generator_loss, tdm_r1_generator_loss, time_weight, velocity_target)
from flow_factory.config.distillation import DISTILLATION_SPECS, distillation_problems, resolved

T = torch.tensor


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                               atol=tol, rtol=tol)


# ---- the flow conversions -------------------------------------------------------------------------------

def test_a_velocity_names_the_clean_state_and_the_noise_it_was_built_from():
    x0, eps, sigma = T([[1.0, -2.0], [0.5, 3.0]]), T([[0.3, 0.1], [-1.0, 2.0]]), T([0.25, 0.8])
    x_t = add_noise(x0, eps, sigma)
    close(x_t, T([[0.75 + 0.075, -1.5 + 0.025], [0.1 - 0.8, 0.6 + 1.6]]))
    v = velocity_target(x0, eps)
    close(clean_from_velocity(x_t, v, sigma), x0)
    close(noise_from_velocity(clean_from_velocity(x_t, v, sigma), v), eps)


def test_guidance_combines_the_two_velocities_and_a_cfg_free_query_is_the_conditional_one():
    c, u = T([[2.0]]), T([[1.0]])
    close(guided_velocity(c, u, 4.0), T([[5.0]]))
    close(guided_velocity(c, None, 1.0), c)
    with pytest.raises(ValueError, match="unconditional"):
        guided_velocity(c, None, 3.0)


# ---- DMD2 ---------------------------------------------------------------------------------------------

def test_fake_score_loss_is_the_flow_matching_error_of_its_velocity():
    v_fake, x0, eps = T([[1.0, 2.0], [0.0, 0.0]]), T([[0.0, 1.0], [1.0, 1.0]]), T([[1.0, 1.0], [1.0, -1.0]])
    # targets eps - x0: [1, 0] and [0, -2]; errors (0 + 4) / 2 = 2 and (0 + 4) / 2 = 2
    close(fake_score_loss(v_fake, x0, eps), 2.0)


def test_the_fake_score_moves_towards_the_generators_samples():
    """One parameter: a fake denoiser predicting the mean m, v_fake = (x_t - m) / sigma. Its loss is
    mean(((x0 - m) / sigma)^2) (the noise cancels), with dL/dm = -2 mean((x0 - m) / sigma^2): descent moves m
    to the generator's samples x0."""
    g = torch.Generator().manual_seed(0)
    x0 = 2.0 + 0.1 * torch.randn(64, 1, generator=g)  # the generator's samples, about 2
    m = torch.zeros((), requires_grad=True)
    for _ in range(3):
        sigma, eps = sample_perturbation_sigma(64, generator=g), torch.randn(64, 1, generator=g)
        x_t = add_noise(x0, eps, sigma)
        loss = fake_score_loss((x_t - m) / sigma[:, None], x0, eps)
        close(loss, (((x0[:, 0] - m) / sigma) ** 2).mean().detach(), 1e-4)
        (grad,) = torch.autograd.grad(loss, m)
        close(grad, (-2 * (x0[:, 0] - m) / sigma**2).mean().detach(), 1e-4)
        assert grad < 0  # m < mean(x0): gradient descent raises m
        m = (m - 1e-3 * grad).detach().requires_grad_(True)
    assert 0 < m.item() < 2.0


def test_perturbation_levels_lie_in_the_range_and_one_step_is_drawn_uniformly():
    sigma = sample_perturbation_sigma(10_000, (0.02, 0.98), generator=torch.Generator().manual_seed(0))
    assert sigma.min() >= 0.02 and sigma.max() <= 0.98 and abs(sigma.mean().item() - 0.5) < 0.01
    with pytest.raises(ValueError):
        sample_perturbation_sigma(4, (0.5, 0.5))
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([sample_boundary_index(4, g) for _ in range(4000)]), minlength=4)
    assert len(counts) == 4 and counts.min() > 900


def test_dmd2_generator_loss_and_gradient_by_hand():
    x0_gen = T([[1.0, 2.0], [0.0, 0.0]], requires_grad=True)
    x0_real, x0_fake = T([[0.0, 0.0], [0.0, 0.0]]), T([[1.0, -1.0], [0.0, 0.0]])
    # sample 1: normaliser mean(|1|, |2|) = 1.5, g = (fake - real) / 1.5 = [2/3, -2/3], loss 1/2 mean(g^2) = 2/9
    # sample 2: equal predictions, g = 0 (0 / eps), loss 0
    close(distribution_matching_direction(x0_gen, x0_real, x0_fake), T([[2 / 3, -2 / 3], [0.0, 0.0]]))
    loss = dmd2_generator_loss(x0_gen, x0_real, x0_fake)
    close(loss, (2 / 9 + 0) / 2)
    (grad,) = torch.autograd.grad(loss, x0_gen)
    close(grad, T([[2 / 3, -2 / 3], [0.0, 0.0]]) / (2 * 2))  # g / (elements x batch)


def gaussian_x0(x_t, sigma, mean, std=1.0):
    """E[x0 | x_t] for data N(mean, std^2): mean + a std^2 / (a^2 std^2 + sigma^2) (x_t - a mean), a = 1 - sigma."""
    a = 1 - sigma
    return mean + a * std**2 / (a**2 * std**2 + sigma**2) * (x_t - a * mean)


DIM = 16  # the per-sample normaliser is a mean over elements: in one dimension it is one noisy |difference|


def dmd2_theta_gradient(theta: float, teacher_mean: float, g: torch.Generator) -> float:
    """G(z) = z + theta samples N(theta, I); the teacher's data N(teacher_mean, I) and the fake score exactly
    the generator's, both as E[x0 | x_t]: dL/dtheta of DMD2's generator loss."""
    th = torch.tensor(theta, requires_grad=True)
    x0 = torch.randn(256, DIM, generator=g) + th
    sigma, eps = sample_perturbation_sigma(256, generator=g), torch.randn(256, DIM, generator=g)
    x_t, s = add_noise(x0.detach(), eps, sigma), sigma[:, None]
    loss = dmd2_generator_loss(x0, gaussian_x0(x_t, s, teacher_mean), gaussian_x0(x_t, s, theta))
    return torch.autograd.grad(loss, th)[0].item()


@pytest.mark.parametrize("theta,teacher_mean", [(0.0, 3.0), (5.0, 3.0), (-1.0, -4.0)])
def test_the_dmd2_generator_moves_towards_the_teachers_distribution(theta, teacher_mean):
    """One parameter: the gradient has the sign of theta - teacher_mean, and gradient descent brings theta to
    the teacher's mean."""
    g = torch.Generator().manual_seed(1)
    assert math.copysign(1, dmd2_theta_gradient(theta, teacher_mean, g)) == math.copysign(1, theta - teacher_mean)
    for _ in range(40):
        theta -= 0.5 * dmd2_theta_gradient(theta, teacher_mean, g)
    assert abs(theta - teacher_mean) < 0.1, theta


# ---- TDM ----------------------------------------------------------------------------------------------

def test_the_students_prediction_and_noise_reproduce_its_euler_step():
    x_k, v, s_k, s_next = T([[0.3, -0.2]]), T([[1.5, 0.5]]), 0.75, 0.25
    x0, eps = student_prediction(x_k, v, s_k)
    close(x0, x_k - 0.75 * v)
    close(eps, x0 + v)
    close((1 - s_next) * x0 + s_next * eps, x_k + (s_next - s_k) * v)  # the Euler step lands on x_{k+1}


def test_conditional_renoising_by_hand():
    """x0 = 1, student noise 2, sigma_mid 0.2 -> sigma_t 0.6, fresh noise 0.5: alpha_t / alpha_mid = 0.5,
    the kept noise 0.5 * 0.2 = 0.1, beta = sqrt(0.36 - 0.01); x_t = 0.5 x_mid + beta 0.5 with
    x_mid = 0.8 + 0.4 = 1.2."""
    beta = math.sqrt(0.35)
    x_t, mixed, ratio = conditional_renoise(T([[1.0]]), T([[2.0]]), T([0.2]), T([0.6]), fresh=T([[0.5]]))
    close(x_t, [[0.6 + beta * 0.5]])
    close(mixed, [[(0.1 * 2 + beta * 0.5) / 0.6]])
    close(x_t, 0.4 * 1.0 + 0.6 * mixed)
    close(ratio, [math.exp(-0.5 * mixed.item() ** 2 + 0.5 * 0.25)])
    # clipped at tdm_importance_clip, both ways
    _, _, r = conditional_renoise(T([[0.0]]), T([[40.0]]), T([0.5]), T([0.6]), importance_clip=20.0, fresh=T([[0.0]]))
    close(r, [1 / 20])
    # the last stage (sigma_mid = 0) keeps no student noise: x_t is a fresh noising, ratio 1
    x_t, mixed, r = conditional_renoise(T([[1.0]]), T([[9.0]]), T([0.0]), T([0.3]), fresh=T([[-1.0]]))
    close(x_t, [[0.7 - 0.3]])
    close(r, [1.0])


def test_conditional_renoising_has_the_forward_processs_conditional_variance():
    n, x0, eps_s = 200_000, torch.zeros(200_000, 1), torch.randn(200_000, 1, generator=torch.Generator().manual_seed(0))
    x_t, _, _ = conditional_renoise(x0, eps_s, torch.full((n,), 0.3), torch.full((n,), 0.7),
                                    generator=torch.Generator().manual_seed(1))
    x_mid = 0.3 * eps_s
    resid = x_t - (0.3 / 0.7) * x_mid
    assert abs(resid.var().item() - (0.49 - (0.3 * 0.3 / 0.7) ** 2)) < 5e-3  # beta^2
    assert abs(x_t.var().item() - 0.49) < 5e-3  # the marginal at sigma_t: sigma_t^2 around alpha_t x0


def test_tdm_fake_loss_by_hand():
    x0_fake, x0 = T([[1.0, 3.0], [1.0, 3.0]]), T([[0.0, 1.0], [0.0, 1.0]])  # per sample mean(1, 4) = 2.5
    # sigma 0.5: SNR 1; sigma 0.1: SNR 81, capped at 5; importance 2 and 1
    close(snr_weight(T([0.5, 0.1])), [1.0, 5.0])
    close(tdm_fake_loss(x0_fake, x0, T([0.5, 0.1]), T([2.0, 1.0])), (2.5 * 1 * 2 + 2.5 * 5 * 1) / 2)


def test_tdm_generator_loss_and_gradient_by_hand():
    x0 = T([[1.0, 2.0]], requires_grad=True)
    x0_real, x0_fake = T([[0.0, 0.0]]), T([[1.0, -1.0]])
    # correction real - fake = [-1, 1]; d = x0 - (x0 + correction) = [1, -1]; normaliser mean|x0 - real| = 1.5
    loss = tdm_generator_loss(x0, x0_real, x0_fake, use_huber=False)
    close(loss, 0.5 / 1.5)
    (grad,) = torch.autograd.grad(loss, x0)
    close(grad, T([[1.0, -1.0]]) / (2 * 1.5))  # the same step as DMD2's for the same predictions
    c = 1e-3
    loss = tdm_generator_loss(x0, x0_real, x0_fake, use_huber=True, huber_c=c)
    close(loss, (math.sqrt(1 + c * c) - c) / 1.5)
    (grad,) = torch.autograd.grad(loss, x0)
    close(grad, T([[1.0, -1.0]]) / math.sqrt(1 + c * c) / (2 * 1.5))


def tdm_theta_gradient(theta: float, teacher_mean: float, use_huber: bool, g: torch.Generator) -> float:
    """One step K = 1 from sigma 1 with v = z - theta: x0 = theta, the implied noise z; the teacher's data
    N(teacher_mean, I), the fake score the generator's point mass (E[x0 | x_t] = theta): dL/dtheta of TDM's
    generator loss at a conditional renoising in the stage (0, 1)."""
    th = torch.tensor(theta, requires_grad=True)
    z = torch.randn(256, DIM, generator=g)
    x0, eps_s = student_prediction(z, z - th, 1.0)
    lower, upper = query_interval(torch.zeros(256), torch.full((256,), 0.999))
    sigma_t = sample_query_sigma(lower, upper, generator=g)
    x_t, _, _ = conditional_renoise(x0, eps_s, lower, sigma_t, generator=g)
    loss = tdm_generator_loss(x0, gaussian_x0(x_t, sigma_t[:, None], teacher_mean), torch.full_like(x0, theta),
                              use_huber=use_huber)
    return torch.autograd.grad(loss, th)[0].item()


@pytest.mark.parametrize("use_huber", [False, True])
@pytest.mark.parametrize("theta,teacher_mean", [(-1.0, 2.0), (4.0, 2.0)])
def test_the_tdm_generator_moves_towards_the_teachers_distribution(theta, teacher_mean, use_huber):
    g = torch.Generator().manual_seed(2)
    assert math.copysign(1, tdm_theta_gradient(theta, teacher_mean, use_huber, g)) == \
        math.copysign(1, theta - teacher_mean)
    for step in range(40):
        theta -= 0.5 * (1 - step / 40) * tdm_theta_gradient(theta, teacher_mean, use_huber, g)
    assert abs(theta - teacher_mean) < 0.1, theta


@pytest.mark.parametrize("distribution", ["actual_uniform", "conditional_logit_normal", "source_uniform"])
def test_query_levels_lie_strictly_inside_the_interval(distribution):
    g = torch.Generator().manual_seed(0)
    lower, upper = T([0.0, 0.25, 0.5, 0.75]).repeat(2000), T([0.25, 0.5, 0.75, 1.0]).repeat(2000)
    s = sample_query_sigma(lower, upper, distribution, source_shift=3.0, generator=g)
    assert bool(((s > lower) & (s < upper)).all())


def test_query_distributions_by_their_medians():
    g = torch.Generator().manual_seed(0)
    lo, hi = torch.zeros(20_000), torch.ones(20_000)
    assert abs(sample_query_sigma(lo, hi, generator=g).median().item() - 0.5) < 0.02
    med = sample_query_sigma(lo, hi, "conditional_logit_normal", logit_mean=1.0, generator=g).median().item()
    assert abs(med - 1 / (1 + math.exp(-1))) < 0.02  # the untruncated logit-normal's median sigmoid(1)
    # source_uniform with shift 3: uniform u pushed through 3u / (1 + 2u): median 1.5 / 2 = 0.75
    shifted = sample_query_sigma(lo, hi, "source_uniform", source_shift=3.0, generator=g)
    assert abs(shifted.median().item() - 0.75) < 0.02
    # shift 1 is the identity: uniform
    assert abs(sample_query_sigma(lo, hi, "source_uniform", source_shift=1.0, generator=g).mean().item() - 0.5) < 0.02


def test_the_query_interval_is_the_stage_or_reaches_up_to_max_sigma():
    lo, hi = query_interval(T([0.25]), T([0.5]), "trajectory")
    close(hi, [0.5])
    lo, hi = query_interval(T([0.25]), T([0.5]), "reverse", max_sigma=0.9)
    close(hi, [0.9])
    with pytest.raises(ValueError, match="empty"):
        query_interval(T([0.95]), T([1.0]), "reverse", max_sigma=0.9)


# ---- TDM-R1 -------------------------------------------------------------------------------------------

def test_time_weights_and_the_slow_surrogates_decay():
    assert [time_weight(k, 4) for k in range(4)] == [0.5, 0.75, 1.0, 1.25]  # (boundary_index + 1) / K
    assert time_weight(3, 4, use_time_weighting=False) == 1.0
    assert slow_surrogate_decay(0) == 0.001
    assert abs(slow_surrogate_decay(100) - 0.101) < 1e-12
    assert slow_surrogate_decay(10_000) == 0.3


def test_denoising_errors_by_hand():
    v, x, eps = T([[1.0, 0.0]]), T([[0.0, 1.0]]), T([[0.0, 0.0]])  # target eps - x = [0, -1]
    close(denoising_errors(v, x, eps), [(1 + 1) / 2])


def test_the_runaway_clip_and_the_trust_region_by_hand():
    err, ref = T([0.1, 0.5, 0.4, 0.5]), T([0.5, 0.1, 0.5, 0.45])
    adv = T([1.0, -1.0, 1.0, 1.0])
    # 0: A > 0, err below the reference by 0.4 (0.16 > 0.05): clipped; 1: A <= 0, above by 0.4: clipped;
    # 2: A > 0, below by 0.1 (0.01): kept; 3: A > 0 but above the reference: kept
    assert runaway_mask(err, ref, adv, 0.05).tolist() == [True, True, False, False]
    slow = T([0.1, 0.5, 0.45, 0.5])  # sample 2: ratio exp(0.45 - 0.4) > 1 + 1e-3 with A > 0: clipped
    assert surrogate_masks(err, ref, slow, adv, 1e-3, 0.05).tolist() == [True, True, True, False]
    assert surrogate_masks(err, ref, slow, adv, 0.0, 0.05).tolist() == [True, True, False, False]


def test_surrogate_loss_by_hand():
    """One group of two, A = [1, -1], errors [1, 2] against the reference's [1.5, 1.5]: the group logit
    s = (1 (1 - 1.5) - 1 (2 - 1.5)) / 2 = -0.5, weight sigmoid(-0.5); the preference term mean(w A e) =
    -w / 2, its gradient w A / 2; the reference penalty mean((e - e_ref)^2) = 0.25, gradient (e - e_ref)."""
    w = 1 / (1 + math.exp(0.5))
    adv, group, ref = T([1.0, -1.0]), torch.zeros(2, dtype=torch.long), T([1.5, 1.5])
    err = T([1.0, 2.0], requires_grad=True)
    settings = TDMR1Settings(surrogate_reference_beta=0.1, surrogate_reference_threshold=1.0)
    loss, metrics = surrogate_loss(err, ref, adv, group, 2, settings, weight=2.0)
    close(loss, 2.0 * (-w / 2 + 0.1 * 0.25))
    close(metrics["group_margin"], -0.5)
    (grad,) = torch.autograd.grad(loss, err)
    close(grad, 2.0 * (T([w / 2, -w / 2]) + 0.1 * T([-0.5, 0.5])))
    assert grad[0] > 0 > grad[1]  # descent lowers the preferred sample's error (its likelihood up), raises the other's
    # with the default threshold both samples already moved past the reference the way asked: only the penalty pulls
    loss, metrics = surrogate_loss(err, ref, adv, group, 2, TDMR1Settings(surrogate_reference_beta=0.1))
    (grad,) = torch.autograd.grad(loss, err)
    close(grad, 0.1 * T([-0.5, 0.5]))
    close(metrics["clip_fraction"], 1.0)


def test_the_surrogate_learns_the_preferred_samples():
    """One parameter: a surrogate denoiser predicting the mean m (v = (x_t - m) / sigma), samples at -1 (reward 0)
    and +1 (reward 1) in groups: the preference moves m to the preferred side, the reference (m = 0) anchors it."""
    g = torch.Generator().manual_seed(3)
    x = T([-1.0, 1.0] * 8)[:, None]
    adv, group = T([-1.0, 1.0] * 8), torch.arange(16) // 4
    m = torch.zeros((), requires_grad=True)
    for _ in range(20):
        sigma, eps = torch.full((16,), 0.5), torch.randn(16, 1, generator=g)
        x_t = add_noise(x, eps, sigma)
        err = denoising_errors((x_t - m) / 0.5, x, eps)
        err_ref = denoising_errors(x_t / 0.5, x, eps)
        loss, _ = surrogate_loss(err, err_ref, adv, group, 4,
                                 TDMR1Settings(surrogate_reference_threshold=10.0, surrogate_clip_range=0.0))
        (grad,) = torch.autograd.grad(loss, m)
        m = (m - 0.05 * grad).detach().requires_grad_(True)
    assert m.item() > 0.05


def test_the_guidance_reward_is_cfg_reward_scale_times_the_conditional_minus_unconditional_prediction():
    # guided = u + 4 (c - u) with c = 1, guided = 4 -> u = 0; the reward 3.5 (c - u) = 3.5
    close(cfg_reward_correction(T([[4.0]]), T([[1.0]]), 4.0, 3.5), [[3.5]])
    assert cfg_reward_correction(T([[4.0]]), T([[1.0]]), 1.0, 3.5) is None
    assert cfg_reward_correction(T([[4.0]]), T([[1.0]]), 4.0, 0.0) is None


def test_tdm_r1_generator_loss_mixes_its_three_terms_by_hand():
    x0 = T([[1.0, 2.0]], requires_grad=True)
    real, fake, sur, cond = T([[0.0, 0.0]]), T([[1.0, -1.0]]), T([[0.5, 0.0]]), T([[-0.5, 0.5]])
    settings = TDMR1Settings(tdm_weight=0.25, cfg_reward_scale=2.0)
    loss, terms = tdm_r1_generator_loss(x0, real, fake, sur, settings, x0_conditional=cond, guidance_scale=3.0)
    tdm = revised_x0_loss(x0, real - fake, real)  # 1/3, as the TDM test
    cfg = revised_x0_loss(x0, 2.0 / 2.0 * (real - cond), real)  # correction [0.5, -0.5]: 0.125 / 1.5
    sur_term = revised_x0_loss(x0, sur - real, sur)  # correction [0.5, 0]: 0.5 * 0.125 / mean(0.5, 2) = 0.05
    close(tdm, 1 / 3)
    close(cfg, 0.125 / 1.5)
    close(sur_term, 0.0625 / 1.25)
    close(loss, tdm + 0.25 * cfg + 0.75 * sur_term)
    close(terms["generator_surrogate_reward_loss"], sur_term)
    # without guidance there is no guidance term
    loss, terms = tdm_r1_generator_loss(x0, real, fake, sur, settings)
    close(loss, tdm + 0.75 * sur_term)
    with pytest.raises(ValueError, match="tdm_weight"):
        TDMR1Settings(tdm_weight=1.0)


def test_the_r1_generator_follows_the_surrogate_beyond_the_teacher():
    """With the distribution matched (fake = real), the generator's gradient is the surrogate's direction:
    x0_sur to the right of x0_real moves x0 right."""
    x0 = T([[0.0, 0.0]], requires_grad=True)
    real = T([[0.0, 0.0]])
    loss, _ = tdm_r1_generator_loss(x0, real, real, T([[1.0, 0.0]]))
    (grad,) = torch.autograd.grad(loss, x0)
    assert grad[0, 0] < 0 and grad[0, 1] == 0


# ---- the torch-free spec ------------------------------------------------------------------------------

def test_the_specs_carry_upstreams_defaults_roles_and_phases():
    dmd2, tdm, r1 = (DISTILLATION_SPECS[n] for n in ("dmd2", "tdm", "tdm-r1"))
    assert dmd2.defaults["ttur_fake_updates"] == 5 and dmd2.defaults["perturbation_timestep_range"] == (0.02, 0.98)
    assert dmd2.roles == tdm.roles == ("generator", "fake") and r1.roles == ("generator", "fake", "surrogate")
    assert r1.phases == (("fake", "ttur_fake_updates"), ("surrogate", 1), ("generator", 1))
    assert tdm.defaults["use_huber"] is True and r1.defaults["use_huber"] is False
    assert tdm.defaults["num_inference_steps"] == 4 and tdm.defaults["tdm_query_interval"] == "trajectory"
    assert r1.defaults["tdm_weight"] == 0.3 and r1.defaults["cfg_reward_scale"] == 3.5
    assert r1.optimizers["generator"].learning_rate == 7.5e-5 and r1.optimizers["generator"].betas == (0.0, 0.999)
    assert dmd2.optimizers["fake"].learning_rate == 1e-5 and r1.rewards and not tdm.rewards
    assert set(dmd2.keys) < set(tdm.keys) < set(r1.keys)
    assert resolved("tdm", {"huber_c": 0.01})["huber_c"] == 0.01


def test_the_rule_checks_name_each_bad_key():
    assert all(distillation_problems(n, {}) == [] for n in DISTILLATION_SPECS if n != "diffusion-opd")
    assert [m.split(":")[0] for m in distillation_problems("diffusion-opd", {})] == ["train.teachers"]  # needs one
    bad = distillation_problems("tdm-r1", {"tdm_weight": 1.0, "surrogate_slow_decay_min": 0.5,
                                           "surrogate_slow_decay_max": 0.3, "ttur_fake_updates": 0,
                                           "perturbation_timestep_range": [0.5, 0.2], "real_guidance_scale": 0.5,
                                           "tdm_query_interval": "forward", "num_inner_epochs": 2})
    for key in ("tdm_weight", "surrogate_slow_decay_min", "ttur_fake_updates", "perturbation_timestep_range",
                "real_guidance_scale", "tdm_query_interval", "num_inner_epochs"):
        assert any(key in message for message in bad), key
    assert distillation_problems("dmd2", {"tdm_weight": 7}) == []  # not dmd2's key: the spec ignores it
    assert distillation_problems("grpo", {}) != []
