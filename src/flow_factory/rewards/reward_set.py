"""The configured rewards of a run, scored together.

``RewardSet.from_configs(entries)`` builds one reward model per ``RewardConfig`` entry
(the config's own parser reads the entries; this module only builds from them), sharing
one instance between entries whose constructor options are equal (only name, weight and
scheduling differ), and scoring that instance once per batch.

Calling the set returns each reward's raw scores; weighting and normalisation
are the job of ``flow_factory.advantages``. ``start(group_ids)`` opens a
``RewardJob`` that scores ``async_reward`` entries in thread pools while the
sampler is still producing samples (``rewards/async_pool.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch
from torch import Tensor

from ..config.rewards import RewardConfig, parse_reward_entries
from .async_pool import RewardJob
from .base import BaseRewardModel, GroupwiseRewardModel, RewardInputs, score_each_once, takes_config
from .registry import resolve_reward_class


def build_reward(config: RewardConfig, accelerator=None) -> BaseRewardModel:
    """The reward model one entry describes, or TypeError naming the entry and its options.

    A class written to Flow-Factory's guide is built as ``cls(config, accelerator)`` (the entry
    itself, ``flow_factory.hparams.RewardArguments``); any other with the entry's keys as keyword
    options (``base.takes_config`` tells which). ``accelerator``: the run's; None makes one on the
    process's accelerator state for the first form, and leaves a null ``device`` to the class's
    default in the second.
    """
    reward_cls = resolve_reward_class(config.reward_model)
    if takes_config(reward_cls):
        args, kwargs = (config, accelerator), {}
        given = f"(config, accelerator), config holding {sorted(config.to_dict())}"
    else:
        args, kwargs = (), config.constructor_options()
        if config.device is None and accelerator is not None:
            kwargs["device"] = accelerator.device  # null = the training process's device
        given = f"options {sorted(kwargs)}"
    try:
        return reward_cls(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"reward {config.name!r} ({config.reward_model}) could not be built with {given}: {e}") from e


def reward_key(config: RewardConfig) -> tuple:
    """What makes two reward entries the same model: its class and the options it is built with, but its name,
    weight, routing, workers and ``batch_size`` (how many samples a call scores, not what the model is). Equal keys
    are loaded once (``RewardSet.from_configs``) and counted once (the plan)."""
    options = {k: v for k, v in config.constructor_options().items() if k != "batch_size"}
    return resolve_reward_class(config.reward_model), repr(sorted(options.items()))


def _at_batch_size(model, batch_size: int):
    """``model`` scoring ``batch_size`` samples a call: itself, or a shallow copy sharing its weights (an entry that
    differs from another only by its batch size: Flow-Factory's examples score eval samples 32 at a time)."""
    if not isinstance(model, BaseRewardModel) or getattr(model, "batch_size", batch_size) == batch_size:
        return model
    model = copy.copy(model)
    model.batch_size = batch_size
    return model


class RewardSet:
    def __init__(self, models: Mapping[str, BaseRewardModel], weights: Mapping[str, float | Mapping[str, float]],
                 async_workers: Mapping[str, int] | None = None,
                 applicable: Mapping[str, Sequence[str] | None] | None = None):
        """``async_workers``: name -> thread count for the rewards scored asynchronously. Routing to datasets
        (``data.datasets``): a weight may be ``{dataset: weight}`` (a dataset left out is not scored), and
        ``applicable``: name -> the datasets a reward scores (None: all). An offline run (sft, offline-dpo) may
        hold none."""
        if set(models) != set(weights):
            raise ValueError(f"reward names {sorted(models)} and weight names {sorted(weights)} differ")
        self.models = dict(models)
        self._weights = {k: dict(weights[k]) if isinstance(weights[k], Mapping) else float(weights[k])
                         for k in self.models}
        self._applicable = {k: None if (applicable or {}).get(k) is None else set(applicable[k]) for k in self.models}
        unknown = sorted(set(async_workers or {}) - set(self.models))
        if unknown:
            raise ValueError(f"async_workers names unknown rewards {unknown}; rewards: {sorted(self.models)}")
        # a shared instance is scored once: asynchronously if any of its entries asks for it
        self._workers: dict[int, int] = {}
        for name, n in (async_workers or {}).items():
            key = id(self.models[name])
            self._workers[key] = max(self._workers.get(key, 0), int(n))
        self._pools: dict[int, ThreadPoolExecutor] = {}

    @classmethod
    def from_configs(cls, entries: Sequence[RewardConfig | Mapping] | RewardConfig | Mapping,
                     accelerator=None, built: dict | None = None) -> "RewardSet":
        """From ``RewardConfig`` entries (``cfg.rewards``); a mapping, or one entry alone, is read by
        ``RewardConfig`` first, as the YAML's ``rewards`` would be (ConfigError for a bad entry).
        ``accelerator``: the run's, handed to rewards written to Flow-Factory's guide (``build_reward``).
        ``built``: models built already, by ``reward_key`` (a run's training rewards, for its eval rewards): one
        the entries ask for again is shared, not loaded a second time; the ones built here are added to it."""
        configs = parse_reward_entries(entries)
        built = {} if built is None else built
        models = {}
        for config in configs:
            key = reward_key(config)
            if key not in built:
                built[key] = build_reward(config, accelerator)
            models[config.name] = _at_batch_size(built[key], config.batch_size)
        return cls(models, {c.name: c.weight for c in configs},
                   {c.name: c.num_workers for c in configs if c.async_reward},
                   {c.name: c.applicable_datasets for c in configs})

    @property
    def weights(self) -> dict[str, float]:
        """One number a reward: its weight, or a weight per dataset's mean (the progress bar's headline)."""
        return {k: sum(w.values()) / max(1, len(w)) if isinstance(w, dict) else w for k, w in self._weights.items()}

    @property
    def routed(self) -> bool:
        """Whether a reward scores some datasets only, or weighs them apart."""
        return any(isinstance(w, dict) for w in self._weights.values()) or any(
            a is not None for a in self._applicable.values())

    def scores(self, name: str, dataset: str | None) -> bool:
        """Whether reward ``name`` scores a sample of ``dataset``."""
        weight, applicable = self._weights[name], self._applicable[name]
        return (applicable is None or dataset in applicable) and (not isinstance(weight, dict) or dataset in weight)

    def weight(self, name: str, dataset: str | None) -> float:
        """Reward ``name``'s weight on a sample of ``dataset`` (0 where it does not score)."""
        if not self.scores(name, dataset):
            return 0.0
        weight = self._weights[name]
        return float(weight[dataset]) if isinstance(weight, dict) else weight

    def sample_weights(self, datasets: Sequence[str] | None) -> dict[str, float | Tensor]:
        """Each reward's weight, per sample (a (N,) tensor) when the set is routed and ``datasets`` given."""
        if datasets is None or not self.routed:
            return self.weights
        return {k: torch.tensor([self.weight(k, d) for d in datasets], dtype=torch.float32) for k in self.models}

    def scored_mask(self, name: str, datasets: Sequence[str] | None, n: int) -> Tensor:
        """(n,) bool: the samples reward ``name`` scores (all of them when ``datasets`` is None)."""
        if datasets is None or not self.routed:
            return torch.ones(n, dtype=torch.bool)
        return torch.tensor([self.scores(name, d) for d in datasets], dtype=torch.bool)

    @property
    def names(self) -> list[str]:
        return list(self.models)

    @property
    def required_fields(self) -> set[str]:
        """The inputs any of the rewards asks for (``audio`` is decoded only when one does)."""
        return {f for model in self.models.values() for f in model.required_fields}

    @property
    def needs_groups(self) -> bool:
        return any(isinstance(m, GroupwiseRewardModel) for m in self.models.values())

    def __call__(self, prompts: Sequence[str], images: Tensor | None = None, videos: Tensor | None = None,
                 group_ids: Tensor | None = None, condition_images: list | None = None,
                 condition_videos: list | None = None, metadata: list[dict] | None = None) -> dict[str, Tensor]:
        """Raw scores ``{name: float32 (B,)}`` on the CPU.

        ``images`` (B, 3, H, W) / ``videos`` (B, F, 3, H, W) in [0, 1]. ``group_ids`` (B,)
        marks which samples share a prompt; groupwise rewards need it, and need every
        sample of a group in this call (score the gathered batch, not a rank's shard,
        unless groups never straddle ranks). Soundtracks: ``score_inputs`` with a ``RewardInputs``.
        """
        return self.score_inputs(RewardInputs(list(prompts), images, videos, condition_images, condition_videos,
                                       metadata=metadata), group_ids)

    def score_inputs(self, inputs: RewardInputs, group_ids: Tensor | None = None) -> dict[str, Tensor]:
        """``__call__`` on any ``RewardInputs``: with ``audio`` (B, C, T) waveforms in [-1, 1] at
        ``audio_sample_rate`` too, needed only when a reward asks for ``audio``."""
        self._check_groups(group_ids)
        scored = score_each_once(self.models.values(), inputs, group_ids)
        return {name: scored[id(model)].clone() for name, model in self.models.items()}

    def _check_groups(self, group_ids: Tensor | None) -> None:
        if self.needs_groups and group_ids is None:
            groupwise = [n for n, m in self.models.items() if isinstance(m, GroupwiseRewardModel)]
            raise ValueError(f"groupwise rewards {groupwise} need group_ids")

    # --- asynchronous scoring ---------------------------------------------------------

    def is_async(self, name: str) -> bool:
        return id(self.models[name]) in self._workers

    def pool(self, model: BaseRewardModel) -> ThreadPoolExecutor:
        """The thread pool of an async reward instance, made on first use and kept."""
        key = id(model)
        if key not in self._pools:
            name = next(n for n, m in self.models.items() if m is model)
            self._pools[key] = ThreadPoolExecutor(self._workers[key], thread_name_prefix=f"reward-{name}")
        return self._pools[key]

    def start(self, group_ids: Tensor | None = None, datasets: Sequence[str] | None = None) -> RewardJob:
        """Open a job for one batch; ``group_ids`` (N,) of the whole batch, in the order samples
        will be added (needed when any reward is groupwise); ``datasets``: each sample's dataset, for a routed
        set (a reward scores only its datasets' samples, NaN elsewhere)."""
        self._check_groups(group_ids)
        pools = {name: self.pool(model) for name, model in self.models.items() if self.is_async(name)}
        masks = None
        if datasets is not None and self.routed:  # an instance shared by entries scores what any of them does
            masks = {}
            for name, model in self.models.items():
                mask = self.scored_mask(name, datasets, len(datasets))
                masks[id(model)] = mask | masks.get(id(model), torch.zeros_like(mask))
        return RewardJob(self.models, pools, group_ids, masks)

    def close(self) -> None:
        """Stop the thread pools (pending work is cancelled)."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._pools.clear()

    def to(self, device: str | torch.device) -> "RewardSet":
        for model in {id(m): m for m in self.models.values()}.values():
            model.to(device)
        return self

