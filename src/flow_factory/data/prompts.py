"""Prompt datasets and the per-epoch prompt draw.

A dataset is a directory holding ``{split}.jsonl`` or ``{split}.txt`` (the layout
of flow_grpo's and Flow-Factory's prompt datasets; ``.jsonl`` wins when both are
there):

* ``.jsonl``: one JSON object a line, ``{"prompt": ..., "negative_prompt": ...}``
  (``negative_prompt`` optional). ``image`` / ``images`` and ``video`` / ``videos`` (a path or a
  list of paths) name the condition files of a conditioned model (editing, image- or
  video-to-video), relative to ``image_dir`` / ``video_dir`` (by default the dataset folder's
  ``images/`` and ``videos/``, as Flow-Factory's); each is opened here (``media.py``). Any other
  key is the row's ``metadata``, which rewards may ask for;
* ``.txt``: one prompt a line.

Blank lines at the end of a file are fine; a blank line before the last prompt
is an error, since it usually means a broken export. Every error names the file
and the 1-based line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from .media import MediaError, MediaFile, check_image, check_video


class PromptFileError(ValueError):
    """A prompt file that cannot be read; the message names the file and the line."""


class MissingPromptFile(PromptFileError, FileNotFoundError):
    """No file for a split in the dataset folder."""


@dataclass(frozen=True)
class PromptItem:
    prompt: str
    negative_prompt: str | None = None
    images: tuple[MediaFile, ...] = ()  # condition images, in the row's order
    videos: tuple[MediaFile, ...] = ()  # condition videos
    metadata: dict = field(default_factory=dict, hash=False)  # the row's other keys
    source: str | None = field(default=None, compare=False)  # "file:line", for errors about the row
    dataset: str | None = field(default=None, compare=False)  # its dataset's name (data.datasets)

    @property
    def condition_key(self) -> tuple:
        """What the row is conditioned on besides its text: rows with equal keys share an encoding."""
        return tuple(f.path for f in self.images), tuple(f.path for f in self.videos)


def _read_utf8(path: Path) -> str:
    """The file's text; not UTF-8 is an error naming the line, which Python's own error does not."""
    data = path.read_bytes()
    # files saved by Windows editors start with a BOM that is not part of the prompt
    data = data.removeprefix(b"\xef\xbb\xbf")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        # everything before the bad byte decoded; counted as splitlines counts, so the line number
        # matches the other errors of this file ("?" stands in for the bad byte)
        lines = (data[: e.start].decode("utf-8") + "?").splitlines()
        raise PromptFileError(f"{path}:{len(lines)}: not UTF-8 text (byte 0x{data[e.start]:02x} at column "
                         f"{len(lines[-1])}); save the file as UTF-8") from None


def _content_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, stripped text) up to the last non-blank line; blank ones before it are errors."""
    lines = _read_utf8(path).splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            raise PromptFileError(f"{path}:{number}: empty prompt (blank line before the end of the file)")
        out.append((number, line.strip()))
    return out


# the row keys that name condition files, by kind: Flow-Factory's singular and plural spellings
MEDIA_KEYS = {"images": ("image", "images"), "videos": ("video", "videos")}


def _media(path: Path, number: int, row: dict, kind: str, folder: Path) -> tuple[MediaFile, ...]:
    """The checked files the row names under ``image`` / ``images`` (or ``video`` / ``videos``)."""
    given = [k for k in MEDIA_KEYS[kind] if k in row]
    if len(given) > 1:
        raise PromptFileError(f"{path}:{number}: both {given[0]!r} and {given[1]!r}; give one of them")
    if not given:
        return ()
    key, value = given[0], row[given[0]]
    names = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip() for n in names):
        raise PromptFileError(f"{path}:{number}: {key!r} must be a path or a list of paths, got {value!r}")
    check = check_image if kind == "images" else check_video
    files = []
    for name in names:
        file = Path(name).expanduser()
        file = file if file.is_absolute() else folder / file
        try:
            files.append(check(file))
        except MediaError as e:
            raise PromptFileError(f"{path}:{number}: {key} {name!r} ({file}) {e}") from None
    return tuple(files)


