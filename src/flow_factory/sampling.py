"""Sampling: prompts -> trajectories -> decoded media -> rewards.

One module for every caller: the Trainer's rollouts (any dynamics, an SDE window) and
its eval, ``ff-sample``, ``ff-eval`` and the scripts. What a call samples is one
``SamplingSettings``; the denoising loop itself is ``rollout.sample_trajectory``. A conditioned
model's condition files are read and encoded once per distinct row of a batch (``_conditions``),
and the rewards get them, with each row's metadata, beside the samples.

Every draw is seeded by what it is for (``seeding.py``): sample ``i``'s initial noise by
``(seed, epoch, i)`` (eval and the CLIs use epoch -1), so the eval of a run and
``ff-eval`` on its checkpoint draw the same noise for the same test prompt. How the eval samples (each dataset's
settings and size, its parts, each process's share, the scores gathered) is ``eval_sampling``.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

import torch
from torch import Tensor

from .data import load_sources
from .data.conditions import check_batchable, check_conditions, generated_size
from .dynamics.ode import ODE
from .models.conditioning import ConditionMedia, Conditioning, cat_cond, index_cond
from .models.preflight import checkpoint_conditions
from .prompt_cache import condition_media, encode_condition_rows
from .trajectory import KeptStates, Trajectory, TrajectoryOptions, sample_trajectory
from .seeding import generator, per_sample_noise
from .timer import PhaseTimer


@dataclass(frozen=True)
class SamplingSettings:
    height: int
    width: int
    num_frames: int | None  # video models only
    num_steps: int
    guidance_scale: float
    batch_size: int  # samples per transformer call
    seed: int
    sde_steps: list[int] | None = None  # the stochastic steps; None = all of a stochastic dynamics
    same_latent: bool = False  # a group shares its initial noise
    record_means: bool = False  # keep each step's Gaussian mean (GRPO-Guard)
    keep_trajectory: bool = True  # False: keep only the media and the rewards (eval)
    storage_dtype: torch.dtype | None = None  # precision of the kept trajectory; None = float32
    offload: bool = False  # keep the trajectory and conditioning in CPU memory until a micro-batch needs them
    keep_states: tuple[int, ...] | None = None  # the trajectory states kept (0 noise .. T final); None = all
    condition_size: tuple[int, int] | None = None  # (height, width) of condition images; None = the model's choice
    keep_audio: bool = False  # a model with audio: keep every soundtrack (ff-sample), not only a reward's

    @property
    def geometry(self) -> tuple:
        """What a conditioned model's conditions are prepared for (the condition cache's key)."""
        return self.height, self.width, self.num_frames, self.condition_size
    # the guidance scale the prompts are encoded for, when a loss calls the model at another one than the
    # rollout (dgpo / crd's kl_cfg: the negative branch of a guided reference); None = guidance_scale
    conditioning_guidance_scale: float | None = None

    @classmethod
    def for_eval(cls, ev, size: tuple[int, int] | None = None) -> "SamplingSettings":
        """The ODE eval of an ``EvalConfig`` (the config has filled its nulls from ``train``); ``size``: the
        (height, width) generated, when auto_resize made it other than ``eval.resolution``."""
        height, width = size or ev.height_width
        return cls(height, width, ev.num_frames, ev.num_inference_steps, ev.guidance_scale,
                   ev.per_device_batch_size, ev.seed, sde_steps=[], keep_trajectory=False,
                   condition_size=condition_size(ev))


def condition_size(section) -> tuple[int, int] | None:
    """``condition_image_size`` of a train or eval config section as (height, width); None when unset."""
    value = section.condition_image_size
    return None if value is None else (value, value) if isinstance(value, int) else (value[0], value[-1])


def load_split(cfg, split: str, adapter_cls, items: list | None = None) -> list:
    """The prompts of ``split`` (train / test) with their condition files, checked against what the model of
    ``adapter_cls`` takes: before it loads (PromptFileError naming the file and line). ``items``: prompts read
    already (an offline run's records'), to check."""
    items = load_sources(cfg.data.split_sources(split), split) if items is None else items
    per_sample, note = checkpoint_conditions(adapter_cls, cfg.model.model_name_or_path)
    check_conditions(items, cfg.model.model_type, adapter_cls.condition_inputs, per_sample, note)
    # a model whose conditions keep their own sizes (Qwen-Image-Edit-Plus) batches only rows that agree
    section, part = (cfg.train, "train") if split == "train" else (cfg.eval, "eval")
    size = condition_size(section)
    check_batchable(items, lambda item: adapter_cls.call_shape([f.size for f in item.images], size),
                    section.per_device_batch_size, f"{part}.per_device_batch_size")
    return items


def split_size(cfg, section: str, items: list, adapter_cls,
               resolution: tuple[int, int] | None = None) -> tuple[int, int]:
    """The (height, width) the ``train`` or ``eval`` section generates ``items`` at: ``resolution`` (None: the
    section's), or with auto_resize (null: the model's default) its conditions' aspect ratio at that area."""
    config = getattr(cfg, section)
    auto = adapter_cls.auto_resize if config.auto_resize is None else config.auto_resize
    return generated_size(items, resolution or config.height_width, auto and bool(adapter_cls.condition_inputs),
                          adapter_cls.pixel_factor, f"{section}.auto_resize")


