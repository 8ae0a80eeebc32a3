"""What ``train.reward_optimization_overlap`` needs of the rest of the config, and what it cannot change.

Overlap starts a training micro-batch as soon as the advantages it reads are final, while the async rewards of
later groups are still being scored; the micro-batches keep the order, the contents and the accumulation of a run
without overlap, so the update is the same (``trainer/overlap.py``). An advantage is final before the epoch's last
reward only where it depends on its own group's rewards alone, so the key is refused where that is not so.
Torch-free, as the rest of ``config/``.
"""

from __future__ import annotations

from .algorithms import ALGORITHM_SPECS, OFFLINE_TRAINER_TYPES

KEY = "train.reward_optimization_overlap"


def overlap_problems(cfg) -> list[str]:
    """Why overlap cannot keep the update of a run without it, one line each (none when it is off or can)."""
    train = cfg.train
    if not train.reward_optimization_overlap:
        return []
    name, out = train.trainer_type, []
    if name in OFFLINE_TRAINER_TYPES:
        return [f"{KEY}: {name} trains from a dataset, with no rewards to overlap; remove the key"]
    if train.global_std:
        out.append(f"{KEY}: global_std: true normalises every advantage by the std of the whole batch, known only "
                   "once the last reward is in, so no micro-batch could start earlier; set train.global_std: false "
                   "(each group's own std)")
    if train.advantage_aggregation != "sum":
        out.append(f"{KEY}: advantage_aggregation: {train.advantage_aggregation} normalises the weighted per-reward "
                   "advantages over the whole batch, known only once the last reward is in; set "
                   "train.advantage_aggregation: sum")
    if cfg.num_processes > 1:
        out.append(f"{KEY}: num_processes: {cfg.num_processes}; the advantages are computed over the batch gathered "
                   "from every process (a group may be cut between two), and every process must step together, so "
                   "each would wait for the slowest's last reward; overlap runs on one process")
    if ALGORITHM_SPECS[name].pairs_per_group:
        out.append(f"{KEY}: {name}'s training pairs (each group's best and worst sample) and so its shuffled "
                   "micro-batches are made from the advantages of every group; use another algorithm or remove "
                   "the key")
    return out


def overlap_notes(cfg) -> list[str]:
    """Overlap settings that change nothing in this run, each with why."""
    train, notes = cfg.train, []
    if train.reward_optimization_overlap and not any(entry.async_reward for entry in cfg.rewards):
        notes.append(f"{KEY}: no reward is async_reward: true, so every score is in when sampling ends; there is "
                     "nothing to overlap")
    if train.reward_optimization_overlap and train.reward_optimization_overlap_mode == "ready":
        notes.append("train.reward_optimization_overlap_mode: ready is read as ordered: the micro-batches keep the "
                     "order of a run without overlap (Flow-Factory's ready trains whichever is scored first, so its "
                     "update would depend on the rewards' timing)")
    if "reward_optimization_overlap_poll_interval" in train.model_fields_set:
        notes.append("train.reward_optimization_overlap_poll_interval: the loop waits on the rewards themselves; "
                     "there is no poll")
    return notes
