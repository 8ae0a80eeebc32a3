"""Scoring one epoch's samples while they are still being sampled.

``RewardSet.start(group_ids)`` opens a ``RewardJob``; the sampler hands it each decoded
micro-batch (``add``) and asks for the scores at the end (``finish``). The job knows the
set only through what ``start`` gives it: the reward models by name and the thread pools
of the async ones.

- A reward with ``async_reward: true`` is submitted to its own thread pool
  (``num_workers`` threads) as soon as its inputs are there: a pointwise reward per
  micro-batch, a groupwise reward per group once every member of that group has been
  added (so it always sees the complete group, whatever the micro-batch size).
- Every other reward is scored in ``finish`` on the whole batch, as without async.
- A reward routed to some datasets (``data.datasets``) scores only their samples; the others get NaN.
- ``scores_for(indices)``, once every sample is added, waits only for the work that holds those samples: the
  trainer's ``train.reward_optimization_overlap`` trains on the groups scored while the rest are scored.

Threads fit rewards that wait (remote servers, VLM APIs) or release the GIL (torch
forward passes). A worker's exception is re-raised on the main thread, at the next
``add`` or in ``finish``, as ``RewardError`` naming the reward, with the original
error chained.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Executor, Future

import torch
from torch import Tensor

from .base import BaseRewardModel, GroupwiseRewardModel, RewardInputs, score_each_once


class RewardError(RuntimeError):
    """A reward failed; the message names it, ``__cause__`` is the original error."""


class RewardJob:
    def __init__(self, models: Mapping[str, BaseRewardModel], pools: Mapping[str, Executor],
                 group_ids: Tensor | None, masks: Mapping[int, Tensor] | None = None):
        """``models``: every reward by name (entries may share an instance); ``pools``: the
        executor of each async reward, by name (entries sharing an instance share one); ``masks``: id(model) ->
        (N,) bool, the samples a routed reward scores (the others get NaN); None: every reward scores all."""
        self.models = dict(models)
        self._masks = dict(masks or {})
        self.group_ids = None if group_ids is None else torch.as_tensor(group_ids).reshape(-1).cpu()
        self._chunks: list[tuple[int, RewardInputs]] = []  # (first index, inputs)
        self._next = 0  # samples are added in order
        # id(model) -> [(indices, future)]
        self._futures: dict[int, list[tuple[Tensor, Future]]] = {}
        self._async = {id(self.models[name]): self.models[name] for name in pools}
        self._pools = {id(self.models[name]): pool for name, pool in pools.items()}
        if self.group_ids is None and any(isinstance(m, GroupwiseRewardModel) for m in self._async.values()):
            raise ValueError("async groupwise rewards need the batch's group_ids up front")
        if self.group_ids is not None:
            ids = self.group_ids.tolist()
            self._group_size = {g: ids.count(g) for g in set(ids)}
        self._arrived: dict[int, list[int]] = {}
        self._sync_scores: dict[int, Tensor] | None = None  # the other rewards' scores, once asked (scores_for)
        self._async_scores: dict[int, Tensor] = {}  # id(model) -> (N,): each async reward's scores collected so far

    def add(self, prompts: list[str], images: Tensor | None = None, videos: Tensor | None = None,
            condition_images: list | None = None, condition_videos: list | None = None,
            audios: Tensor | None = None, audio_sample_rate: int | None = None,
            metadata: list[dict] | None = None) -> None:
        """The next ``len(prompts)`` samples of the batch, in batch order."""
        self.raise_failures()
        inputs = RewardInputs(list(prompts), images, videos, condition_images, condition_videos, audios,
                              audio_sample_rate, metadata)
        start, self._next = self._next, self._next + len(inputs)
        if self.group_ids is not None and self._next > len(self.group_ids):
            raise ValueError(f"{self._next} samples added for {len(self.group_ids)} group ids")
        self._chunks.append((start, inputs))
        complete: list[int] = []
        if self.group_ids is not None:
            for offset, g in enumerate(self.group_ids[start:self._next].tolist()):
                members = self._arrived.setdefault(g, [])
                members.append(start + offset)
                if len(members) == self._group_size[g]:
                    complete.append(g)
        for key, model in self._async.items():
            pool = self._pools[key]
            futures = self._futures.setdefault(key, [])
            if isinstance(model, GroupwiseRewardModel):
                for g in complete:
                    members = [i for i in self._arrived[g] if self._scores(key, i)]
                    if members:
                        futures.append((torch.tensor(members), pool.submit(model.score, self._gather(members),
                                                                           torch.full((len(members),), g))))
            else:
                mine = [i for i in range(start, self._next) if self._scores(key, i)]
                if len(mine) == len(inputs):
                    futures.append((torch.arange(start, self._next), pool.submit(model.score, inputs)))
                elif mine:
                    futures.append((torch.tensor(mine), pool.submit(model.score, self._gather(mine))))

    def _scores(self, key: int, index: int) -> bool:
        mask = self._masks.get(key)
        return mask is None or bool(mask[index])

    def _gather(self, indices: list[int]) -> RewardInputs:
        """The inputs of samples ``indices`` (which may lie in several chunks)."""
        parts = []
        for first, chunk in self._chunks:
            local = [i - first for i in indices if first <= i < first + len(chunk)]
            if local:
                parts.append(chunk.select(local))
        return parts[0] if len(parts) == 1 else RewardInputs.concat(parts)

    def raise_failures(self) -> None:
        """Re-raise the first failed worker, naming its reward(s), and cancel what is pending."""
        for key, futures in self._futures.items():
            for _, future in futures:
                if future.done() and future.exception() is not None:
                    self.cancel()
                    error = future.exception()
                    names = [n for n, m in self.models.items() if id(m) == key]
                    raise RewardError(f"reward {names[0] if len(names) == 1 else names!r} failed in an async "
                                      f"worker: {type(error).__name__}: {error}") from error

    def cancel(self) -> None:
        for futures in self._futures.values():
            for _, future in futures:
                future.cancel()

    def finish(self) -> dict[str, Tensor]:
        """``{name: float32 (N,)}`` on the CPU, in batch order: async results collected,
        the other rewards scored now on the whole batch."""
        return self.scores_for(torch.arange(self._complete()))

    def scores_for(self, indices: Tensor) -> dict[str, Tensor]:
        """``{name: float32 (len(indices),)}`` on the CPU: the scores of samples ``indices`` once every sample is
        added, waiting only for the async work that holds them (``train.reward_optimization_overlap`` asks group by
        group while the rest are still scored). The other rewards are scored on the whole batch at the first call."""
        n = self._complete()
        indices = torch.as_tensor(indices, dtype=torch.long).reshape(-1).cpu()
        if self._sync_scores is None:
            self._sync_scores = self._score_sync(n)
        wanted = torch.zeros(n, dtype=torch.bool)
        wanted[indices] = True
        scored = dict(self._sync_scores)
        for key in self._async:
            # NaN where a routed reward does not score; an async reward that had nothing to score: 0 (or NaN)
            out = self._async_scores.setdefault(key, torch.full((n,), float("nan") if key in self._masks else 0.0,
                                                                dtype=torch.float32))
            for members, future in self._futures.get(key, []):
                if not wanted[members].any():
                    continue
                try:
                    out[members] = future.result()
                except Exception:  # noqa: BLE001 - re-raised below with the reward's name
                    self.raise_failures()
                    raise
            scored[key] = out
        return {name: scored[id(m)][indices].clone() for name, m in self.models.items()}

    def _complete(self) -> int:
        """The batch's size, once every sample is added."""
        n = self._next
        if self.group_ids is not None and n != len(self.group_ids):
            raise ValueError(f"{n} samples added for {len(self.group_ids)} group ids")
        return n

    def _score_sync(self, n: int) -> dict[int, Tensor]:
        """The rewards that are not async, scored on the whole batch (a routed one on its samples, NaN elsewhere)."""
        scored: dict[int, Tensor] = {}
        sync = {id(m): m for m in self.models.values() if id(m) not in self._async}
        whole = [m for key, m in sync.items() if key not in self._masks]
        if whole:
            scored.update(score_each_once(whole, self._gather(list(range(n))), self.group_ids))
        for key, mask in self._masks.items():  # a routed reward: its samples only, NaN for the others
            if key in sync:
                out = torch.full((n,), float("nan"), dtype=torch.float32)
                mine = mask.nonzero().flatten()
                if len(mine):
                    groups = None if self.group_ids is None else self.group_ids[mine]
                    out[mine] = score_each_once([sync[key]], self._gather(mine.tolist()), groups)[key].float()
                scored[key] = out
        return scored