def _parse_jsonl(path: Path, image_dir: Path | None = None, video_dir: Path | None = None,
                 limit: int | None = None) -> list[PromptItem]:
    """The rows of a jsonl file; only the first ``limit`` rows' condition files are opened."""
    image_dir = path.parent / "images" if image_dir is None else image_dir
    video_dir = path.parent / "videos" if video_dir is None else video_dir
    items = []
    for number, line in _content_lines(path):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise PromptFileError(f"{path}:{number}: expected a JSON object with a 'prompt' key, "
                             f"got {type(row).__name__}")
        if "prompt" not in row:
            raise PromptFileError(f"{path}:{number}: missing 'prompt' key (keys: {sorted(row)})")
        prompt, negative = row["prompt"], row.get("negative_prompt")
        if not isinstance(prompt, str):
            raise PromptFileError(f"{path}:{number}: 'prompt' must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise PromptFileError(f"{path}:{number}: empty prompt")
        if negative is not None and not isinstance(negative, str):
            raise PromptFileError(f"{path}:{number}: 'negative_prompt' must be a string or null, "
                             f"got {type(negative).__name__}")
        if limit is not None and len(items) >= limit:
            continue  # past max_size: the line is checked, its files are not opened
        images = _media(path, number, row, "images", image_dir)
        videos = _media(path, number, row, "videos", video_dir)
        known = {"prompt", "negative_prompt", *MEDIA_KEYS["images"], *MEDIA_KEYS["videos"]}
        metadata = {k: v for k, v in row.items() if k not in known}
        items.append(PromptItem(prompt.strip(), negative, images, videos, metadata, f"{path}:{number}"))
    return items


def _parse_txt(path: Path) -> list[PromptItem]:
    return [PromptItem(text, source=f"{path}:{number}") for number, text in _content_lines(path)]


def load_prompts(dataset_dir: str | Path, split: str = "train", max_size: int | None = None,
                 image_dir: str | Path | None = None, video_dir: str | Path | None = None) -> list[PromptItem]:
    """The prompts of ``split`` in ``dataset_dir``, in file order; the first ``max_size`` if given.
    Condition paths are relative to ``image_dir`` / ``video_dir`` (None: ``dataset_dir/images``,
    ``dataset_dir/videos``); every file a row names is checked here."""
    if max_size is not None and max_size < 1:
        raise ValueError(f"max_size must be a positive number of prompts or None, got {max_size}")
    directory = Path(dataset_dir).expanduser()
    candidates = [directory / f"{split}.jsonl", directory / f"{split}.txt"]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise MissingPromptFile(f"no {split} prompts in {directory}: looked for "
                                f"{' and '.join(p.name for p in candidates)}")
    if path.suffix == ".jsonl":
        folders = [None if d is None else Path(d).expanduser() for d in (image_dir, video_dir)]
        items = _parse_jsonl(path, *folders, limit=max_size)
    else:
        items = _parse_txt(path)
    if not items:
        raise PromptFileError(f"{path}: no prompts in the file")
    return items[:max_size] if max_size is not None else items


class EpochDraw(NamedTuple):
    """Unpacks as ``indices, group_ids = sampler.draw(epoch)``."""

    prompt_indices: Tensor  # (unique_per_epoch * group_size,) long, each prompt's group contiguous
    group_ids: Tensor  # (same,) long, 0 .. unique_per_epoch - 1, one per group


class EpochSampler:
    """Which prompts an epoch samples: ``unique_per_epoch`` distinct prompts, each
    repeated ``group_size`` times in a contiguous block (one GRPO group).

    The draw depends only on ``(seed, epoch)``, so a run resumed at epoch e draws
    what the uninterrupted run drew, on any number of processes. Epochs draw
    independently (as flow_grpo's sampler does): a prompt may come back in the
    next epoch before every other prompt was seen.
    """

    def __init__(self, num_prompts: int, unique_per_epoch: int, group_size: int, seed: int = 0):
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if not 1 <= unique_per_epoch <= num_prompts:
            raise ValueError(f"unique_per_epoch must be between 1 and the number of prompts "
                             f"({num_prompts}), got {unique_per_epoch}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_prompts = int(num_prompts)
        self.unique_per_epoch = int(unique_per_epoch)
        self.group_size = int(group_size)
        self.seed = int(seed)

    def _generator(self, epoch: int) -> torch.Generator:
        # SeedSequence mixes (seed, epoch) into well-separated streams; seed + epoch would
        # make (seed=0, epoch=1) and (seed=1, epoch=0) draw the same prompts
        state = np.random.SeedSequence([self.seed, int(epoch)]).generate_state(1, dtype=np.uint64)[0]
        return torch.Generator().manual_seed(int(state) & 0x7FFF_FFFF_FFFF_FFFF)

    def draw(self, epoch: int) -> EpochDraw:
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        chosen = torch.randperm(self.num_prompts, generator=self._generator(epoch))[: self.unique_per_epoch]
        indices = chosen.repeat_interleave(self.group_size)
        groups = torch.arange(self.unique_per_epoch).repeat_interleave(self.group_size)
        return EpochDraw(indices, groups)

    def __len__(self) -> int:
        """Samples per epoch."""
        return self.unique_per_epoch * self.group_size


def share_slice(n: int, rank: int, num_processes: int) -> slice:
    """Process ``rank``'s contiguous share of ``n`` items (an epoch's samples, the test prompts): the
    first ``n % num_processes`` processes take one more, so the shares, in process order, hold every item
    once and differ in size by at most one; with fewer items than processes the last shares are empty."""
    base, extra = divmod(n, num_processes)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def process_share(num_samples: int, rank: int, num_processes: int, batch_size: int | None = None) -> Tensor:
    """Which of an epoch's ``num_samples`` (group-ordered) samples process ``rank`` samples and trains.

    Default: a contiguous share (``share_slice``), so most groups sit whole on one process. With
    ``batch_size`` (a lockstep algorithm, DGPO): the epoch is cut into global micro-batches of
    ``num_processes x batch_size`` samples and the process takes its ``batch_size`` of each, in order, so
    its m-th micro-batch is its part of the m-th global one, and whole groups fill a global micro-batch
    when its size is a multiple of the group size (Flow-Factory's group-distributed sampler)."""
    if batch_size is None:
        return torch.arange(num_samples)[share_slice(num_samples, rank, num_processes)]
    if num_samples % (num_processes * batch_size):
        raise ValueError(f"train: {num_samples} samples per epoch (unique_sample_num_per_epoch x group_size) do "
                         f"not split into global micro-batches of {num_processes} x {batch_size} (num_processes x "
                         "per_device_batch_size)")
    return torch.arange(num_samples).view(-1, num_processes, batch_size)[:, rank].reshape(-1)
