"""A small stand-in for an epoch's rollouts, for the algorithms' micro-batch tests; a coupled batch of whole
trajectories at one step; the on-policy check (invariant 1) that the adapter, conditioned-model and compile
tests share; and GRPO's loss made NaN once, for the non-finite guard's tests."""

from contextlib import nullcontext

import torch

from flow_factory.algorithms.base import TrainBatch
from flow_factory.sampling import Rollouts


def rollouts_of(latents: torch.Tensor, sigmas: torch.Tensor, cond: dict) -> Rollouts:
    """An epoch's rollouts holding ``latents`` (N, T + 1, *latent), every state, of an ODE rollout."""
    n = len(latents)
    return Rollouts(prompts=[""] * n, group_ids=torch.arange(n), latents=latents,
                    log_probs=torch.zeros(n, len(sigmas) - 1), sigmas=sigmas, sde_steps=[], cond=cond,
                    media=torch.empty(0))


def toy_rollouts(n: int) -> Rollouts:
    """``n`` samples of a 2-step ODE rollout: (n, 3, 2, 2) latents (last = x0), sigmas 1 -> 0, and
    a conditioning row per sample holding its index, so a test can tell which samples a batch holds."""
    gen = torch.Generator().manual_seed(0)
    return rollouts_of(torch.randn(n, 3, 2, 2, generator=gen), torch.linspace(1, 0, 3),
                       {"prompt_embeds": torch.arange(n).float().unsqueeze(1)})


def batch_at_step(latents: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                  sigmas: torch.Tensor, cond: dict, step: int, old_means: torch.Tensor | None = None) -> TrainBatch:
    """The coupled batch of whole trajectories ``latents`` (B, T + 1, *latent) at ``step`` (what
    ``Algorithm.micro_batches`` yields for every sample of a rollout that kept every state)."""
    n = len(latents)
    return TrainBatch(x=latents[:, step], x_next=latents[:, step + 1], sigma=sigmas[step].expand(n),
                      sigma_next=sigmas[step + 1].expand(n), old_log_prob=old_log_probs[:, step],
                      advantages=advantages, cond=cond, step=torch.full((n,), step, dtype=torch.long),
                      old_mean=None if old_means is None else old_means[:, step])


def perturb_lora(transformer, scale: float = 0.05, which: str = "lora_B", seed: int = 0) -> None:
    """LoRA B starts at zero: give the ``which`` matrices weight, so the policy differs from the base model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if which in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def grpo_on_perturbed_lora(adapter, dynamics, guidance_scale: float):
    """(GRPO's loss, the LoRA policy of ``adapter``) with LoRA put on its transformer and given weight
    (``perturb_lora``), so the policy differs from the base model: what the on-policy check runs."""
    from flow_factory.algorithms import make_algorithm
    from flow_factory.config.train import TrainConfig
    from flow_factory.models import apply_lora
    from flow_factory.trainer.policy import AdapterPolicy

    apply_lora(adapter.transformer, 4, 4, "default", adapter.default_lora_targets)
    perturb_lora(adapter.transformer, 0.05)
    algorithm = make_algorithm("grpo", TrainConfig(kl_type="v-based"), dynamics)
    return algorithm, AdapterPolicy(adapter, guidance_scale, "lora", keep_reference=False)


def assert_on_policy(algorithm, policy, traj, cond, backward: bool = False, autocast=nullcontext) -> None:
    """At every stochastic step of ``traj``, the importance ratio of the policy that sampled it is 1
    (within 1e-6); ``backward``: each step's loss is backpropagated too; ``autocast``: the networks'
    precision, as in sampling."""
    for step in traj.sde_steps:
        advantages = torch.tensor([1.0, -1.0], device=traj.latents.device)
        batch = batch_at_step(traj.latents, traj.log_probs, advantages, traj.sigmas, cond, step)
        with autocast():
            loss, metrics = algorithm.loss(policy, batch)
        assert abs(metrics["ratio_min"].item() - 1) < 1e-6 and abs(metrics["ratio_max"].item() - 1) < 1e-6, \
            (step, metrics)
        if backward:
            loss.backward()


def nan_on_first_call(loss):
    """``loss`` (an ``Algorithm.loss``) whose first call's loss is NaN: one non-finite gradient, from the data."""
    seen = []

    def loss_nan_once(self, policy, batch):
        value, metrics = loss(self, policy, batch)
        seen.append(1)
        return (value * float("nan") if len(seen) == 1 else value), metrics

    return loss_nan_once
