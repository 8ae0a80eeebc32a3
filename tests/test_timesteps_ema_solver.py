"""Training timesteps, EMA schedules and weight copies, DPM-Solver++2M, and the config
rules of the decoupled algorithms."""


import pytest
import torch
from test_config import minimal, problem_of
from test_dynamics import MU, S, exact_velocity

from flow_factory.algorithms.timesteps import draw_training_sigmas, num_train_timesteps
from flow_factory.config import ConfigError
from flow_factory.config.train import TrainConfig
from flow_factory.config.loader import parse_config
from flow_factory.dynamics import ODE, DPMSolver2M
from flow_factory.trainer.ema import WeightCopy, ema_decay_at

ROLLOUT_SIGMAS = torch.tensor([1.0, 0.9, 0.7, 0.4, 0.1, 0.0])


# ------------------------------------------------------------------ timesteps
def test_uniform_is_stratified_over_the_range():
    # range [0.2, 0.6] of the denoising axis = sigma in [0.4, 0.8]; 8 draws, one per stratum
    s = draw_training_sigmas("uniform", 8, ROLLOUT_SIGMAS, [0.2, 0.6], 1.0, torch.Generator().manual_seed(0))
    u = (s.double() - 0.4) / 0.4
    assert sorted((u * 8).floor().long().tolist()) == list(range(8))


def test_time_shift_warps_like_the_pipeline_schedulers():
    plain = draw_training_sigmas("uniform", 6, ROLLOUT_SIGMAS, 1.0, 1.0, torch.Generator().manual_seed(3))
    shifted = draw_training_sigmas("uniform", 6, ROLLOUT_SIGMAS, 1.0, 3.0, torch.Generator().manual_seed(3))
    torch.testing.assert_close(shifted, 3 * plain / (1 + 2 * plain))


def test_logit_normal_has_standard_normal_logits():
    s = draw_training_sigmas("logit_normal", 4000, ROLLOUT_SIGMAS, 1.0, 1.0, torch.Generator().manual_seed(1))
    logits = torch.logit(s.double())
    assert abs(logits.mean().item()) < 0.01 and abs(logits.std().item() - 1) < 0.02


def test_discrete_strategies_use_the_rollout_sigmas_in_range():
    g = torch.Generator().manual_seed(0)
    # 0.9 keeps sigma >= 0.1: five steps; five stratified draws take each once
    assert sorted(draw_training_sigmas("discrete", 5, ROLLOUT_SIGMAS, 0.9, 1.0, g).tolist()) == \
        pytest.approx(sorted([1.0, 0.9, 0.7, 0.4, 0.1]))
    for _ in range(20):
        with_init = draw_training_sigmas("discrete_with_init", 2, ROLLOUT_SIGMAS, 0.5, 1.0, g).tolist()
        assert with_init[0] == 1.0 and round(with_init[1], 4) in (0.9, 0.7)
        assert 1.0 not in draw_training_sigmas("discrete_wo_init", 2, ROLLOUT_SIGMAS, 0.5, 1.0, g).tolist()
    with pytest.raises(ValueError, match=r"holds none of the rollout's sigmas"):
        draw_training_sigmas("discrete", 1, ROLLOUT_SIGMAS, [0.2, 0.25], 1.0, g)


def test_num_train_timesteps_null_is_the_steps_in_range():
    cfg = TrainConfig(num_train_timesteps=None, timestep_range=0.9, num_inference_steps=10)
    assert num_train_timesteps(cfg) == 9
    cfg.timestep_range = [0.5, 0.6]
    assert num_train_timesteps(cfg) == 1
    cfg.num_train_timesteps = 4
    assert num_train_timesteps(cfg) == 4


