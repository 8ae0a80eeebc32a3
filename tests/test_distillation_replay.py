"""The rollout replay of dmd2, tdm and tdm-r1 (``train.replay_rtol`` / ``replay_atol``,
algorithms/distillation/replay.py): the generator's step recomputed from its rollout's stored state must land on
the rollout's next state, else the loss stops with an error naming the keys."""

from types import SimpleNamespace

import pytest
import torch

from flow_factory.algorithms import make_algorithm
from flow_factory.algorithms.distillation.replay import ReplayMismatch, check_replay
from flow_factory.config import ConfigError
from flow_factory.dynamics import ODE
from flow_factory.models import load_adapter
from flow_factory.models.lora import make_trainable
from flow_factory.trainer.policy import AdapterPolicy
from flow_factory.trainer.roles import Roles

from test_plan_roles import distillation_config, real_rollouts

X, V = torch.tensor([[1.0, -2.0]]), torch.tensor([[2.0, 4.0]])
SIGMA, SIGMA_NEXT = torch.tensor([0.5]), torch.tensor([0.25])
LANDS = torch.tensor([[0.5, -3.0]])  # x + v (0.25 - 0.5), by hand


def replay(x_next, stored_in=torch.float32, v=V, tolerances=(1e-4, 1e-4)):
    batch = SimpleNamespace(x=X, sigma=SIGMA, sigma_next=SIGMA_NEXT, x_next=x_next, stored_in=stored_in)
    check_replay(ODE(), batch, v, tolerances, "test")


def test_the_step_must_land_within_the_tolerances_of_the_stored_state():
    replay(LANDS)
    replay(LANDS + torch.tensor([[0.0, 3.9e-4]]))  # within atol + rtol |x_next| = 1e-4 + 3e-4 (and 1.8e-7)
    with pytest.raises(ReplayMismatch, match=r"row 0, sigma 0.5 -> 0.25\) lands 0.0005 .*train.replay_atol 0.0001"
                                             r" \+ train.replay_rtol 0.0001"):
        replay(LANDS + torch.tensor([[0.0, 5e-4]]))
    replay(LANDS + torch.tensor([[0.0, 5e-4]]), tolerances=(1e-4, 1e-3))  # a larger atol lets it through
    # a rollout stored in fp16 rounded its state: half an fp16 spacing (4.9e-4 of the value) more is allowed
    replay(LANDS + torch.tensor([[0.0, 1.5e-3]]), stored_in=torch.float16)
    with pytest.raises(ReplayMismatch, match="float16 spacing"):
        replay(LANDS + torch.tensor([[0.0, 2.0e-3]]), stored_in=torch.float16)
    replay(LANDS, v=torch.tensor([[2.0, float("nan")]]))  # a NaN velocity is the non-finite guards' to skip


@pytest.mark.parametrize("name", ["dmd2", "tdm"])
def test_a_generator_that_moved_since_its_rollout_fails_the_replay(tmp_path, tiny_sd3_path, name):
    cfg = distillation_config(tmp_path, tiny_sd3_path, name, "lora")
    adapter = load_adapter("sd3-5", tiny_sd3_path)
    make_trainable(adapter, cfg, torch.float32)
    roles = Roles.of(cfg, adapter, torch.float32)
    policy = Roles.started(roles, AdapterPolicy(adapter, cfg.train.loss_guidance_scale, "lora", False), "ddp", None)
    algorithm = make_algorithm(name, cfg.train, ODE())
    n, steps = cfg.train.per_device_batch_size, cfg.train.num_inference_steps
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a generator of its own (lora_B starts at 0: the base)
        for p in roles.params["generator"]:
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    rollouts = real_rollouts(adapter, n, steps, 1, cfg.train.guidance_scale)  # sampled by that generator
    units = algorithm.training_units(rollouts.group_ids, torch.zeros(n))

    def losses():  # every phase of one optimizer step over the chunk (tdm's fake phase reads the generator too)
        for role, _ in algorithm.phases:
            with roles.active(role):
                for batch in algorithm.micro_batches(rollouts, torch.zeros(n), units, torch.Generator(), role=role):
                    algorithm.loss(policy, batch)

    losses()
    with torch.no_grad():  # the generator moves after its rollout: its steps no longer land on the stored states
        for p in roles.params["generator"]:
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    with pytest.raises(ReplayMismatch, match=f"{name}'s .*train.replay_atol"):
        losses()
    algorithm.cfg = cfg.train.model_copy(update={"replay_atol": 10.0})  # tolerances wide enough: it trains on
    losses()


@pytest.mark.parametrize("name", ["dmd2", "tdm", "tdm-r1"])
def test_one_generator_step_per_epoch_of_rollouts(tmp_path, tiny_sd3_path, name):
    """A second optimizer step in an epoch would train on rollouts the first one moved the generator away from
    (tiny SD3 at lr 0.05: 1.0e-3 off, 1.7e-4 allowed): refused before anything loads, as upstream samples afresh
    for every generator update."""
    with pytest.raises(ConfigError, match=r"train.gradient_step_per_epoch / gradient_accumulation_steps: .* got 2"):
        distillation_config(tmp_path, tiny_sd3_path, name, "lora", gradient_step_per_epoch=2,
                            **({"group_size": 2} if name == "tdm-r1" else {}))
