"""Batched training steps (``train.steps_per_call``): several trained steps of a micro-batch go
through the transformer in one call, with the loss and the gradients of one call per step.

Checked on the tiny SD3 pipeline with a perturbed LoRA (so the policy, its reference, the
rollout's weights, CRD's snapshots and DGPO's fast EMA all differ), for every algorithm: the per-step batches
and their merge give the same summed loss and the same gradient, to float32 rounding (a
batch of 4 steps is one matrix product instead of 4, summed in another order; a gradient
entry sums thousands of terms, some cancelling, so it is compared to 1e-4 of the largest
entry, while a missing or doubled step would be off by a third or more); and the
on-policy ratio is 1 within 1e-6 with every step in one call (invariant 1)."""

import pytest
import torch

from flow_factory.algorithms import make_algorithm
from flow_factory.algorithms.base import merge_batches
from flow_factory.config.train import TrainConfig
from flow_factory.dynamics import make_dynamics
from flow_factory.models import load_adapter
from flow_factory.models.lora import apply_lora
from flow_factory.trajectory import TrajectoryOptions, sample_trajectory
from flow_factory.sampling import Rollouts
from flow_factory.trainer.ema import WeightCopy
from flow_factory.trainer.policy import AdapterPolicy, PolicyWeights

PROMPTS = ["a red cube", "a blue ball", "a green cone", "a white star"]
GROUPS = torch.tensor([0, 0, 1, 1])
ADVANTAGES = torch.tensor([1.0, -0.5, 0.8, -1.2])
STEPS = 5
# algorithm, dynamics, extra train settings
CASES = {
    "grpo": ("Flow-SDE", dict(kl_beta=0.1, kl_type="x-based")),
    "grpo-guard": ("Flow-SDE", dict()),
    "dppo": ("CPS", dict(kl_mask_threshold=0.0, kl_mask_type="v-based", kl_beta=0.1, kl_guidance_scale=2.0)),
    "grpo-outside-kl": ("Dance-SDE", dict(outside_kl_beta=0.2, kl_beta=0.1, kl_type="v-based")),
    "nft": ("ODE", dict(kl_beta=0.1)),
    "awm": ("ODE", dict(ema_kl_beta=0.0, kl_beta=0.1)),
    "dpo": ("ODE", dict()),
    "dgpo": ("ODE", dict(clip_dsm=True, kl_beta=0.1)),
    "crd": ("ODE", dict(kl_beta=0.1)),
}


