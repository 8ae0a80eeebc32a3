"""The sampling phase of an epoch: prompts -> trajectories -> decoded images -> rewards."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.base import Conditioning, cat_cond, index_cond
from ..rollout import sample_trajectory
from .seeding import generator, per_sample_noise
from .timer import PhaseTimer


@dataclass
class Rollouts:
    prompts: list[str]
    group_ids: Tensor  # (N,)
    latents: Tensor  # (N, T + 1, *latent)
    log_probs: Tensor  # (N, T)
    sigmas: Tensor  # (T + 1,)
    sde_steps: list[int]
    cond: Conditioning
    media: Tensor  # images (N, 3, H, W) or videos (N, F, 3, H, W) in [0, 1]
    means: Tensor | None = None  # (N, T, *latent) step means, for algorithms that ask for them
    rewards: dict[str, Tensor] | None = None  # raw score per reward name, (N,)


@torch.no_grad()
def collect_rollouts(
    adapter,
    dynamics,
    accelerator,
    items: list,  # PromptItem-like: .prompt, .negative_prompt
    group_ids: Tensor,
    sample_ids: list[int],  # global sample index of each item, for seeding
    *,
    seed: int,
    epoch: int,
    batch_size: int,
    height: int,
    width: int,
    num_frames: int | None,
    num_steps: int,
    guidance_scale: float,
    sde_steps: list[int] | None,
    same_latent: bool,
    timer: PhaseTimer,
    keep_trajectory: bool = True,
    record_means: bool = False,
    reward_set=None,
) -> Rollouts:
    """Sample ``items`` in micro-batches of ``batch_size``, decode, and score with ``reward_set``."""
    sigmas = adapter.sigmas(num_steps, height, width, num_frames).float()
    # async rewards start on each micro-batch as soon as it is decoded; the rest score at the end
    job = reward_set.start(group_ids) if reward_set is not None else None
    media_key = "videos" if adapter.is_video else "images"
    chunks = []
    for start in range(0, len(items), batch_size):
        batch = items[start:start + batch_size]
        ids = sample_ids[start:start + batch_size]
        groups = group_ids[start:start + batch_size]
        with timer.phase("sampling"):
            cond = _encode_unique(adapter, accelerator, batch, guidance_scale)
            keys = [("noise", seed, epoch, "group", int(g)) if same_latent else ("noise", seed, epoch, i)
                    for g, i in zip(groups.tolist(), ids)]
            noise = per_sample_noise(adapter, keys, height, width, num_frames)
            with accelerator.autocast():
                traj = sample_trajectory(adapter, dynamics, cond, noise, sigmas, guidance_scale, sde_steps,
                                         generator=generator("sde", seed, epoch, ids[0]),
                                         record_means=record_means, shared_rows=groups if same_latent else None)
        with timer.phase("decode"):
            media = adapter.decode(traj.final).float().cpu()
        chunks.append((traj, cond, media))
        if job is not None:
            with timer.phase("reward"):
                job.add([it.prompt for it in batch], **{media_key: media})

    trajs = [c[0] for c in chunks]
    rollouts = Rollouts(
        prompts=[it.prompt for it in items],
        group_ids=group_ids,
        latents=torch.cat([t.latents for t in trajs]) if keep_trajectory else torch.empty(0),
        log_probs=torch.cat([t.log_probs for t in trajs]),
        sigmas=sigmas,
        sde_steps=trajs[0].sde_steps,
        cond=cat_cond([c[1] for c in chunks]) if keep_trajectory else {},
        media=torch.cat([c[2] for c in chunks]),
        means=torch.cat([t.means for t in trajs]) if record_means else None,
    )
    if job is not None:
        with timer.phase("reward"):
            rollouts.rewards = {name: s.float().to(accelerator.device) for name, s in job.finish().items()}
    return rollouts


def _encode_unique(adapter, accelerator, batch: list, guidance_scale: float) -> Conditioning:
    """Encode each distinct (prompt, negative) once: a group repeats one prompt ``group_size`` times."""
    pairs = [(it.prompt, it.negative_prompt or "") for it in batch]
    unique = list(dict.fromkeys(pairs))
    with accelerator.autocast():
        cond = adapter.encode([p for p, _ in unique], [n for _, n in unique], guidance_scale)
    return index_cond(cond, torch.tensor([unique.index(pair) for pair in pairs]))
