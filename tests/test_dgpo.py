"""DGPO (arXiv:2510.08425): the group loss against a hand-computed value, a group split in parts
whose preference shares are summed (what the processes' all-reduce does) against the whole group,
the clip mask, the gradient sign on one parameter, the micro-batches (a global micro-batch's draws
alike on every process), CFG on the reference (``kl_cfg``) and the fast old-policy EMA
(``ema_ref``) against hand computations, and the config's defaults and refusals. The toy learning
test, ff-train runs with exact resume and two real processes live elsewhere (test_toy_learning,
test_decoupled_train, test_groups_across_processes)."""

import math

import pytest
import torch
from helpers_algorithms import toy_rollouts
from test_config import minimal as base_config

from flow_factory.algorithms import DGPO, dgpo_loss, dsm_clip_mask, ema_ref_decay, group_preferences
from flow_factory.algorithms import dgpo as dgpo_module
from flow_factory.config.train import TrainConfig
from flow_factory.dynamics import ODE

ERR = torch.tensor([1.0, 2.0, 0.5, 3.0])
ERR_REF = torch.tensor([1.5, 1.0, 0.5, 2.0])
ADV = torch.tensor([1.0, -1.0, 2.0, -0.5])
GROUP = torch.tensor([0, 0, 1, 1])


def sig(x):
    return 1 / (1 + math.exp(-x))


def whole_loss(err, err_ref=ERR_REF, adv=ADV, group=GROUP, group_size=2, beta=4.0):
    return dgpo_loss(err, adv, group, group_preferences(err, err_ref, adv, group, group_size, beta, 2))


def test_dgpo_loss_equals_hand_computed_value():
    # group 0: 4 / 2 (1 (1 - 1.5) + (-1)(2 - 1)) = -3; group 1: 2 (2 * 0 + (-.5)(3 - 2)) = -1
    s0, s1 = -3.0, -1.0
    expected = (sig(s0) * 1 * 1.0 + sig(s0) * -1 * 2.0 + sig(s1) * 2 * 0.5 + sig(s1) * -0.5 * 3.0) / 4
    loss, metrics = whole_loss(ERR)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["implicit_accuracy"].item() == 1.0
    assert metrics["group_margin"].item() == pytest.approx((s0 + s1) / 2)


def test_the_gradient_is_the_group_dpo_gradient():
    """d L / d e_i = sigmoid(s_g) A_i / B, the gradient of -log sigmoid(-s_g) over dpo_beta / G."""
    err = ERR.clone().requires_grad_(True)
    whole_loss(err)[0].backward()
    e = ERR.clone().requires_grad_(True)
    s = torch.stack([(ADV[:2] * (e[:2] - ERR_REF[:2])).sum(), (ADV[2:] * (e[2:] - ERR_REF[2:])).sum()]) * 4.0 / 2
    (-torch.nn.functional.logsigmoid(-s).sum() / 4 / (4.0 / 2)).backward()
    torch.testing.assert_close(err.grad, e.grad)


def test_a_group_split_in_parts_gives_the_whole_groups_loss_and_gradient():
    """Two processes each holding half of both groups: each adds its share of every group's preference,
    the shares are summed (the all-reduce), and the mean of the two parts' losses and its gradient are
    the whole batch's. With each part's own shares only (no sum) they are not."""
    err = torch.tensor([1.0, 2.0, 0.7, 0.5, 3.0, 1.2], requires_grad=True)
    err_ref = torch.tensor([1.5, 1.0, 0.9, 0.5, 2.0, 1.0])
    adv = torch.tensor([1.0, -1.0, 0.3, 2.0, -0.5, -1.5])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    whole, _ = dgpo_loss(err, adv, group, group_preferences(err, err_ref, adv, group, 3, 2.0, 2))
    expected = torch.autograd.grad(whole, err)[0]
    parts = [torch.tensor([0, 3, 4]), torch.tensor([1, 2, 5])]  # each part: members of both groups

    def split_loss(summed):
        shares = [group_preferences(err[p], err_ref[p], adv[p], group[p], 3, 2.0, 2) for p in parts]
        total = sum(shares)
        losses = [dgpo_loss(err[p], adv[p], group[p], total if summed else share)[0]
                  for p, share in zip(parts, shares)]
        return sum(losses) / len(losses)

    split = split_loss(summed=True)
    assert split.item() == pytest.approx(whole.item(), rel=1e-6)
    torch.testing.assert_close(torch.autograd.grad(split, err)[0], expected)
    alone = split_loss(summed=False)
    assert abs(alone.item() - whole.item()) > 1e-3


