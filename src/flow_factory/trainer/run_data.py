"""What a run trains and evaluates on, read and checked before the model loads: the train and test prompts with
their condition files (an offline run's records instead of rollouts), the sizes each split generates at, the
epoch's draw, and each prompt's dataset when there are several."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError
from ..config.algorithms import OFFLINE_TRAINER_TYPES
from ..data import MissingPromptFile, epoch_sampler
from ..data.offline import OFFLINE_KINDS, load_offline_sources, offline_video
from ..data.sources import source_indices
from ..eval_sampling import eval_sizes
from ..sampling import load_split, split_size
from ..start_checks import check_prompt_counts

logger = logging.getLogger(__name__)


@dataclass
class RunData:
    train_prompts: list
    test_prompts: list  # empty: evaluation is off
    train_size: tuple[int, int]  # (height, width) of train's samples
    eval_sizes: dict[str, tuple[int, int]]  # (height, width) of each evaluated dataset's samples
    sampler: object | None  # the epoch's draw of prompts and groups (None: offline)
    offline_records: list | None  # sft, offline-dpo: the dataset's records train instead of rollouts
    source_names: list[str]  # several datasets: the names of those that train (empty: one dataset)
    train_sources: torch.Tensor | None  # each training prompt's dataset, by position in source_names
    eval_source_names: list[str]  # several datasets: the names of those evaluated (empty: one dataset)


def load_run_data(cfg, adapter_cls, num_processes: int, seed: int) -> RunData:
    """The run's prompts for the model ``adapter_cls`` (a PromptFileError or ConfigError naming the file, line or
    key when they do not fit it)."""
    train_type = cfg.train.trainer_type
    records = None
    if train_type in OFFLINE_TRAINER_TYPES:
        refused = adapter_cls.offline_refusal()
        if refused:
            raise ConfigError(f"train.trainer_type: {train_type} trains from a dataset's images or videos; "
                              f"{cfg.model.model_type} {refused}")
        records = load_offline_sources(cfg.data.split_sources("train"), "train", OFFLINE_KINDS[train_type],
                                       offline_video(cfg))
        if len(records) < num_processes:
            raise ConfigError(f"num_processes: {num_processes} processes, and the dataset holds {len(records)} "
                              "records: each process needs one")
        train_prompts = load_split(cfg, "train", adapter_cls, [r.item for r in records])
    else:
        train_prompts = load_split(cfg, "train", adapter_cls)
        check_prompt_counts(cfg, train_prompts)
    test_prompts = _test_prompts(cfg, adapter_cls, offline=records is not None)
    several = cfg.data.datasets is not None
    names = [s.name for s in cfg.data.split_sources("train")] if several else []
    return RunData(train_prompts, test_prompts,
                   train_size=split_size(cfg, "train", train_prompts, adapter_cls),
                   eval_sizes=eval_sizes(cfg, test_prompts, adapter_cls),
                   sampler=None if records else epoch_sampler(cfg, train_prompts, seed),
                   offline_records=records, source_names=names,
                   train_sources=source_indices(train_prompts, names) if names else None,
                   eval_source_names=[s.name for s in cfg.data.split_sources("test")] if several else [])


def _test_prompts(cfg, adapter_cls, offline: bool) -> list:
    """The test split when evaluation is on; a dataset without one trains without evaluation, as in
    Flow-Factory (a broken test file is still an error)."""
    if not cfg.eval.eval_freq or not (cfg.eval_rewards or cfg.rewards) or not cfg.data.split_sources("test"):
        return []  # an offline run may score nothing; each dataset may be left out of the evaluation (eval: false)
    for i, source in enumerate(cfg.data.sources):
        folder = Path(source.dataset_dir).expanduser()
        if not source.train and not any((folder / f"test.{ext}").is_file() for ext in ("jsonl", "txt")):
            raise ConfigError(f"data.datasets[{i}].train: false makes {source.name!r} evaluation-only, and {folder} "
                              "holds no test split (test.jsonl / test.txt), so the run would never read it; add "
                              "its test split, or remove the dataset")
    try:
        if offline:  # its test split holds records too: their prompts
            kind = OFFLINE_KINDS[cfg.train.trainer_type]
            return load_split(cfg, "test", adapter_cls,
                              [r.item for r in load_offline_sources(cfg.data.split_sources("test"), "test", kind,
                                                                    offline_video(cfg))])
        return load_split(cfg, "test", adapter_cls)
    except MissingPromptFile as missing:
        logger.warning("%s; evaluation is off for this run (eval.eval_freq: %d)", missing, cfg.eval.eval_freq)
        return []