# ------------------------------------------------------------------ EMA
@pytest.mark.parametrize("schedule,step,kwargs,expected", [
    ("constant", 37, {}, 0.9),
    ("power", 0, {"decay": 0.99}, 0.0),
    ("power", 7, {"decay": 0.99}, 0.75),  # 1 - 8^(-2/3)
    ("power", 10**6, {"decay": 0.99}, 0.99),
    ("linear", 5, {"decay": 0.8, "total_epochs": 10}, 0.4),
    ("linear", 20, {"decay": 0.8, "total_epochs": 10}, 0.8),
    ("piecewise_linear", 2, {"decay": 0.5, "flat_epochs": 3, "ramp_rate": 0.1}, 0.0),
    ("piecewise_linear", 5, {"decay": 0.5, "flat_epochs": 3, "ramp_rate": 0.1}, 0.2),
    ("piecewise_linear", 20, {"decay": 0.5, "flat_epochs": 3, "ramp_rate": 0.1}, 0.5),
    ("cosine", 0, {"decay": 0.8, "total_epochs": 10}, 0.0),
    ("cosine", 5, {"decay": 0.8, "total_epochs": 10}, 0.4),
    ("cosine", 10, {"decay": 0.8, "total_epochs": 10}, 0.8),
    ("warmup_cosine", 1, {"decay": 0.8, "total_epochs": 10, "flat_epochs": 2}, 0.0),
    ("warmup_cosine", 6, {"decay": 0.8, "total_epochs": 10, "flat_epochs": 2}, 0.4),
    ("warmup_cosine", 10, {"decay": 0.8, "total_epochs": 10, "flat_epochs": 2}, 0.8),
])
def test_ema_schedules_match_their_formulas(schedule, step, kwargs, expected):
    args = {"decay": 0.9, "total_epochs": 100, **kwargs}
    assert ema_decay_at(schedule, step, **args) == pytest.approx(expected, abs=1e-12)


def test_weight_copy_blends_swaps_and_restores():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    ema = WeightCopy([p], "cpu")
    with torch.no_grad():
        p.copy_(torch.tensor([3.0, 6.0]))
    ema.update(0.75)  # .75 [1, 2] + .25 [3, 6]
    torch.testing.assert_close(ema.weights[0], torch.tensor([1.5, 3.0]))
    live = p.data_ptr()
    with ema.applied():
        torch.testing.assert_close(p.detach(), torch.tensor([1.5, 3.0]))
    assert p.data_ptr() == live and p.tolist() == [3.0, 6.0]
    other = WeightCopy([torch.nn.Parameter(torch.zeros(2))])
    other.load_state_dict(ema.state_dict())
    torch.testing.assert_close(other.weights[0], torch.tensor([1.5, 3.0]))
    with pytest.raises(ValueError, match="do not match the 1 trainable parameters"):
        WeightCopy([torch.nn.Parameter(torch.zeros(3))]).load_state_dict(ema.state_dict())


# ------------------------------------------------------------------ DPM-Solver++2M
def integrate(dynamics, num_steps, x):
    sigmas = torch.linspace(1.0, 0.0, num_steps + 1)
    solver = dynamics.solver()
    for i in range(num_steps):
        x = solver.step(x, exact_velocity(x, sigmas[i].item()), sigmas[i], sigmas[i + 1]).sample
    return x


def test_dpm_solver_is_second_order_on_gaussian_data():
    """The ODE maps noise z to MU + S z exactly. Euler's error halves when the steps double
    (first order); DPM-Solver++2M's falls far faster, and is far smaller at equal steps."""
    z = torch.linspace(-2, 2, 9).reshape(-1, 1)
    exact = MU + S * z
    err = {(d.name, n): (integrate(d, n, z) - exact).abs().max().item()
           for d in (ODE(), DPMSolver2M()) for n in (64, 256)}
    assert 3.5 < err["ODE", 64] / err["ODE", 256] < 4.5  # first order: 4x the steps, 4x less error
    assert err["DPM-Solver++2M", 64] / err["DPM-Solver++2M", 256] > 8
    assert err["DPM-Solver++2M", 64] < err["ODE", 64] / 5


