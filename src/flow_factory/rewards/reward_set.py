"""The configured rewards of a run, scored together.

``RewardSet.from_configs(entries)`` builds one reward model per config entry,
sharing one instance between entries whose model configuration is identical
(same class, checkpoint, device, dtype, batch size and options: only name and
weight differ), and scoring that instance once per batch.

Calling the set returns each reward's raw scores; weighting and normalisation
are the job of ``flow_factory.advantages``. ``start(group_ids)`` opens a
``RewardJob`` that scores ``async_reward`` entries in thread pools while the
sampler is still producing samples (``rewards/async_pool.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import Tensor

from .base import BaseRewardModel, GroupwiseRewardModel, RewardInputs, parse_dtype
from .registry import resolve_reward_class

if TYPE_CHECKING:
    from .async_pool import RewardJob

_ENTRY_FIELDS = ("name", "reward_model", "weight", "batch_size", "device", "dtype", "model_name_or_path")
# scheduling, not constructor options
_SCHEDULING_FIELDS = ("async_reward", "num_workers")
# typed config keys that go to the constructor when set (remote rewards, VLM judges)
CONSTRUCTOR_OPTIONS = ("server_url", "timeout", "retry_attempts", "api_base_url", "vlm_model", "api_key",
                       "extra_kwargs")


@dataclass(frozen=True)
class RewardSpec:
    """One reward config entry, normalised. ``None`` fields fall back to the class's defaults."""

    name: str
    reward_model: str
    weight: float = 1.0
    batch_size: int | None = None
    device: str | None = None
    dtype: str | None = None
    model_name_or_path: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    async_reward: bool = False
    num_workers: int = 1

    @classmethod
    def from_entry(cls, entry: Any) -> "RewardSpec":
        """From a plain dict (unknown keys are options) or an object with the same attributes
        (options in ``.kwargs``, and in pydantic's ``model_extra`` when extra keys are allowed)."""
        if isinstance(entry, Mapping):
            values = {k: entry.get(k) for k in _ENTRY_FIELDS}
            scheduling = {k: entry.get(k) for k in _SCHEDULING_FIELDS}
            kwargs = dict(entry.get("kwargs") or {})
            kwargs.update({k: v for k, v in entry.items()
                           if k not in _ENTRY_FIELDS + _SCHEDULING_FIELDS and k != "kwargs"})
        else:
            values = {k: getattr(entry, k, None) for k in _ENTRY_FIELDS}
            scheduling = {k: getattr(entry, k, None) for k in _SCHEDULING_FIELDS}
            kwargs = dict(getattr(entry, "kwargs", None) or {})
            kwargs.update(getattr(entry, "model_extra", None) or {})
            kwargs.update({k: getattr(entry, k) for k in CONSTRUCTOR_OPTIONS if getattr(entry, k, None) is not None})
        kwargs = {k: v for k, v in kwargs.items() if not (k in CONSTRUCTOR_OPTIONS and v is None)}
        async_reward = bool(scheduling["async_reward"])
        num_workers = 1 if scheduling["num_workers"] is None else int(scheduling["num_workers"])
        if num_workers < 1:
            raise ValueError(f"reward {values['name'] or values['reward_model']!r}: num_workers must be >= 1, "
                             f"got {num_workers}")
        if not values["reward_model"]:
            raise ValueError(f"reward entry {entry!r} has no 'reward_model'")
        if not values["name"]:
            values["name"] = str(values["reward_model"])  # one reward per model needs no name
        weight = 1.0 if values["weight"] is None else float(values["weight"])
        if not math.isfinite(weight):
            raise ValueError(f"reward {values['name']!r}: weight must be finite, got {values['weight']}")
        values["weight"] = weight
        return cls(**values, kwargs=kwargs, async_reward=async_reward, num_workers=num_workers)

    def constructor_args(self) -> dict[str, Any]:
        args = {k: getattr(self, k) for k in ("model_name_or_path", "device", "dtype", "batch_size")}
        return {k: v for k, v in args.items() if v is not None} | self.kwargs

    def model_key(self, cls: type) -> tuple:
        """Equal keys -> the same model would be built twice; build it once."""
        args = self.constructor_args()
        # "bf16" and torch.bfloat16, "cpu" and torch.device("cpu") are the same model
        if "dtype" in args:
            args["dtype"] = parse_dtype(args["dtype"])
        if "device" in args:
            args["device"] = torch.device(args["device"])
        return (cls, repr(sorted((k, str(v)) for k, v in args.items())))


