"""ff-train --plan of a distillation run (plan/roles.py): the other roles' weights, optimizer state, gradients and
copies, and each phase's transformer calls, against the real roles built on tiny SD3 and the real losses run."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from flow_factory.algorithms import make_algorithm
from flow_factory.config import parse_config
from flow_factory.dynamics import ODE
from flow_factory.models import load_adapter
from flow_factory.models.lora import make_trainable
from flow_factory.plan import make_plan
from flow_factory.plan.measure import Measured
from flow_factory.sampling import Rollouts
from flow_factory.trainer.policy import AdapterPolicy
from flow_factory.trainer.roles import Roles
from flow_factory.trajectory import sample_trajectory

from helpers_runs import tiny_run_config


def distillation_config(tmp, model_path, name: str, finetune: str, optimizers=(), **train):
    train = {"trainer_type": name, "num_inference_steps": 2, "group_size": 1, "guidance_scale": 1.0,
             "real_guidance_scale": 2.0, "ttur_fake_updates": 2, "unique_sample_num_per_epoch": 4, **train}
    config = tiny_run_config(tmp, "sd3-5", model_path, **train)
    config["scheduler"] = {"dynamics_type": "ODE"}
    config["model"]["finetune_type"] = finetune
    if name != "tdm-r1":  # data-free
        del config["rewards"]
    config["optimizers"] = list(optimizers)
    return parse_config(config)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def real_rollouts(adapter, n: int, steps: int, group_size: int, guidance: float) -> Rollouts:
    """The generator's own ODE rollouts of ``n`` samples (the losses replay their steps)."""
    cond = adapter.encode(["a red circle"] * n, None, 2.0)
    noise = adapter.initial_noise(n, 64, 64, torch.Generator().manual_seed(0))
    traj = sample_trajectory(adapter, ODE(), cond, noise, adapter.sigmas(steps, 64, 64), guidance)
    return Rollouts(prompts=["a red circle"] * n, group_ids=torch.arange(n) // group_size, latents=traj.latents,
                    log_probs=traj.log_probs, sigmas=traj.sigmas, sde_steps=[], cond=cond,
                    media=torch.zeros(n, 3, 64, 64), sample_ids=torch.arange(n))


@pytest.mark.parametrize("name, finetune, train", [
    ("dmd2", "lora", {"optimizers": [{"name": "fake", "ema_decay": 0.9}]}),
    ("tdm-r1", "full", {"group_size": 2, "per_device_batch_size": 4, "unique_sample_num_per_epoch": 2}),
])
def test_the_plan_counts_the_roles_as_the_run_holds_and_calls_them(tmp_path, tiny_sd3_path, name, finetune, train):
    cfg = distillation_config(tmp_path, tiny_sd3_path, name, finetune, **train)
    plan = make_plan(cfg, device="cpu", calls={"rollout": Measured(0, 0), "decode": Measured(0, 0)})
    adapter = load_adapter("sd3-5", tiny_sd3_path)
    make_trainable(adapter, cfg, torch.float32)
    roles = Roles.of(cfg, adapter, torch.float32)
    policy = Roles.started(roles, AdapterPolicy(adapter, cfg.train.loss_guidance_scale, finetune, False), "ddp", None)
    algorithm = make_algorithm(name, cfg.train, ODE())
    n, steps = cfg.train.per_device_batch_size, cfg.train.num_inference_steps
    rollouts = real_rollouts(adapter, n, steps, cfg.train.group_size, cfg.train.guidance_scale)
    advantages = torch.linspace(-1.0, 1.0, n)
    units = algorithm.training_units(rollouts.group_ids, advantages)[:algorithm.units_per_chunk(n)]

    # each phase's pass over one chunk: the real loss and its backward, FLOPs counted; each role's optimizer steps
    held, grads, flops = {}, [], {}
    for role, _ in algorithm.phases:
        with roles.active(role), FlopCounterMode(display=False) as counter:
            for batch in algorithm.micro_batches(rollouts, advantages, units, torch.Generator().manual_seed(0),
                                                 role=role):
                algorithm.loss(policy, batch)[0].backward()
        flops[role] = counter.get_total_flops()
        grads.append(nbytes(p.grad for p in roles.params[role] if p.grad is not None))
        if role == "generator":
            continue
        roles.optimizers[role].step()
        held[f"{role}: weights"] = nbytes(roles.params[role])
        held[f"{role}: optimizer state"] = nbytes(t for state in roles.optimizers[role].state.values()
                                                  for key, t in state.items() if key != "step")
        roles.optimizers[role].zero_grad(set_to_none=True)
    held.update({f"{role}: slow copy": nbytes(slow.weights) for role, slow in roles.slow.items()})
    held.update({f"{role}: EMA": nbytes(ema.weights) for role, ema in roles.emas.items()})
    if finetune == "full":
        held["teacher: frozen copy"] = nbytes(roles.frozen_teacher.parameters())

    assert {part: size for part, (size, where, _) in plan.sizes.roles.items()} == held
    assert plan.sizes.role_gradients == max(grads[:-1]) and grads[-1] == plan.sizes.gradient_bytes
    for role, _ in algorithm.phases:
        assert plan.calls[f"{role} pass"].flops == flops[role] > 0, role
    # the epoch: 4 samples in chunks of per_device_batch_size, each through 2 fake passes and one of each other role
    chunks = 4 // n
    expected = chunks * sum((2 if role == "fake" else 1) * flops[role] for role, _ in algorithm.phases)
    assert plan.flops["training"] == expected
    training = plan.memory("multi_gpu")["training"]
    assert all(training[part] == size for part, size in held.items())
    if finetune == "lora":  # under fsdp2 each role's adapters are shards of the one sharded transformer
        sharded = dataclasses.replace(plan, num_processes=2).memory("fsdp2")["training"]
        assert all(sharded[part] == size // 2 for part, size in held.items())


def test_the_other_roles_count_whole_beside_deepspeeds_engine_and_split_under_fsdp2():
    """Under DeepSpeed ZeRO-1/2 a distillation run's other roles train beside the engine (trainer/roles.py): their
    weights, AdamW state and gradients whole on every GPU; FSDP2 shards them with the transformer."""
    from flow_factory.plan.memory import Network, Sizes, per_gpu

    sizes = Sizes(networks=[Network("transformer", params=1000, load_bytes=2, trained=100)], text_encoders=0,
                  other_networks=0, rewards=0, optimizer_bytes=8, role_gradients=400,
                  roles={"fake: weights": (400, "gpu", "weights"), "fake: optimizer state": (800, "gpu", "optimizer")})
    for backend in ("zero1", "zero2", "zero2_offload"):
        training = per_gpu(sizes, backend, 4)["training"]
        assert (training["fake: weights"], training["fake: optimizer state"], training["gradients"]) == (400, 800, 400)
    training = per_gpu(sizes, "fsdp2", 4)["training"]
    assert (training["fake: weights"], training["fake: optimizer state"], training["gradients"]) == (100, 200, 100)
