"""Several datasets in one run (``data.datasets``): their prompts read as one list, each prompt knowing its
dataset, and an epoch's groups drawn from each dataset in proportion to its weight.

An epoch draws ``K = unique_sample_num_per_epoch`` prompts. Dataset ``s`` of weight ``w_s`` gets
``K w_s / W`` of them (``W`` the weights' sum) in expectation: the whole part always, the fractional
parts' sum (a whole number ``R``) handed to ``R`` datasets by systematic sampling, which picks dataset
``s`` with probability exactly its fractional part. So when ``K w_s / W`` is a whole number every
epoch holds exactly that many groups of ``s``, and otherwise the long-run share is still the weight's.
The draw depends only on ``(seed, epoch)``, like ``EpochSampler``'s: any number of processes, and a
resumed run, draw the same groups.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .prompts import EpochDraw, EpochSampler, PromptItem, load_prompts


def load_sources(sources, split: str) -> list[PromptItem]:
    """The ``split`` prompts of every dataset, in order, each item's ``dataset`` its source's name. A
    dataset without the split contributes none (``test``: a dataset may have no test prompts), unless none
    has it."""
    from .prompts import MissingPromptFile

    items, missing = [], []
    for source in sources:
        cap = source.eval_max_dataset_size if split == "test" and source.eval_max_dataset_size else \
            source.max_dataset_size
        try:
            read = load_prompts(source.dataset_dir, split, cap, source.image_dir, source.video_dir)
        except MissingPromptFile as err:
            if len(sources) == 1:
                raise
            missing.append(str(err))
            continue
        items += [replace(item, dataset=source.name) for item in read]
    if not items:
        raise MissingPromptFile("; ".join(missing))
    return items


def expected_counts(unique_per_epoch: int, weights: list[int]) -> list[float]:
    """Each dataset's expected number of prompts an epoch: ``K w_s / W``."""
    total = sum(weights)
    return [unique_per_epoch * w / total for w in weights]


class WeightedEpochSampler(EpochSampler):
    """``EpochSampler``'s draw over several datasets, ``sizes[s]`` prompts each (consecutive in the prompt
    list), dataset ``s`` getting ``K w_s / W`` of the epoch's groups (see the module's docstring); the
    groups are then put in a random order, so that each process's contiguous share mixes the datasets."""

    def __init__(self, sizes: list[int], weights: list[int], unique_per_epoch: int, group_size: int, seed: int = 0,
                 names: list[str] | None = None):
        super().__init__(sum(sizes), unique_per_epoch, group_size, seed)
        if len(sizes) != len(weights) or not weights or min(weights) < 1:
            raise ValueError(f"one positive weight per dataset: sizes {sizes}, weights {weights}")
        names = names or [str(i) for i in range(len(sizes))]
        short = [f"{name} ({n} prompts, up to {math.ceil(c)} an epoch)"
                 for name, n, c in zip(names, sizes, expected_counts(unique_per_epoch, weights)) if math.ceil(c) > n]
        if short:
            raise ValueError(f"too few prompts for their weight: {', '.join(short)}")
        self.sizes, self.weights = list(sizes), list(weights)
        self.offsets = [sum(sizes[:s]) for s in range(len(sizes))]

    def counts(self, generator: torch.Generator) -> list[int]:
        """How many prompts each dataset gives this epoch (systematic sampling of the fractional parts)."""
        expected = expected_counts(self.unique_per_epoch, self.weights)
        counts = [math.floor(c + 1e-9) for c in expected]
        fractions = [max(0.0, c - n) for c, n in zip(expected, counts)]
        left = self.unique_per_epoch - sum(counts)
        if left:  # the datasets whose stretch of the cumulated fractions holds one of start, start + 1, ...
            start, edge = float(torch.rand((), generator=generator)), 0.0
            for s, f in enumerate(fractions):
                before, edge = edge, edge + f
                counts[s] += math.ceil(edge - start - 1e-12) - math.ceil(before - start - 1e-12)
            short = self.unique_per_epoch - sum(counts)  # float rounding at a stretch's very edge
            counts[max(range(len(counts)), key=lambda s: fractions[s])] += short
        return counts

    def draw(self, epoch: int) -> EpochDraw:
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        generator = self._generator(epoch)
        chosen = []
        for size, offset, count in zip(self.sizes, self.offsets, self.counts(generator)):
            chosen.append(torch.randperm(size, generator=generator)[:count] + offset)
        prompts = torch.cat(chosen)[torch.randperm(self.unique_per_epoch, generator=generator)]
        indices = prompts.repeat_interleave(self.group_size)
        groups = torch.arange(self.unique_per_epoch).repeat_interleave(self.group_size)
        return EpochDraw(indices, groups)


def epoch_sampler(cfg, items: list[PromptItem], seed: int) -> EpochSampler:
    """The run's draw: ``EpochSampler`` over one dataset, ``WeightedEpochSampler`` over several (a ValueError
    when a dataset has too few prompts for its weight)."""
    train, sources = cfg.train, cfg.data.split_sources("train")  # an evaluation-only dataset is never drawn
    if len(sources) == 1:
        return EpochSampler(len(items), train.unique_sample_num_per_epoch, train.group_size, seed=seed)
    sizes = [sum(1 for item in items if item.dataset == source.name) for source in sources]
    return WeightedEpochSampler(sizes, [s.weight for s in sources], train.unique_sample_num_per_epoch,
                                train.group_size, seed=seed, names=[s.name for s in sources])


def source_indices(items: list[PromptItem], names: list[str]) -> torch.Tensor:
    """(len(items),) long: the position in ``names`` of each item's dataset."""
    where = {name: i for i, name in enumerate(names)}
    return torch.tensor([where[item.dataset] for item in items], dtype=torch.long)


def per_source_means(scores: dict[str, torch.Tensor], sources: torch.Tensor, names: list[str],
                     key: str) -> dict[str, float]:
    """Each reward's mean over each dataset's samples (finite scores only): ``key.format(source=, reward=)``."""
    out = {}
    for s, name in enumerate(names):
        mine = sources.to(torch.long).cpu() == s
        for reward, values in scores.items():
            values = values.detach().float().cpu()[mine]
            values = values[torch.isfinite(values)]
            if len(values):
                out[key.format(source=name, reward=reward)] = values.mean().item()
    return out
