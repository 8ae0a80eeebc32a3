"""How the evaluation samples: each evaluated dataset's settings (its own eval steps, guidance and resolution over
the ``eval`` section's) and the size its test prompts are generated at, the test prompts in parts sampled alike,
each process's share of each part, every prompt's scores gathered from every process, and the samples the grid
shows, picked evenly over the datasets. The Trainer's eval, ``ff-eval`` and ``ff-train --plan`` share it; the
sampling itself is ``sampling.sample_prompts``."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from .config.base import resolution_pair
from .sampling import Rollouts, SamplingSettings, sample_prompts, split_size


def eval_sizes(cfg, items: list, adapter_cls) -> dict[str, tuple[int, int]]:
    """The (height, width) each dataset's test prompts ``items`` are generated at (``split_size`` of its own):
    its eval resolution (``eval_resolution``), or with eval.auto_resize its conditions' aspect ratio at that area.
    Each dataset is sampled apart (``eval_parts``), so each may have a size of its own."""
    by_dataset: dict = {}
    for item in items:
        by_dataset.setdefault(item.dataset, []).append(item)
    return {name: split_size(cfg, "eval", rows, adapter_cls, eval_resolution(cfg, name))
            for name, rows in by_dataset.items()}


def eval_settings(cfg, dataset: str | None, size: tuple[int, int] | None = None) -> SamplingSettings:
    """How ``dataset``'s test prompts are sampled: the eval section's settings (``SamplingSettings.for_eval``) with
    the dataset's own ``eval_num_inference_steps`` / ``eval_guidance_scale`` / ``eval_resolution`` over them;
    ``size``: the (height, width) generated (``eval_sizes``), None: its eval resolution."""
    base = SamplingSettings.for_eval(cfg.eval, size or eval_resolution(cfg, dataset))
    steps = _own_eval_setting(cfg, dataset, "eval_num_inference_steps")
    return replace(base, num_steps=steps or base.num_steps, guidance_scale=eval_guidance(cfg, dataset))


def eval_parts(cfg, items: list, sizes: dict | None = None) -> list[tuple[slice, SamplingSettings]]:
    """The eval of ``items`` (test prompts, each dataset's together, as ``load_sources`` reads them) in consecutive
    runs sampled alike: each dataset's ``eval_settings``, at its size in ``sizes`` (``eval_sizes``; None or a
    dataset it lacks: its eval resolution)."""
    own = {name: eval_settings(cfg, name, (sizes or {}).get(name)) for name in dict.fromkeys(it.dataset
                                                                                            for it in items)}
    parts = []
    for i, item in enumerate(items):
        settings = own[item.dataset]
        if parts and parts[-1][1] == settings:
            parts[-1] = (slice(parts[-1][0].start, i + 1), settings)
        else:
            parts.append((slice(i, i + 1), settings))
    return parts


def even_picks(datasets: list, n: int) -> list[int]:
    """Indices of ``n`` of the entries (all when fewer), as evenly over their ``datasets`` as their sizes allow:
    each dataset's first ones, one of each in turn, what a small dataset lacks going to the others; in index order."""
    by_dataset: dict = {}
    for i, name in enumerate(datasets):
        by_dataset.setdefault(name, []).append(i)
    picks, turn = [], 0
    while len(picks) < min(n, len(datasets)):
        picks += [ids[turn] for ids in by_dataset.values() if turn < len(ids)][: n - len(picks)]
        turn += 1
    return sorted(picks)


def eval_items(items: list, num_samples: int | None) -> list:
    """The test prompts evaluated: all, or ``eval.num_samples`` of them split evenly over their datasets
    (``even_picks``; the config refuses a cap that would leave an evaluated dataset out), each dataset's together."""
    return [items[i] for i in even_picks([it.dataset for it in items], num_samples)] if num_samples else items