def test_clip_mask_follows_the_advantage_sign():
    err = torch.tensor([1.0, 1.0, 1.0, 1.0])
    err_old = torch.tensor([1.5, 1.5, 0.5, 1.0])  # ratio e^.5, e^.5, e^-.5, 1
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    assert dsm_clip_mask(err, err_old, adv, 0.2).tolist() == [True, False, True, False]


class OneParameter:
    """v = w * (eps - x0): w = 1 fits every sample exactly. The frozen reference is w = 0.5 at the policy's
    guidance; at guidance g its conditional branch is w = 0.5 and its unconditional one w = 0.2, so CFG
    gives w = 0.2 + g (0.5 - 0.2). The fast old-policy EMA is w = 0.9."""

    def __init__(self, w, target):
        self.w = torch.tensor(w, requires_grad=True)
        self.target = target
        self.reference_scales = []

    def velocity(self, x_t, sigma, cond):
        return self.w * self.target

    def reference_velocity(self, x_t, sigma, cond, guidance_scale=None):
        self.reference_scales.append(guidance_scale)
        w = 0.5 if guidance_scale is None else 0.2 + guidance_scale * (0.5 - 0.2)
        return w * self.target

    def snapshot_velocity(self, name, x_t, sigma, cond):
        assert name == dgpo_module.EMA_REF
        return 0.9 * self.target


def cfg(**kw):
    base = dict(trainer_type="dgpo", group_size=2, per_device_batch_size=2, dpo_beta=1.0, clip_range=0.2,
                num_train_timesteps=1, time_sampling_strategy="uniform", time_shift=1.0, timestep_range=1.0,
                num_inference_steps=4)
    base.update(kw)
    return TrainConfig(**base)


