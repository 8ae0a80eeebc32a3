"""Offline data: Flow-Factory's version-2 JSONL records, for training from images instead of rollouts.

A row names the model's input and what it is supervised with, as Flow-Factory's ``schema_version: 2``::

    {"schema_version": 2,
     "input": {"prompt": "a red cube", "negative_prompt": null, "media": [{"type": "image", "path": "in.png"}]},
     "supervision": {"type": "demonstration", "target": {"media": [{"type": "image", "path": "cube.png"}]}},
     "metadata": {}}

``supervision.type: preference`` gives ``chosen`` and ``rejected`` instead of ``target``. Paths are relative
to the dataset folder. ``sft`` trains on demonstrations, ``offline-dpo`` on preferences; every row of a file
must be of the run's kind. An output is one image for an image model, one video file for a video model
(``{"type": "video", "path": "clip.mp4", "fps": 24.0}``): ``train.num_frames`` frames of it train, its first
ones, or with ``train.frame_rate`` the frames shown at times 0, 1/frame_rate, 2/frame_rate, ... of the source
(whose rate is the record's ``fps``, else the file's own), as Flow-Factory projects source timestamps onto the
model's clock; a video too short for them is refused. A pair's two sides share the row's input (its prompt and condition images or video). Every file a row names is
opened when the records load, before the model does: a missing or unreadable file, a file of the wrong kind
(a video where the model makes images, an image where it makes videos), a video shorter than
``train.num_frames`` (at ``train.frame_rate``), a pair whose two sides differ in size or frame count, or another schema version is an
error naming the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .media import MediaError, MediaFile, check_image, check_video
from .prompts import PromptFileError, PromptItem

OFFLINE_KINDS = {"sft": "demonstration", "offline-dpo": "preference"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Media(_Strict):
    type: Literal["image", "video", "audio"]
    path: str = Field(min_length=1)
    slot: str | None = None
    fps: float | None = None
    sample_rate: int | None = None


class _Candidate(_Strict):
    media: list[_Media] = Field(min_length=1)


class _Input(_Strict):
    prompt: str = Field(min_length=1)
    negative_prompt: str | None = None
    media: list[_Media] = []


class _Supervision(_Strict):
    type: Literal["demonstration", "preference"]
    target: _Candidate | None = None
    chosen: _Candidate | None = None
    rejected: _Candidate | None = None


class _Record(_Strict):
    schema_version: Literal[2]
    input: _Input
    supervision: _Supervision
    metadata: dict = {}


@dataclass(frozen=True)
class OfflineRecord:
    """One row: its prompt (with the input's condition images or videos, a ``PromptItem``) and its outputs
    (images or videos), ``(target,)`` for a demonstration or ``(chosen, rejected)`` for a preference."""

    item: PromptItem
    outputs: tuple[MediaFile, ...]
    frames: tuple[tuple[int, ...] | None, ...] = ()  # per output video, the frames that train (None: an image)
    sounds: tuple[Path | None, ...] = ()  # per output of a model with sound (LTX-2), its soundtrack's file


@dataclass(frozen=True)
class VideoOutputs:
    """What trains of a video model's output video: ``num_frames`` frames, consecutive, or at ``frame_rate`` fps
    of the source's clock (``train.frame_rate``); with ``audio`` (LTX-2), an output is a video and its soundtrack."""

    num_frames: int
    frame_rate: float | None = None
    audio: bool = False

    def indices(self, fps: float | None) -> tuple[int, ...]:
        """The source frames that train, from a video at ``fps``: the frame nearest each time k / frame_rate (as
        Flow-Factory rounds), or the first ``num_frames``."""
        if self.frame_rate is None:
            return tuple(range(self.num_frames))
        return tuple(round(k * fps / self.frame_rate) for k in range(self.num_frames))


def load_offline(dataset_dir: str | Path, split: str, kind: str, max_size: int | None = None,
                 dataset: str | None = None, video: VideoOutputs | None = None) -> list[OfflineRecord]:
    """The records of ``split``.jsonl in ``dataset_dir`` of supervision ``kind`` (demonstration or preference),
    every file they name checked (PromptFileError naming file and line). ``video``: None for a model of images;
    for a video model, the frames that train of each output video (``offline_video``)."""
    folder = Path(dataset_dir).expanduser()
    path = folder / f"{split}.jsonl"
    if not path.is_file():
        from .prompts import MissingPromptFile

        raise MissingPromptFile(f"no {split} records in {folder}: looked for {path.name} (offline training reads "
                                "schema_version 2 jsonl)")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = _Record.model_validate(json.loads(line))
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        except ValidationError as e:
            first = e.errors()[0]
            at = ".".join(str(p) for p in first["loc"])
            raise PromptFileError(f"{where}: {at}: {first['msg']} (a schema_version 2 record: input, "
                                  "supervision, metadata)") from None
        if row.supervision.type != kind:
            raise PromptFileError(f"{where}: supervision type {row.supervision.type!r}; this run trains on "
                                  f"{kind} records only")
        if max_size is not None and len(records) >= max_size:
            continue
        outputs, frames, sounds = _outputs(row.supervision, kind, where, folder, video)
        if any(m.type == "audio" for m in row.input.media):
            raise PromptFileError(f"{where}: input.media: audio inputs are not in this version")
        images = tuple(_check(m, f"{where}: input.media", folder) for m in row.input.media if m.type == "image")
        videos = tuple(_check(m, f"{where}: input.media", folder) for m in row.input.media if m.type == "video")
        item = PromptItem(row.input.prompt.strip(), row.input.negative_prompt, images, videos, dict(row.metadata),
                          where, dataset=dataset)
        records.append(OfflineRecord(item, outputs, frames, sounds))
    if not records:
        raise PromptFileError(f"{path}: no records in the file")
    return records


def _outputs(supervision: _Supervision, kind: str, where: str, folder: Path,
             video: VideoOutputs | None) -> tuple[tuple[MediaFile, ...], tuple, tuple]:
    """A row's outputs, checked: ``(target,)`` or ``(chosen, rejected)``, the two of one size and length; the
    frames of each that train, and each one's soundtrack (a model with sound)."""
    wanted = ("target",) if kind == "demonstration" else ("chosen", "rejected")
    missing = [name for name in wanted if getattr(supervision, name) is None]
    if missing:
        raise PromptFileError(f"{where}: supervision.{missing[0]} is missing: a {kind} names {' and '.join(wanted)}")
    checked = [_output(getattr(supervision, name).media, f"{where}: supervision.{name}", folder, video)
               for name in wanted]
    outputs, frames, sounds = (tuple(c[i] for c in checked) for i in range(3))
    if kind == "preference":
        (a, b), noun = outputs, "videos" if video else "images"
        if a.size != b.size:
            raise PromptFileError(f"{where}: chosen is {a.size[0]}x{a.size[1]} and rejected {b.size[0]}x{b.size[1]}: "
                                  f"a pair's two {noun} must be one size")
        if a.frames != b.frames:
            raise PromptFileError(f"{where}: chosen ({a.path.name}) has {a.frames} frames and rejected "
                                  f"({b.path.name}) {b.frames}: a pair's two videos must have as many frames")
    return outputs, frames, sounds


def _output(media: list[_Media], where: str, folder: Path,
            video: VideoOutputs | None) -> tuple[MediaFile, tuple[int, ...] | None, Path | None]:
    """The one image (``video`` None) or video an output candidate names (with its soundtrack for a model with
    sound, LTX-2: ``[video, audio]``, as Flow-Factory orders them), the frames of it that train, the sound's file."""
    want = ["video", "audio"] if video and video.audio else ["video"] if video else ["image"]
    if [m.type for m in media] != want:
        one, made = {"image": ("one image", "images (video and audio outputs are for video models)"),
                     "video": ("one video", "videos"),
                     "audio": ("a video and its audio, in that order", "videos with sound")}[want[-1]]
        raise PromptFileError(f"{where}: {[m.type for m in media]}: an output here is {one}: this model makes {made}")
    file = _check(media[0], where, folder)
    if video is None:
        return file, None, None
    return file, _frames(media[0], file, where, video), _sound(media[1], where, folder) if video.audio else None


def _sound(media: _Media, where: str, folder: Path) -> Path:
    from ..media.audio import check_audio

    path = Path(media.path).expanduser()
    path = path if path.is_absolute() else folder / path
    if not path.is_file():
        raise PromptFileError(f"{where} {media.path!r} ({path}) not found")
    try:
        check_audio(path)
    except ValueError as e:
        raise PromptFileError(f"{where} {media.path!r} ({path}) {e}") from None
    return path


def _frames(media: _Media, file: MediaFile, where: str, video: VideoOutputs) -> tuple[int, ...]:
    """The frames of an output video that train (``VideoOutputs.indices``), or an error if it is too short."""
    named, n = f"{where} {media.path!r} ({file.path})", video.num_frames
    fps = media.fps or file.fps
    if video.frame_rate is None:
        if file.frames < n:
            raise PromptFileError(f"{named} has {file.frames} frames; train.num_frames is {n} (a video's first "
                                  "num_frames frames train)")
        return video.indices(fps)
    if not fps:
        raise PromptFileError(f"{named}: its frame rate is unknown; give it as the media's fps (train.frame_rate "
                              f"{video.frame_rate:g} reads the video on its clock)")
    indices = video.indices(fps)
    if indices[-1] >= file.frames:
        raise PromptFileError(f"{named} has {file.frames} frames at {fps:g} fps ({file.frames / fps:.3g} s); "
                              f"train.num_frames {n} at train.frame_rate {video.frame_rate:g} reads its frame at "
                              f"{(n - 1) / video.frame_rate:.3g} s")
    return indices


def _check(media: _Media, where: str, folder: Path) -> MediaFile:
    file = Path(media.path).expanduser()
    file = file if file.is_absolute() else folder / file
    try:
        return (check_image if media.type == "image" else check_video)(file)
    except MediaError as e:
        raise PromptFileError(f"{where} {media.path!r} ({file}) {e}") from None


def load_offline_sources(sources, split: str, kind: str, video: VideoOutputs | None = None) -> list[OfflineRecord]:
    """The records of ``split`` of every dataset (``data.sources``), each item's ``dataset`` its name (``video``:
    as ``load_offline``)."""
    return [record for source in sources
            for record in load_offline(source.dataset_dir, split, kind,
                                       source.eval_max_dataset_size if split == "test" and source.eval_max_dataset_size
                                       else source.max_dataset_size, dataset=source.name, video=video)]


def offline_video(cfg) -> VideoOutputs | None:
    """``load_offline``'s ``video`` for a run: a video model's ``train.num_frames`` and ``frame_rate`` (LTX-2: its
    24 fps, its soundtrack too), else None."""
    if not cfg.model.is_video:
        return None
    from ..config.families import model_family

    own = model_family(cfg.model.model_type).audio_fps  # a family with sound reads at its own frame rate
    return VideoOutputs(cfg.train.num_frames, cfg.train.frame_rate or own, audio=own is not None)