def grid_samples(parts: list, datasets: list, shown: int = 16) -> list[tuple]:
    """The eval samples a grid shows: ``shown`` of them split evenly over the evaluated datasets (``even_picks``;
    every dataset at least one), in test-prompt order, each (prompt, media, its rewards, its condition media),
    the prompt led by its dataset's name when there are several. ``parts``: this process's rollouts of each part
    (``sample_eval``), ``datasets``: each test prompt's. A collective: each process holds its share of each part,
    and every process gets them all."""
    import math

    from accelerate.utils import gather_object

    picks = set(even_picks(datasets, max(shown, len(set(datasets)))))
    several = len(set(datasets)) > 1
    mine = []
    for rollouts in parts:
        conditions = rollouts.conditions.per_sample() if rollouts.conditions else None
        for j, i in enumerate(rollouts.group_ids.tolist()):
            if i in picks:
                rewards = {k: v[j].item() for k, v in (rollouts.rewards or {}).items() if not math.isnan(v[j].item())}
                prompt = f"[{datasets[i]}] {rollouts.prompts[j]}" if several else rollouts.prompts[j]
                # as arrays: a tensor view would carry its whole batch's storage through the gather
                mine.append((i, prompt, rollouts.media[j].float().cpu().numpy().copy(), rewards,
                             [c.float().cpu().numpy().copy() for c in conditions[j]] if conditions else []))
    return [(prompt, torch.from_numpy(media), rewards, [torch.from_numpy(c) for c in conditions])
            for _, prompt, media, rewards, conditions in sorted(gather_object(mine), key=lambda sample: sample[0])]


def _own_eval_setting(cfg, dataset: str | None, key: str):
    """``dataset``'s own ``key`` (an ``eval_*`` setting of its ``data.datasets`` entry); None: unset, or not a
    dataset of the config's."""
    return next((getattr(s, key) for s in cfg.data.sources if s.name == dataset), None)


def eval_guidance(cfg, dataset: str | None) -> float:
    """The guidance scale ``dataset``'s test prompts are sampled (and so encoded) with."""
    own = _own_eval_setting(cfg, dataset, "eval_guidance_scale")
    return cfg.eval.guidance_scale if own is None else own


def eval_resolution(cfg, dataset: str | None) -> tuple[int, int]:
    """The (height, width) ``dataset``'s test prompts are evaluated at: its ``eval_resolution``, else
    ``eval.resolution`` (before auto_resize: ``eval_sizes``)."""
    own = _own_eval_setting(cfg, dataset, "eval_resolution")
    return cfg.eval.height_width if own is None else resolution_pair(own)


def sample_eval(adapter, items: list, parts: list, share_of, **services) -> tuple[dict[str, Tensor], list[Rollouts]]:
    """The eval of ``items`` part by part (``eval_parts``), each process sampling its share of each part
    (``share_of(n)``: a slice of n), every sample seeded by its index in ``items``: every prompt's scores, gathered
    from every process in ``items``' order, and this process's rollouts of each part. ``services``:
    ``sample_prompts``' keywords."""
    scores, mine = {}, []
    for part, settings in parts:
        ids = list(range(len(items)))[part]
        ids = ids[share_of(len(ids))]
        rollouts = sample_prompts(adapter, [items[i] for i in ids], settings, sample_ids=ids, **services)
        for name, part_scores in gather_scores(rollouts.rewards or {}).items():
            scores.setdefault(name, []).append(part_scores)
        mine.append(rollouts)
    return {name: torch.cat(s) for name, s in scores.items()}, mine


def gather_scores(scores: dict[str, Tensor]) -> dict[str, Tensor]:
    """Each process's scores of its share of the prompts (``data.share_slice``), joined in process order
    on every process: each prompt's scores once, in prompt order. Shares may differ in size or be empty,
    which ``accelerator.gather`` (equal shapes) cannot take; accelerate's ``gather_object`` can."""
    from accelerate.utils import gather_object

    shares = gather_object([{name: s.tolist() for name, s in scores.items()}])
    return {name: torch.tensor([x for share in shares for x in share[name]], dtype=torch.float32)
            for name in scores}
