"""DESIGN invariant 1: on-policy, the importance ratio is exactly 1, for every adapter
and every SDE dynamics, because sampling and training call the same velocity()."""

import pytest
import torch

from flow_factory.algorithms import make_algorithm
from flow_factory.algorithms.base import TrainBatch
from flow_factory.config.train import TrainConfig
from flow_factory.dynamics import make_dynamics
from flow_factory.models import load_adapter
from flow_factory.models.lora import apply_lora
from flow_factory.rollout import sample_trajectory
from flow_factory.trainer.policy import AdapterPolicy

ADAPTERS = [("sd3-5", "tiny_sd3_path", 64, None, 3.0), ("flux1", "tiny_flux_path", 64, None, 3.5),
            ("wan2_t2v", "tiny_wan_path", 32, 5, 3.0)]
TRAIN = TrainConfig(kl_type="v-based")  # defaults: clip_range 1e-4, adv_clip_range 5, no KL


def _perturb_lora(transformer, seed=0):
    """LoRA B starts at zero; give it weight so the policy differs from the base model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


@pytest.mark.parametrize("dynamics_name", ["Flow-SDE", "Dance-SDE", "CPS"])
@pytest.mark.parametrize("model_type,path_fixture,size,frames,guidance", ADAPTERS)
def test_on_policy_ratio_is_one(request, model_type, path_fixture, size, frames, guidance, dynamics_name):
    adapter = load_adapter(model_type, request.getfixturevalue(path_fixture))
    apply_lora(adapter.transformer, 4, 4, "default", adapter.default_lora_targets)
    _perturb_lora(adapter.transformer)
    dynamics = make_dynamics(dynamics_name, 0.7)
    algorithm = make_algorithm("grpo", TRAIN, dynamics)
    policy = AdapterPolicy(adapter, guidance, "lora", keep_reference=False)

    cond = adapter.encode(["a red cube", "a blue ball"], None, guidance)
    noise = adapter.initial_noise(2, size, size, torch.Generator().manual_seed(1), num_frames=frames)
    sigmas = adapter.sigmas(3, size, size, frames)
    traj = sample_trajectory(adapter, dynamics, cond, noise, sigmas, guidance,
                             generator=torch.Generator().manual_seed(2))
    assert traj.sde_steps == [0, 1, 2]
    for step in traj.sde_steps:
        batch = TrainBatch(traj.latents, traj.log_probs, torch.tensor([1.0, -1.0]), traj.sigmas, cond, step)
        _, metrics = algorithm.loss(policy, batch)
        assert abs(metrics["ratio_min"].item() - 1) < 1e-6 and abs(metrics["ratio_max"].item() - 1) < 1e-6, \
            (step, metrics)
