"""A toy flow model for learning tests and benches: seconds on a CPU. Used by
tests/test_toy_learning.py and bench/toy_algorithms.py.

``ToyAdapter`` is a real ``FlowAdapter`` around a small MLP velocity field on 2-D
"latents", so the real rollout loop, dynamics, algorithms, ``AdapterPolicy`` (full
fine-tuning, frozen reference copy) and the shared ``optimize_epoch`` loop all run
unchanged. The reward ``-|x0 - TARGET|^2`` has a known optimum (0, at ``TARGET``);
the untrained model samples roughly N(0, I), a mean reward near ``-(2 + |TARGET|^2)``.
"""

from __future__ import annotations

import contextlib

from types import SimpleNamespace

import torch
from accelerate import Accelerator
from torch import Tensor, nn

from flow_factory.advantages import combine_advantages
from flow_factory.algorithms import make_algorithm
from flow_factory.config.train import TrainConfig
from flow_factory.dynamics import make_dynamics
from flow_factory.guards import NonFiniteGuard
from flow_factory.models.base import ExpertCalls, FlowAdapter
from flow_factory.models.conditioning import Conditioning
from flow_factory.trajectory import TrajectoryOptions, sample_trajectory
from flow_factory.sampling import Rollouts
from flow_factory.trainer.ema import WeightCopy
from flow_factory.trainer.optimize import OptimizeSettings, Stepper, optimize_epoch
from flow_factory.trainer.policy import AdapterPolicy, PolicyWeights

TARGET = torch.tensor([1.5, -1.0])


class ToyVelocity(nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, 2))

    def forward(self, x: Tensor, sigma: Tensor) -> Tensor:
        return self.net(torch.cat([x, sigma.reshape(-1, 1).expand(len(x), 1)], dim=1))


class ToyAdapter(FlowAdapter):
    model_type = "toy"
    default_lora_targets: list[str] = []

    def __init__(self, module: nn.Module):  # no diffusers pipeline: just the velocity network
        self.pipeline = SimpleNamespace(transformer=module)
        self.device, self.dtype, self.callers, self.expert_calls = torch.device("cpu"), torch.float32, {}, ExpertCalls()

    def encode(self, prompts, negative_prompts, guidance_scale) -> Conditioning:
        return {"prompt_embeds": torch.zeros(len(prompts), 1)}

    def latent_shape(self, height, width, num_frames=None):
        return (2,)

    def sigmas(self, num_steps, height=0, width=0, num_frames=None) -> Tensor:
        return torch.linspace(1.0, 0.0, num_steps + 1)

    def velocity(self, latents, sigma, cond, guidance_scale) -> Tensor:
        return self.denoiser(latents.float(), torch.as_tensor(sigma, dtype=torch.float32)).float()

    def decode(self, latents):
        return latents


def toy_reward(x0: Tensor) -> Tensor:
    return -((x0 - TARGET) ** 2).sum(dim=1)


def train_toy(trainer_type: str, seed: int, epochs: int = 30, dynamics: str | None = None, groups: int = 8,
              group_size: int = 8, num_steps: int = 8, lr: float = 3e-3, accumulation: int = 1,
              sgd: bool = False, max_grad_norm: float = 1.0, **train) -> list[float]:
    """Trains a fresh toy model; returns the mean reward of each epoch's rollouts, then of a final one.
    ``sgd``: plain SGD instead of Adam (whose steps ignore the gradient's scale)."""
    torch.manual_seed(seed)
    adapter = ToyAdapter(ToyVelocity())
    coupled = trainer_type in ("grpo", "grpo-guard")
    name = dynamics or ("Flow-SDE" if coupled else "ODE")
    cfg = TrainConfig(**{"clip_range": 0.2, "kl_type": "v-based", "nft_beta": 1.0, "beta": 2000.0,
                         "num_train_timesteps": 4, "time_sampling_strategy": "uniform", "time_shift": 1.0,
                         "timestep_range": [0.0, 1.0], "num_inference_steps": num_steps, "group_size": group_size,
                         "per_device_batch_size": groups * group_size, **train})
    dyn = make_dynamics(name, 0.7 if name != "ODE" else 0.0)
    algorithm = make_algorithm(trainer_type, cfg, dyn)
    params = [p for p in adapter.transformer.parameters()]
    for p in params:
        p.requires_grad_(True)
    rollout_weights = WeightCopy(params)
    # CRD's old / sampling models (moved per epoch), DGPO's fast old-policy EMA (per optimizer step)
    snapshots = {name: WeightCopy(params) for name in {**algorithm.weight_snapshots, **algorithm.step_snapshots}}
    policy = AdapterPolicy(adapter, 1.0, "full", keep_reference=algorithm.needs_reference,
                           weights=PolicyWeights(sampling=rollout_weights, snapshots=snapshots))
    optimizer = torch.optim.SGD(params, lr=lr) if sgd else torch.optim.Adam(params, lr=lr)
    acc = Accelerator(cpu=True)
    n = groups * group_size
    group_ids = torch.arange(groups).repeat_interleave(group_size)
    sigmas = adapter.sigmas(num_steps)
    cond = adapter.encode([""] * n, None, 1.0)
    history, steps = [], 0
    for epoch in range(epochs + 1):
        gen = torch.Generator().manual_seed(seed * 100003 + epoch)
        noise = torch.randn(n, 2, generator=gen)
        rollout_weights.copy_from_params()
        sampling = algorithm.sampling_snapshot(steps)
        with snapshots[sampling].applied() if sampling else contextlib.nullcontext():
            traj = sample_trajectory(adapter, dyn, cond, noise, sigmas, 1.0, generator=gen,
                                     options=TrajectoryOptions(record_means=algorithm.records_step_means,
                                                               keep_states=algorithm.kept_states(num_steps, None)))
        rewards = toy_reward(traj.final)
        history.append(rewards.mean().item())
        if epoch == epochs:
            break
        rollouts = Rollouts([""] * n, group_ids, traj.latents, traj.log_probs, traj.sigmas, traj.sde_steps, cond,
                            media=traj.final, means=traj.means, latent_steps=traj.latent_steps)
        advantages = combine_advantages({"r": rewards}, {"r": 1.0}, group_ids, "sum", False)
        settings = OptimizeSettings(batch_size=n, accumulation=accumulation, max_grad_norm=max_grad_norm,
                                    steps_per_call=cfg.steps_per_call, seed=seed)
        stepper = Stepper(acc, optimizer, params, NonFiniteGuard(0), syncing_module=adapter.transformer,
                          step_snapshots={k: (snapshots[k], d) for k, d in algorithm.step_snapshots.items()})
        _, done = optimize_epoch(algorithm, policy, rollouts, advantages, settings, stepper, epoch=epoch,
                                 steps_before=steps)
        steps += done
        for name, decay_of in algorithm.weight_snapshots.items():
            snapshots[name].update(decay_of(steps))
    return history