def test_dpm_solver_first_step_is_euler_and_last_lands_on_x0_hat():
    x, v = torch.randn(3, 4), torch.randn(3, 4)
    solver = DPMSolver2M().solver()
    first = solver.step(x, v, 0.8, 0.6).sample
    torch.testing.assert_close(first, x + v * (0.6 - 0.8))
    v2 = torch.randn(3, 4)
    second = solver.step(first, v2, 0.6, 0.4).sample
    assert not torch.allclose(second, first + v2 * (0.4 - 0.6))  # uses the history
    last = solver.step(second, v, 0.4, 0.0).sample
    torch.testing.assert_close(last, second - 0.4 * v)
    assert DPMSolver2M().solver()._prev is None  # each trajectory starts with no history


# ------------------------------------------------------------------ config
def test_decoupled_algorithms_default_to_ode_and_accept_any_dynamics():
    assert parse_config(minimal(train={"trainer_type": "nft"})).scheduler.dynamics_type == "ODE"
    for dynamics in ("Flow-SDE", "CPS", "DPM-Solver++2M", "dpm-solver++"):
        cfg = parse_config(minimal(train={"trainer_type": "awm"}, scheduler={"dynamics_type": dynamics}))
        assert cfg.scheduler.dynamics_type in ("Flow-SDE", "CPS", "DPM-Solver++2M")
    assert parse_config(minimal()).scheduler.dynamics_type == "Flow-SDE"  # grpo's default is unchanged


def test_decoupled_batch_arithmetic():
    # 16 samples / 4 = 4 batches x 3 timesteps; dpo: 4 groups -> 4 pairs / 4 = 1 batch x 3
    cfg = parse_config(minimal(train={"trainer_type": "nft", "num_train_timesteps": 3}))
    assert (cfg.trained_steps_per_sample, cfg.micro_steps_per_epoch) == (3, 12)
    cfg = parse_config(minimal(train={"trainer_type": "dpo", "num_train_timesteps": 3}))
    assert cfg.micro_steps_per_epoch == 3
    cfg = parse_config(minimal(train={"trainer_type": "awm", "num_inference_steps": 10}))
    assert cfg.trained_steps_per_sample == 9  # null: 10 steps x the default range 0.9


@pytest.mark.parametrize("overrides,message", [
    (["train.trainer_type=grpo", "scheduler.dynamics_type=DPM-Solver++2M"],
     "train.trainer_type 'grpo' needs a stochastic dynamics"),
    (["train.trainer_type=nft", "train.off_policy=true", "train.ema_decay=0"],
     "train.off_policy: true samples with the EMA weights, but train.ema_decay is 0"),
    (["train.trainer_type=nft", "train.ema_decay=0.9", "train.ema_kl_beta=0.1"],
     "train.ema_kl_beta: the KL to the EMA policy is awm's; nft does not use it"),
    (["train.trainer_type=awm", "train.ema_kl_beta=0.1", "train.ema_decay=0"],
     "train.ema_kl_beta > 0 needs an EMA policy"),
    (["train.trainer_type=dpo", "train.kl_type=x-based"], "train.kl_type: 'x-based' compares the sampler's"),
    (["train.trainer_type=nft", "train.timestep_range=[0.6, 0.2]"],
     "train.timestep_range: needs 0 <= lo < hi <= 1, got [0.6, 0.2]"),
    (["train.trainer_type=nft", "train.timestep_range=1.5"], "train.timestep_range: a fraction of the trajectory"),
    (["train.trainer_type=nft", "train.ema_decay_schedule=step"], "train.ema_decay_schedule: expected one of"),
    (["train.trainer_type=awm", "train.awm_weighting=huberr"], "did you mean 'huber'?"),
])
def test_decoupled_contradictions_are_named(overrides, message):
    assert message in problem_of(overrides=overrides)


def test_dpo_groups_must_stay_on_one_process():
    with pytest.raises(ConfigError, match="dpo pairs the best and worst sample of each group on one process"):
        parse_config(minimal(train={"trainer_type": "dpo", "unique_sample_num_per_epoch": 3, "group_size": 4,
                                    "per_device_batch_size": 3}, num_processes=2))