@dataclass
class Rollouts(KeptStates):
    """An epoch's samples: what the algorithms train on, what the rewards scored."""

    prompts: list[str]
    group_ids: Tensor  # (N,)
    latents: Tensor  # (N, K, *latent): the states ``latent_steps`` of each trajectory
    log_probs: Tensor  # (N, T)
    sigmas: Tensor  # (T + 1,)
    sde_steps: list[int]
    cond: Conditioning
    media: Tensor  # images (N, 3, H, W) or videos (N, F, 3, H, W) in [0, 1]
    means: Tensor | None = None  # (N, T, *latent) step means, when recorded
    rewards: dict[str, Tensor] | None = None  # raw score per reward name, (N,)
    latent_steps: list[int] | None = None  # the states ``latents`` holds; None: all T + 1
    conditions: ConditionMedia | None = None  # a conditioned model's condition media, as it saw them
    audio: Tensor | None = None  # a model with audio: soundtracks (N, channels, samples), when kept
    audio_sample_rate: int | None = None
    # train.reward_optimization_overlap: the open ``RewardJob`` whose async rewards are still being scored (then
    # ``rewards`` is None until the trainer collects them)
    pending_rewards: Any = None
    # (N,) each sample's index in the epoch's draw (its noise seed): the distillation trainers key their training
    # draws by it, so that one process and several draw alike for the same sample
    sample_ids: Tensor | None = None
    # bool (*latent): the latent elements the model generates, the rest being a condition it is given (ltx2_i2av's
    # first frame; ``FlowAdapter.generated``); None: every element. The decoupled losses average over these only
    generated: Tensor | None = None
    # each sample's dataset (``data.datasets``' name; ``default`` for ``data.dataset_dir``): diffusion-opd's teacher
    datasets: list[str | None] | None = None


@dataclass
class SamplingServices:
    """What a sampling call works with beside the model and its settings, each optional: ``reward_set``
    scores the samples; ``timer`` times the phases; ``autocast``: a context factory for mixed precision
    (``accelerator.autocast``); ``prompt_cache``: a ``PromptCache`` that answers for the prompts it holds (the
    others are encoded); ``condition_cache``: a ``ConditionCache`` that answers for a conditioned model's
    condition files likewise; ``cache``: the ``RolloutCache`` applied to the adapter, emptied before each
    trajectory; ``rewards_pending``: leave the rewards' job open in ``Rollouts.pending_rewards`` instead of waiting
    for its scores (``train.reward_optimization_overlap``)."""

    reward_set: Any = None
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    autocast: Callable = nullcontext
    prompt_cache: Any = None
    condition_cache: Any = None
    cache: Any = None
    rewards_pending: bool = False