class RewardSet:
    def __init__(self, models: Mapping[str, BaseRewardModel], weights: Mapping[str, float],
                 async_workers: Mapping[str, int] | None = None):
        """``async_workers``: name -> thread count for the rewards scored asynchronously."""
        if not models:
            raise ValueError("a RewardSet needs at least one reward")
        if set(models) != set(weights):
            raise ValueError(f"reward names {sorted(models)} and weight names {sorted(weights)} differ")
        self.models = dict(models)
        self._weights = {k: float(weights[k]) for k in self.models}
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
    def from_configs(cls, entries: Sequence[Any] | Mapping | Any) -> "RewardSet":
        if isinstance(entries, Mapping) or not isinstance(entries, Sequence):
            entries = [entries]  # the single-reward shorthand
        specs = [RewardSpec.from_entry(e) for e in entries]
        names = [s.name for s in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"reward names must be unique; repeated: {duplicates}")
        built: dict[tuple, BaseRewardModel] = {}
        models = {}
        for spec in specs:
            reward_cls = resolve_reward_class(spec.reward_model)
            key = spec.model_key(reward_cls)
            if key not in built:
                try:
                    built[key] = reward_cls(**spec.constructor_args())
                except TypeError as e:
                    raise TypeError(f"reward {spec.name!r} ({spec.reward_model}) could not be built "
                                    f"with options {sorted(spec.constructor_args())}: {e}") from e
            models[spec.name] = built[key]
        return cls(models, {s.name: s.weight for s in specs},
                   {s.name: s.num_workers for s in specs if s.async_reward})

    @property
    def weights(self) -> dict[str, float]:
        return dict(self._weights)

    @property
    def names(self) -> list[str]:
        return list(self.models)

    @property
    def needs_groups(self) -> bool:
        return any(isinstance(m, GroupwiseRewardModel) for m in self.models.values())

    def __call__(
        self,
        prompts: Sequence[str],
        images: Tensor | None = None,
        videos: Tensor | None = None,
        group_ids: Tensor | None = None,
        condition_images: list | None = None,
        condition_videos: list | None = None,
    ) -> dict[str, Tensor]:
        """Raw scores ``{name: float32 (B,)}`` on the CPU.

        ``images`` (B, 3, H, W) / ``videos`` (B, F, 3, H, W) in [0, 1]. ``group_ids`` (B,)
        marks which samples share a prompt; groupwise rewards need it, and need every
        sample of a group in this call (score the gathered batch, not a rank's shard,
        unless groups never straddle ranks).
        """
        inputs = RewardInputs(list(prompts), images, videos, condition_images, condition_videos)
        scored = self.score_models(self.models, inputs, group_ids)
        return {name: scored[id(model)].clone() for name, model in self.models.items()}

    def score_models(self, models: Mapping[str, BaseRewardModel], inputs: RewardInputs,
                     group_ids: Tensor | None) -> dict[int, Tensor]:
        """``{id(model): scores}``: each distinct instance among ``models`` scores ``inputs`` once."""
        groupwise = [n for n, m in models.items() if isinstance(m, GroupwiseRewardModel)]
        if groupwise and group_ids is None:
            raise ValueError(f"groupwise rewards {groupwise} need group_ids")
        scored: dict[int, Tensor] = {}
        for model in models.values():
            if id(model) not in scored:
                if isinstance(model, GroupwiseRewardModel):
                    scored[id(model)] = model.score(inputs, group_ids)
                else:
                    scored[id(model)] = model.score(inputs)
        return scored

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

    def start(self, group_ids: Tensor | None = None) -> "RewardJob":
        """Open a job for one batch; ``group_ids`` (N,) of the whole batch, in the order samples
        will be added (needed when any reward is groupwise)."""
        if self.needs_groups and group_ids is None:
            groupwise = [n for n, m in self.models.items() if isinstance(m, GroupwiseRewardModel)]
            raise ValueError(f"groupwise rewards {groupwise} need group_ids")
        from .async_pool import RewardJob  # imported when used: resolving a reward stays light

        return RewardJob(self, group_ids)

    def close(self) -> None:
        """Stop the thread pools (pending work is cancelled)."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._pools.clear()

    def to(self, device: str | torch.device) -> "RewardSet":
        for model in {id(m): m for m in self.models.values()}.values():
            model.to(device)
        return self