def _perturb(transformer, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def _setup(tiny_sd3_path, case):
    name, (dynamics_name, extra) = case, CASES[case]
    trainer_type = "grpo" if name == "grpo-outside-kl" else name
    settings = dict(trainer_type=trainer_type, num_inference_steps=STEPS, group_size=2, per_device_batch_size=4,
                    num_train_timesteps=4, clip_range=0.2, **extra)
    cfg = TrainConfig(**settings)
    dynamics = make_dynamics(dynamics_name, 0.7 if dynamics_name != "ODE" else 0.0)
    algorithm = make_algorithm(trainer_type, cfg, dynamics)

    adapter = load_adapter("sd3-5", tiny_sd3_path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the LoRA's initial weights: the same case on every run
        apply_lora(adapter.transformer, 4, 4, "default", adapter.default_lora_targets)
    params = [p for p in adapter.transformer.parameters() if p.requires_grad]
    # the rollout's weights, CRD's snapshots, DGPO's fast EMA: each a different point near the starting LoRA
    _perturb(adapter.transformer, 1)
    sampling = WeightCopy(params)
    snapshots = {}
    for i, snap in enumerate({**algorithm.weight_snapshots, **algorithm.step_snapshots}):
        _perturb(adapter.transformer, 10 + i)
        snapshots[snap] = WeightCopy(params)
    _perturb(adapter.transformer, 2)
    policy = AdapterPolicy(adapter, 3.0, "lora", keep_reference=False,
                           weights=PolicyWeights(sampling=sampling, snapshots=snapshots))

    cond = adapter.encode(PROMPTS, None, 3.0)
    noise = adapter.initial_noise(4, 64, 64, torch.Generator().manual_seed(3))
    sigmas = adapter.sigmas(STEPS, 64, 64)
    sde_steps = [0, 1, 3] if algorithm.coupled else None  # leaves steps outside for outside_kl_beta
    with sampling.applied():
        traj = sample_trajectory(adapter, dynamics, cond, noise, sigmas, 3.0,
                                 generator=torch.Generator().manual_seed(4),
                                 options=TrajectoryOptions(sde_steps, record_means=algorithm.records_step_means,
                                                           keep_states=algorithm.kept_states(STEPS, sde_steps)))
    rollouts = Rollouts(PROMPTS, GROUPS, traj.latents, traj.log_probs, traj.sigmas, traj.sde_steps, cond,
                        media=torch.empty(0), means=traj.means, latent_steps=traj.latent_steps)
    return algorithm, policy, rollouts, params


def _loss_and_grads(algorithm, policy, rollouts, params, steps_per_call):
    units = algorithm.training_units(GROUPS, ADVANTAGES)
    batches = list(algorithm.micro_batches(rollouts, ADVANTAGES, units, torch.Generator().manual_seed(5)))
    assert len(batches) >= 3
    for p in params:
        p.grad = None
    total, calls = 0.0, 0
    for start in range(0, len(batches), steps_per_call):
        batch = merge_batches(batches[start:start + steps_per_call])
        loss, metrics = algorithm.loss(policy, batch)
        (loss * batch.parts).backward()  # what optimize_epoch backpropagates
        total += loss.item() * batch.parts
        calls += 1
    return total, [p.grad.clone() for p in params], metrics, calls


@pytest.mark.parametrize("case", list(CASES))
def test_merged_steps_give_the_per_step_loss_and_gradient(tiny_sd3_path, case):
    algorithm, policy, rollouts, params = _setup(tiny_sd3_path, case)
    per_step, per_step_grads, _, calls = _loss_and_grads(algorithm, policy, rollouts, params, 1)
    merged, merged_grads, _, merged_calls = _loss_and_grads(algorithm, policy, rollouts, params, 100)
    assert merged_calls == 1 and calls > 1
    # a merged call's matmuls have other shapes, so other blocking and float32 rounding (2e-5 relative seen
    # on some CPUs for DPO's and DGPO's losses, whose beta amplifies the difference of two errors)
    assert merged == pytest.approx(per_step, rel=2e-4, abs=1e-7)
    scale = max(g.abs().max().item() for g in per_step_grads)
    assert scale > 0
    for a, b in zip(per_step_grads, merged_grads):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4 * scale)


@pytest.mark.parametrize("dynamics_name", ["Flow-SDE", "Dance-SDE", "CPS"])
def test_on_policy_ratio_is_one_with_every_step_in_one_call(tiny_sd3_path, dynamics_name):
    """Invariant 1 with batching on: the rollout's weights, all trained steps merged into one call."""
    algorithm, policy, rollouts, params = _setup(tiny_sd3_path, "grpo")
    algorithm.dynamics = make_dynamics(dynamics_name, 0.7)
    with policy.sampling_weights.applied():  # sample and train with the same weights
        traj = sample_trajectory(policy.adapter, algorithm.dynamics, rollouts.cond, rollouts.latents_at(
            torch.arange(4), 0), rollouts.sigmas, 3.0, generator=torch.Generator().manual_seed(6),
            options=TrajectoryOptions(sde_steps=[0, 1, 2, 3]))
        rollouts = Rollouts(PROMPTS, GROUPS, traj.latents, traj.log_probs, traj.sigmas, traj.sde_steps,
                            rollouts.cond, media=torch.empty(0))
        units = algorithm.training_units(GROUPS, ADVANTAGES)
        batch = merge_batches(list(algorithm.micro_batches(rollouts, ADVANTAGES, units, torch.Generator())))
        assert batch.parts == 4 and sorted(set(batch.step.tolist())) == [0, 1, 2, 3]
        _, metrics = algorithm.loss(policy, batch)
    assert abs(metrics["ratio_min"].item() - 1) < 1e-6 and abs(metrics["ratio_max"].item() - 1) < 1e-6, metrics


def test_merging_refuses_batches_that_disagree():
    from flow_factory.algorithms.dgpo import GroupBatch

    def batch(group_size):
        return GroupBatch(x0=torch.zeros(2, 1), noise=torch.zeros(2, 1), sigma=torch.zeros(2),
                          advantages=torch.zeros(2), cond={}, group=torch.zeros(2, dtype=torch.long),
                          group_size=group_size)
    assert merge_batches([batch(2), batch(2)]).parts == 2
    with pytest.raises(ValueError, match="field 'group_size' differs"):
        merge_batches([batch(2), batch(3)])


def test_merging_stops_at_each_optimizer_step():
    from flow_factory.algorithms import NoisedBatch
    from flow_factory.trainer.optimize import _merged

    def parts_of(steps_per_call, accumulation, n=7):
        batches = [NoisedBatch(x0=torch.full((1, 1), float(i)), noise=torch.zeros(1, 1), sigma=torch.zeros(1),
                               advantages=torch.zeros(1), cond={}) for i in range(n)]
        micro, merged = 0, []
        for batch in _merged(iter(batches), steps_per_call, lambda: accumulation - micro % accumulation):
            merged.append(batch.x0.flatten().tolist())
            micro += batch.parts
        return merged

    assert parts_of("all", 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert parts_of(2, 3) == [[0, 1], [2], [3, 4], [5], [6]]
    assert parts_of(1, 3) == [[i] for i in range(7)]
    assert parts_of("all", 100) == [list(range(7))]


@pytest.mark.parametrize("trainer_type", ["grpo", "nft"])
def test_training_with_merged_steps_follows_the_per_step_run(trainer_type):
    """The shared loop with gradient accumulation over 4 micro-steps: 8 trained steps per sample
    merged 4 at a time take the optimizer steps the per-step run takes (toy model, 3 epochs; plain
    SGD without clipping, so a gradient of the wrong scale shows)."""
    from toy import train_toy

    kwargs = dict(epochs=3, groups=4, group_size=4, accumulation=4, clip_range=0.2, sgd=True, lr=0.05,
                  max_grad_norm=1e9)
    if trainer_type == "nft":
        kwargs["num_train_timesteps"] = 8
    per_step = train_toy(trainer_type, 0, steps_per_call=1, **kwargs)
    merged = train_toy(trainer_type, 0, steps_per_call="all", **kwargs)
    assert per_step[-1] != per_step[0]  # it trained
    assert merged == pytest.approx(per_step, rel=1e-4)