@torch.no_grad()
def collect_rollouts(adapter, dynamics, items: list, group_ids: Tensor, sample_ids: list[int],
                     settings: SamplingSettings, *, epoch: int, services: SamplingServices | None = None) -> Rollouts:
    """Sample ``items`` (``data.PromptItem``: prompt, negative prompt, a conditioned model's condition files,
    metadata) in batches, decode, and score with ``reward_set``.

    ``sample_ids``: each item's global sample index (its noise seed); ``services``: the rewards, caches, timer
    and autocast it works with (none by default)."""
    services = services or SamplingServices()
    return _RolloutBatches(adapter, dynamics, settings, epoch, services).collect(items, group_ids, sample_ids)


@dataclass
class _Chunk:
    """One batch's samples, as ``_RolloutBatches.sample`` leaves them."""

    traj: Trajectory
    cond: Conditioning
    media: Tensor
    conditions: ConditionMedia | None
    audio: dict  # {"audios", "audio_sample_rate"} when a soundtrack was decoded, else empty


@dataclass
class _RolloutBatches:
    """``collect_rollouts``' work: each batch sampled, decoded and handed to the rewards, then the batches
    joined into one ``Rollouts``."""

    adapter: Any
    dynamics: Any
    settings: SamplingSettings
    epoch: int
    services: SamplingServices

    def __post_init__(self):
        s, adapter, reward_set = self.settings, self.adapter, self.services.reward_set
        self.sigmas = adapter.sigmas(s.num_steps, s.height, s.width, s.num_frames).float()
        # a soundtrack is decoded only for a reward that asks for it, or to be kept
        self.keep_audio = s.keep_audio and adapter.has_audio
        self.wants_audio = self.keep_audio or (reward_set is not None and "audio" in reward_set.required_fields)

    def collect(self, items: list, group_ids: Tensor, sample_ids: list[int]) -> Rollouts:
        s, reward_set, timer = self.settings, self.services.reward_set, self.services.timer
        # async rewards start on each batch as soon as it is decoded; the rest score at the end
        job = reward_set.start(group_ids, [it.dataset for it in items]) if reward_set is not None else None
        chunks = []
        for start in range(0, len(items), s.batch_size):
            batch = items[start:start + s.batch_size]
            chunks.append(self.sample(batch, sample_ids[start:start + s.batch_size],
                                      group_ids[start:start + s.batch_size]))
            if job is not None:
                with timer.phase("reward"):
                    self.add_to(job, batch, chunks[-1])
        rollouts = self.join(items, group_ids, chunks)
        rollouts.sample_ids = torch.tensor(sample_ids, dtype=torch.long)
        if job is not None and self.services.rewards_pending:
            rollouts.pending_rewards = job  # the trainer asks for the scores group by group, as it trains
        elif job is not None:
            with timer.phase("reward"):
                # on the adapter's device: the Trainer gathers them across processes
                rollouts.rewards = {name: r.float().to(self.adapter.device) for name, r in job.finish().items()}
        return rollouts

    def sample(self, batch: list, ids: list[int], groups: Tensor) -> _Chunk:
        """One batch's trajectories from their seeded noise, then decoded."""
        adapter, s, epoch, services = self.adapter, self.settings, self.epoch, self.services
        with services.timer.phase("sampling"):
            conditions, cond = encode_batch(adapter, batch, s, services.autocast, services.prompt_cache,
                                            services.condition_cache)
            keys = [("noise", s.seed, epoch, "group", int(g)) if s.same_latent else ("noise", s.seed, epoch, i)
                    for g, i in zip(groups.tolist(), ids)]
            noise = per_sample_noise(adapter, keys, s.height, s.width, s.num_frames)
            noise = adapter.start_latents(noise, self.sigmas[0], cond)  # video-to-video: the condition, noised
            if services.cache is not None:
                services.cache.new_trajectory(adapter)
            options = TrajectoryOptions(s.sde_steps, s.record_means, groups if s.same_latent else None,
                                        s.storage_dtype, None if s.keep_states is None else list(s.keep_states),
                                        services.autocast)
            traj = sample_trajectory(adapter, self.dynamics, cond, noise, self.sigmas, s.guidance_scale,
                                     generator=generator("sde", s.seed, epoch, ids[0]), options=options)
            if s.offload:
                traj, cond = _to_cpu(traj), {k: v.cpu() for k, v in cond.items()}
        with services.timer.phase("decode"):
            media = adapter.decode(traj.final).float().cpu()
            audio = {}
            if self.wants_audio:
                waveforms, rate = adapter.decode_audio(traj.final)
                audio = {"audios": waveforms.float().cpu(), "audio_sample_rate": rate}
        return _Chunk(traj, cond, media, conditions, audio)

    def add_to(self, job, batch: list, chunk: _Chunk) -> None:
        """Hand a decoded batch to the reward job, with its condition media and metadata."""
        media_key = "videos" if self.adapter.is_video else "images"
        shown = chunk.conditions or ConditionMedia()
        job.add([it.prompt for it in batch], **{media_key: chunk.media}, condition_images=shown.images,
                condition_videos=shown.videos, metadata=[it.metadata for it in batch], **chunk.audio)

    def join(self, items: list, group_ids: Tensor, chunks: list[_Chunk]) -> Rollouts:
        trajs, keep = [c.traj for c in chunks], self.settings.keep_trajectory
        rollouts = Rollouts(
            prompts=[it.prompt for it in items],
            datasets=[it.dataset for it in items],
            group_ids=group_ids,
            latents=torch.cat([t.latents for t in trajs]) if keep else torch.empty(0),
            log_probs=torch.cat([t.log_probs for t in trajs]),
            sigmas=self.sigmas,
            sde_steps=trajs[0].sde_steps,
            cond=cat_cond([c.cond for c in chunks]) if keep else {},
            media=torch.cat([c.media for c in chunks]),
            means=torch.cat([t.means for t in trajs]) if self.settings.record_means else None,
            latent_steps=trajs[0].latent_steps,
            conditions=ConditionMedia.concat([c.conditions for c in chunks]) if self.adapter.condition_inputs else None,
            generated=self.adapter.generated(trajs[0].latents[:1, -1]) if keep else None,
        )
        if self.keep_audio:
            rollouts.audio = torch.cat([c.audio["audios"] for c in chunks])
            rollouts.audio_sample_rate = chunks[-1].audio["audio_sample_rate"]
        return rollouts