def first_batch(algo, n=2, advantages=None, group_ids=None):
    rollouts = toy_rollouts(n)
    rollouts.group_ids = torch.zeros(n, dtype=torch.long) if group_ids is None else group_ids  # one group
    units = algo.training_units(rollouts.group_ids, torch.zeros(n))
    adv = torch.tensor([1.0, 0.0]) if advantages is None else advantages
    return next(algo.micro_batches(rollouts, adv, units[:1], torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("clip_dsm", [True, False])
def test_preferred_samples_likelihood_goes_up(clip_dsm):
    """Only the preferred sample of the group moves w: its error (w - 1)^2 |target|^2 falls as w
    goes from 0.8 toward 1, so the gradient on w is negative."""
    algo = DGPO(cfg(clip_dsm=clip_dsm), ODE())
    batch = first_batch(algo, group_ids=torch.tensor([7, 7]))
    policy = OneParameter(0.8, batch.target)
    loss, _ = algo.loss(policy, batch)
    loss.backward()
    assert policy.w.grad < 0
    policy = OneParameter(0.8, batch.target)  # the dispreferred sample alone: its likelihood goes down
    batch.advantages = torch.tensor([0.0, -1.0])
    algo.loss(policy, batch)[0].backward()
    assert policy.w.grad > 0


def hand_loss(w, w_pref, w_kl, batch, beta, kl_beta, clip=None):
    """The DGPO loss of one group of ``OneParameter`` policies: error e(w) = (w - 1)^2 mean(target^2)."""
    t2 = (batch.target ** 2).flatten(1).mean(1)
    err, err_pref = (w - 1) ** 2 * t2, (w_pref - 1) ** 2 * t2
    adv = batch.advantages
    s = beta / 2 * (adv * (err - err_pref)).sum()
    dsm = err if clip is None else torch.where(clip, err.detach(), err)
    kl = ((w - w_kl) ** 2 * t2).mean()
    return (torch.sigmoid(s.detach()) * adv * dsm).mean() + kl_beta * kl


def test_kl_cfg_calls_the_reference_with_cfg_for_the_preference_and_the_kl():
    """kl_cfg 3: the reference is 0.2 + 3 (0.5 - 0.2) = 1.1 (the preference's and the KL's); the loss and
    its gradient equal the hand computation. kl_cfg 1: the policy's own guidance (none passed)."""
    algo = DGPO(cfg(kl_cfg=3.0, kl_beta=0.5, clip_dsm=False, dpo_beta=2.0), ODE())
    batch = first_batch(algo, advantages=torch.tensor([1.0, -0.5]))
    policy = OneParameter(0.8, batch.target)
    loss, _ = algo.loss(policy, batch)
    assert policy.reference_scales == [3.0]
    w = torch.tensor(0.8, requires_grad=True)
    expected = hand_loss(w, 1.1, 1.1, batch, 2.0, 0.5)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    expected.backward()
    assert policy.w.grad.item() == pytest.approx(w.grad.item(), rel=1e-5)

    plain = DGPO(cfg(kl_cfg=1.0, kl_beta=0.5, clip_dsm=False, dpo_beta=2.0), ODE())
    policy = OneParameter(0.8, batch.target)
    loss, _ = plain.loss(policy, batch)
    assert policy.reference_scales == [None]
    assert loss.item() == pytest.approx(hand_loss(torch.tensor(0.8), 0.5, 0.5, batch, 2.0, 0.5).item(), rel=1e-6)


def test_the_reference_with_cfg_is_the_frozen_models_guided_velocity(tiny_sd3_path):
    """AdapterPolicy.reference_velocity at kl_cfg 3 on the tiny SD3: the frozen starting weights' unconditional
    and conditional velocities (two separate calls) mixed as v_u + 3 (v_c - v_u), while the policy has moved."""
    from flow_factory.models import load_adapter
    from flow_factory.trainer.policy import AdapterPolicy

    adapter = load_adapter("sd3-5", tiny_sd3_path)
    cond = adapter.encode(["a red cube", "a blue ball"], None, 3.0)  # with the negative branch
    x = torch.randn(2, *adapter.latent_shape(64, 64), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.7, 0.4])
    with torch.no_grad():
        v_c = adapter.velocity(x, sigma, cond, 1.0)
        v_u = adapter.velocity(x, sigma, {"prompt_embeds": cond["negative_prompt_embeds"],
                                          "pooled_prompt_embeds": cond["negative_pooled_prompt_embeds"]}, 1.0)
    policy = AdapterPolicy(adapter, 1.0, "full", keep_reference=True)
    with torch.no_grad():
        for p in adapter.transformer.parameters():
            p.add_(0.01)
    guided = policy.reference_velocity(x, sigma, cond, guidance_scale=3.0)
    torch.testing.assert_close(guided, v_u + 3.0 * (v_c - v_u), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(policy.reference_velocity(x, sigma, cond), v_c, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(policy.velocity(x, sigma, cond), v_c, atol=1e-3)


def test_use_ema_ref_prefers_against_the_fast_ema_and_clips_against_it():
    """use_ema_ref: the preference compares with the fast EMA (w = 0.9) and the frozen reference is not
    called without a KL; clip_dsm compares with the EMA too: ratio exp(e_ema - e) = exp(t2 (0.01 - 0.04)) < 1,
    so the dispreferred sample (A <= 0) is clipped once clip_range is small."""
    algo = DGPO(cfg(use_ema_ref=True, clip_dsm=True, clip_range=1e-6, dpo_beta=2.0), ODE())
    assert not algo.needs_reference
    batch = first_batch(algo, advantages=torch.tensor([1.0, -0.5]))
    policy = OneParameter(0.8, batch.target)
    loss, metrics = algo.loss(policy, batch)
    assert policy.reference_scales == []
    clip = torch.tensor([False, True])
    assert metrics["clip_frac"].item() == 0.5
    assert loss.item() == pytest.approx(hand_loss(torch.tensor(0.8), 0.9, 0.0, batch, 2.0, 0.0, clip).item(),
                                        rel=1e-6)


def test_a_global_micro_batch_draws_alike_on_every_process(monkeypatch):
    """A unit is this process's part of one global micro-batch. The timesteps and a group's shared noise
    are the same on every process; independent noise is the global micro-batch's, one row block per
    process: rank 1 of 2 draws rows 2..3 of what one process with the double batch draws."""
    def batches(world_rank, group_ids, shared, n):
        monkeypatch.setattr(dgpo_module, "rank_and_world", lambda: world_rank)
        algo = DGPO(cfg(per_device_batch_size=n, group_size=4, use_shared_noise=shared), ODE())
        batch = first_batch(algo, n=n, advantages=torch.zeros(n), group_ids=group_ids)
        return algo, batch

    algo, one = batches((0, 1), torch.tensor([5, 5, 5, 5]), False, 4)
    assert algo.units_per_chunk(4) == 1
    assert algo.training_units(torch.zeros(8), torch.zeros(8)).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    _, rank1 = batches((1, 2), torch.tensor([5, 5]), False, 2)
    torch.testing.assert_close(rank1.noise, one.noise[2:])
    assert rank1.sigma[0] == one.sigma[0]

    _, one = batches((0, 1), torch.tensor([5, 5, 9, 9]), True, 4)
    torch.testing.assert_close(one.noise[0], one.noise[1])
    assert not torch.allclose(one.noise[0], one.noise[2])
    _, rank1 = batches((1, 2), torch.tensor([9, 9]), True, 2)
    torch.testing.assert_close(rank1.noise[0], one.noise[2])  # group 9's noise wherever its members are
    assert rank1.group.tolist() == [9, 9] and rank1.group_size == 4


def test_the_fast_ema_moves_after_every_optimizer_step():
    """optimize_epoch moves ema_ref after each optimizer step k of the run as w <- d w + (1 - d) theta,
    d = min(max_decay, ramp_rate k): the copy after 3 steps (the run's steps 5, 6, 7) equals that
    recursion over the weights each step left."""
    from accelerate import Accelerator
    from toy import ToyAdapter, ToyVelocity

    from flow_factory.guards import NonFiniteGuard
    from flow_factory.sampling import Rollouts
    from flow_factory.trainer.ema import WeightCopy
    from flow_factory.trainer.optimize import OptimizeSettings, Stepper, optimize_epoch
    from flow_factory.trainer.policy import AdapterPolicy, PolicyWeights

    torch.manual_seed(0)
    adapter = ToyAdapter(ToyVelocity(8))
    params = list(adapter.transformer.parameters())
    train = cfg(per_device_batch_size=4, group_size=4, num_train_timesteps=3, ema_ref_max_decay=0.3,
                ema_ref_ramp_rate=0.05, kl_beta=0.1)
    algo = DGPO(train, ODE())
    ema_ref = WeightCopy(params)
    start = [w.clone() for w in ema_ref.weights]
    policy = AdapterPolicy(adapter, 1.0, "full", keep_reference=True,
                           weights=PolicyWeights(snapshots={"ema_ref": ema_ref}))
    optimizer = torch.optim.SGD(params, lr=0.1)
    after_each_step = []
    step = optimizer.step

    def recording_step(*args, **kwargs):
        step(*args, **kwargs)
        after_each_step.append([p.detach().clone() for p in params])

    optimizer.step = recording_step
    n = 4
    x0 = torch.randn(n, 2)
    rollouts = Rollouts([""] * n, torch.zeros(n, dtype=torch.long), x0.unsqueeze(1), torch.zeros(n, 3),
                        adapter.sigmas(3), [], adapter.encode([""] * n, None, 1.0), media=x0, latent_steps=[3])
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    stepper = Stepper(Accelerator(cpu=True), optimizer, params, NonFiniteGuard(0), syncing_module=adapter.transformer,
                      step_snapshots={"ema_ref": (ema_ref, algo.step_snapshots["ema_ref"])})
    _, steps = optimize_epoch(algo, policy, rollouts, advantages, OptimizeSettings(batch_size=4, max_grad_norm=10.0),
                              stepper, epoch=0, steps_before=5)
    assert steps == 3 and len(after_each_step) == 3
    expected = start
    for k, theta in zip((5, 6, 7), after_each_step):
        d = min(0.3, 0.05 * k)
        assert ema_ref_decay(0.3, 0.05, k) == pytest.approx(d)
        expected = [d * w + (1 - d) * p for w, p in zip(expected, theta)]
    for a, b in zip(ema_ref.weights, expected):
        torch.testing.assert_close(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(ema_ref.weights, after_each_step[-1]))


def test_the_rollout_samples_with_the_fast_ema_after_switch_ema_ref_steps():
    algo = DGPO(cfg(), ODE())  # clip_dsm keeps the fast EMA; Flow-Factory's switch at 200
    assert set(algo.step_snapshots) == {"ema_ref"} and algo.step_snapshots["ema_ref"](2) == pytest.approx(0.002)
    assert [algo.sampling_snapshot(s) for s in (0, 200, 201)] == [None, None, "ema_ref"]
    assert DGPO(cfg(switch_ema_ref=None), ODE()).sampling_snapshot(10 ** 6) is None
    without = DGPO(cfg(clip_dsm=False), ODE())  # nothing reads an EMA: none is kept or sampled with
    assert without.step_snapshots == {} and without.sampling_snapshot(10 ** 6) is None


# ------------------------------------------------------------------------ config
def minimal(**train) -> dict:
    return base_config(train={"trainer_type": "dgpo", "group_size": 2, "num_inference_steps": 10, **train})


def test_flow_factory_defaults():
    from flow_factory.config import parse_config

    train = parse_config(minimal()).train
    assert (train.dpo_beta, train.use_shared_noise, train.clip_dsm, train.clip_kl, train.kl_cfg) == (
        100.0, True, True, False, 1.0)
    # Flow-Factory's hparams/training_args/dgpo.py
    assert (train.switch_ema_ref, train.use_ema_ref, train.ema_ref_max_decay, train.ema_ref_ramp_rate) == (
        200, False, 0.3, 0.001)
    assert (train.timestep_range, train.time_shift, train.time_sampling_strategy) == (0.6, 3.0, "discrete")
    assert (train.kl_type if "kl_type" in train.model_fields_set else "v-based") == "v-based"
    assert train.global_std and train.advantage_aggregation == "gdpo"
    cfg = parse_config(minimal(num_train_timesteps=0))
    assert cfg.trained_steps_per_sample == 6  # 10 steps x 0.6


def test_kl_cfg_above_one_and_the_fast_ema_load_and_encode_the_negative_branch():
    from flow_factory.config import parse_config

    train = parse_config(minimal(kl_cfg=4.5, guidance_scale=1.0, use_ema_ref=True, switch_ema_ref=0,
                                 ema_ref_max_decay=0.5, ema_ref_device="same_as_model")).train
    assert (train.kl_cfg, train.use_ema_ref, train.ema_ref_max_decay, train.ema_ref_device) == (4.5, True, 0.5, "same")
    assert train.conditioning_guidance_scale == 4.5  # the guided reference needs the negative prompts
    assert parse_config(minimal(guidance_scale=3.0)).train.conditioning_guidance_scale == 3.0
    crd = parse_config(base_config(train={"trainer_type": "crd", "group_size": 2, "guidance_scale": 2.0})).train
    assert crd.kl_cfg == 4.5 and crd.conditioning_guidance_scale == 4.5  # Flow-Factory's crd default


@pytest.mark.parametrize("train,processes,message", [
    ({"per_device_batch_size": 2, "group_size": 4}, 1, "must hold whole groups, but group_size is 4; use a multiple "
                                                       "of 4"),
    ({"per_device_batch_size": 3, "group_size": 4, "unique_sample_num_per_epoch": 3}, 2, "use a multiple of 2"),
    ({"ema_ref_max_decay": 1.5}, 1, "ema_ref_max_decay"),
    ({"trainer_type": "nft", "dpo_beta": 10.0}, 1, "dgpo's"),
    ({"trainer_type": "nft", "ema_ref_ramp_rate": 0.01}, 1, "dgpo's"),
])
def test_what_cannot_work_is_refused_with_its_reason(train, processes, message):
    from flow_factory.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=message):
        parse_config({**minimal(**train), "num_processes": processes})


def test_a_group_spread_over_processes_loads():
    """Flow-Factory's nocfg example's geometry: 4 processes x 12 samples = 2 groups of 24."""
    from flow_factory.config import parse_config

    cfg = parse_config({**minimal(per_device_batch_size=12, group_size=24, unique_sample_num_per_epoch=24),
                        "num_processes": 4})
    assert cfg.batches_per_epoch == 12


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
    assert micro == cfg.micro_steps_per_epoch == 6  # 2 micro-batches x 3 timesteps


def test_dgpo_keys_are_refused_for_a_coupled_trainer_too():
    from flow_factory.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match="clip_dsm are dgpo's; grpo does not use them"):
        parse_config(minimal(trainer_type="grpo", clip_dsm=False))