def sample_prompts(adapter, items: list, settings: SamplingSettings, *, sample_ids: list[int] | None = None,
                   reward_set=None, autocast=nullcontext, prompt_cache=None, condition_cache=None) -> Rollouts:
    """ODE samples of ``items``, sample ``i`` seeded as the Trainer's eval seeds it (epoch -1)."""
    ids = list(range(len(items))) if sample_ids is None else list(sample_ids)
    settings = replace(settings, sde_steps=[], same_latent=False)
    if not items:  # an empty share (fewer prompts than processes): nothing to sample, yet its scores join the gather
        return Rollouts(prompts=[], group_ids=torch.zeros(0, dtype=torch.long), latents=torch.empty(0),
                        log_probs=torch.empty(0, settings.num_steps), sigmas=torch.empty(0), sde_steps=[], cond={},
                        media=torch.empty(0), latent_steps=[],
                        rewards=None if reward_set is None else {name: torch.empty(0) for name in reward_set.models})
    services = SamplingServices(reward_set, autocast=autocast, prompt_cache=prompt_cache,
                                condition_cache=condition_cache)
    return collect_rollouts(adapter, ODE(), items, torch.tensor(ids), ids, settings, epoch=-1, services=services)


def _to_cpu(traj):
    return replace(traj, latents=traj.latents.cpu(), log_probs=traj.log_probs.cpu(), final=traj.final.cpu(),
                   means=None if traj.means is None else traj.means.cpu())


def on_device(batch, device):
    """A training micro-batch (a dataclass of tensors and a conditioning dict) on ``device``, with
    half-precision latents (``storage_dtype``) back in float32; the conditioning keeps its dtype.
    The one place where stored (maybe offloaded) rollouts meet the model."""
    def move(value):
        if isinstance(value, Tensor):
            value = value.to(device, non_blocking=True)
            return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
        if isinstance(value, dict):
            return {k: v.to(device, non_blocking=True) for k, v in value.items()}
        return value
    return replace(batch, **{f.name: move(getattr(batch, f.name)) for f in fields(batch)})


def encode_batch(adapter, batch: list, s: SamplingSettings, autocast, prompt_cache=None,
                 condition_cache=None) -> tuple[ConditionMedia | None, Conditioning]:
    """``batch``'s (``PromptItem``s) condition media (None for a text-only model) and conditioning: the
    prompts at the settings' guidance scale, a conditioned model's condition files too, from the caches when
    they hold them."""
    encode_at = s.guidance_scale if s.conditioning_guidance_scale is None else s.conditioning_guidance_scale
    # a model whose text encoder reads the conditions encodes its prompts with them (_conditions)
    cond = {} if adapter.text_reads_conditions else _conditioning(adapter, batch, encode_at, autocast, prompt_cache)
    if not adapter.condition_inputs:
        return None, cond
    conditions, condition_cond = _conditions(adapter, batch, s, encode_at, autocast, condition_cache)
    return conditions, {**cond, **condition_cond}


def _conditioning(adapter, batch: list, guidance_scale: float, autocast, prompt_cache) -> Conditioning:
    if prompt_cache is not None:
        pairs = [(it.prompt, it.negative_prompt) for it in batch]
        cond = prompt_cache.lookup(pairs, adapter.uses_cfg(guidance_scale), adapter.device)
        if cond is not None:
            return cond
    return _encode_unique(adapter, batch, guidance_scale, autocast)


def _conditions(adapter, batch: list, s: SamplingSettings, guidance_scale: float, autocast,
                condition_cache) -> tuple[ConditionMedia, Conditioning]:
    """The batch's condition media and their conditioning: each distinct row's files read, resized and encoded
    once (a group repeats its row), for every step of the rollout and the training that reads it; the
    encoding comes from ``condition_cache`` when it holds it. A model whose text encoder reads the conditions
    gets its prompts (at ``guidance_scale``) encoded here with them, once per distinct row and prompts."""
    text = adapter.text_reads_conditions
    keys = [(it.condition_key, it.prompt, it.negative_prompt or "") if text else it.condition_key for it in batch]
    unique = list(dict.fromkeys(keys))
    rows = [batch[keys.index(key)] for key in unique]
    geometry = s.geometry
    media = condition_media(adapter, rows, geometry)
    cond = (condition_cache.lookup(rows, geometry, adapter.device, guidance_scale) if condition_cache is not None
            else None)
    if cond is None:
        with autocast():
            cond = encode_condition_rows(adapter, media, rows, geometry, guidance_scale)
    index = [unique.index(key) for key in keys]
    return media.take(index), index_cond(cond, torch.tensor(index))


def _encode_unique(adapter, batch: list, guidance_scale: float, autocast) -> Conditioning:
    """Encode each distinct (prompt, negative) once: a group repeats one prompt ``group_size`` times."""
    pairs = [(it.prompt, it.negative_prompt or "") for it in batch]
    unique = list(dict.fromkeys(pairs))
    with autocast():
        cond = adapter.encode([p for p, _ in unique], [n for _, n in unique], guidance_scale)
    return index_cond(cond, torch.tensor([unique.index(pair) for pair in pairs]))
