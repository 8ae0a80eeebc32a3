"""The reward interface: pointwise and groupwise reward models.

Follows Flow-Factory's documented contract so its reward classes port with few
changes: a subclass declares ``required_fields`` (which inputs it wants) and
``use_tensor_inputs`` (tensors or PIL), and implements
``__call__(prompt, image, video, condition_images, condition_videos)`` returning a
``RewardModelOutput`` with one score per sample it was given.

What a subclass receives for each field (only the fields it names are passed):

| field              | use_tensor_inputs=True             | use_tensor_inputs=False          |
|--------------------|------------------------------------|----------------------------------|
| prompt             | list[str]                          | list[str]                        |
| image              | Tensor (n, 3, H, W) in [0, 1]      | list[PIL.Image]                  |
| video              | Tensor (n, F, 3, H, W) in [0, 1]   | list[list[PIL.Image]] (frames)   |
| condition_images   | list (per sample) of Tensor (k, 3, H, W) or list of (3, H, W) | list[list[PIL.Image]] |
| condition_videos   | list (per sample) of Tensor (k, F, 3, H, W) or list of (F, 3, H, W) | list[list[list[PIL.Image]]] |
| audio              | Tensor (n, C, T) in [-1, 1]        | list[np.ndarray] (C, T) each     |
| audio_sample_rate  | list[int] (one per sample)         | list[int]                        |
| metadata           | list[dict]                         | list[dict]                       |

``condition_images`` / ``condition_videos`` are the condition files a conditioned model generated
from (an edit's source image), resized as the model saw them; a sample's conditions are one tensor
when their sizes agree. ``audio`` is the soundtrack of a model that makes one (LTX-2), decoded only
when a reward asks for it; as in Flow-Factory, a reward that lists ``audio`` and takes an
``audio_sample_rate`` argument also receives the rate without listing it. ``metadata`` is each
sample's dataset row without its prompt and condition keys (``{}`` for a row with none). A
requested field that the caller did not provide arrives as ``None``.
Unlike Flow-Factory, tensor media arrive as one stacked tensor rather than a list
of per-sample tensors: iterating or indexing it behaves the same, and a model can
use it as a batch without stacking.

Pointwise models are called on chunks of at most ``batch_size`` samples;
groupwise models once per group, with the whole group, whatever ``batch_size``.
Rewards never see gradients: scoring runs under ``torch.no_grad``.

``model.score(inputs, group_ids)`` is the one scoring path: the RewardSet (training and
evaluation), its async workers and the reward server all call it. The inputs hold tensors
(from the sampler) or PIL images (from the reward server, which decodes what clients send);
either way each reward gets the form it asks for, and a tensor-input reward given images of
several sizes is called once per size (one tensor cannot hold them).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from ..hparams import RewardArguments
from ..precision import dtype_of

MEDIA_FIELDS = ("image", "video", "condition_images", "condition_videos", "audio")
KNOWN_FIELDS = ("prompt", *MEDIA_FIELDS, "audio_sample_rate", "metadata")


# ``"bf16"``, ``"bfloat16"``, ``"torch.float32"`` or a torch.dtype -> torch.dtype (precision.py's rule)
parse_dtype = dtype_of


@dataclass
class RewardModelOutput:
    rewards: Tensor | np.ndarray | Sequence[float]  # one score per input sample
    extra_info: dict[str, Any] | None = None


# --- media conversion ---------------------------------------------------------


def to_uint8_hwc(images: Tensor) -> np.ndarray:
    """(..., 3, H, W) floats in [0, 1] -> (..., H, W, 3) uint8, rounding as flow_grpo does."""
    x = (images.detach().float().cpu() * 255).round().clamp(0, 255).to(torch.uint8)
    return x.movedim(-3, -1).numpy()


def images_to_pil(images: Tensor) -> list[Image.Image]:
    """(B, 3, H, W) in [0, 1] -> B RGB images."""
    return [Image.fromarray(a) for a in to_uint8_hwc(images)]


def videos_to_pil(videos: Tensor) -> list[list[Image.Image]]:
    """(B, F, 3, H, W) in [0, 1] -> B lists of F RGB frames."""
    return [[Image.fromarray(f) for f in clip] for clip in to_uint8_hwc(videos)]


def _condition_images_to_pil(per_sample: list) -> list[list[Image.Image]]:
    # each entry: a (k, 3, H, W) tensor, or a list of (3, H, W) tensors of varying sizes
    return [[Image.fromarray(to_uint8_hwc(img)) for img in conds] for conds in per_sample]


def _condition_videos_to_pil(per_sample: list) -> list[list[list[Image.Image]]]:
    return [[[Image.fromarray(f) for f in to_uint8_hwc(clip)] for clip in conds] for conds in per_sample]


def pil_to_tensor(images: Sequence[Image.Image], what: str = "images") -> Tensor:
    """RGB images of one size -> (n, 3, H, W) float32 in [0, 1]: the inverse of ``images_to_pil``."""
    sizes = {im.size for im in images}
    if len(sizes) > 1:
        raise ValueError(f"{what}: a tensor-input reward needs images of one size, got {sorted(sizes)}")
    return torch.from_numpy(np.stack([np.asarray(im) for im in images])).permute(0, 3, 1, 2).float() / 255


def _videos_to_tensor(videos: list) -> Tensor:
    return torch.stack([pil_to_tensor(frames, "video frames") for frames in videos])


def _condition_images_to_tensor(per_sample: list) -> list[Tensor]:
    return [pil_to_tensor(conds, "condition_images") for conds in per_sample]


def _condition_videos_to_tensor(per_sample: list) -> list[Tensor]:
    return [_videos_to_tensor(clips) for clips in per_sample]


def _audio_to_arrays(audio: Tensor) -> list[np.ndarray]:
    return list(audio.detach().float().cpu().numpy())


def _arrays_to_audio(audio: list) -> Tensor:
    return torch.stack([torch.as_tensor(np.asarray(a), dtype=torch.float32) for a in audio])


# field -> (tensors to PIL, PIL to tensors), in the layouts of the module docstring's table
_CONVERT = {
    "image": (images_to_pil, pil_to_tensor),
    "video": (videos_to_pil, _videos_to_tensor),
    "condition_images": (_condition_images_to_pil, _condition_images_to_tensor),
    "condition_videos": (_condition_videos_to_pil, _condition_videos_to_tensor),
    "audio": (_audio_to_arrays, _arrays_to_audio),  # waveforms, not pictures: numpy arrays stand for PIL
}


def _first_leaf(media: Any) -> Any:
    """The first image or tensor inside nested lists (None when they are all empty)."""
    if not isinstance(media, (list, tuple)):
        return media
    for item in media:
        leaf = _first_leaf(item)
        if leaf is not None:
            return leaf
    return None


def _holds_pil(media: Any, name: str = "image") -> bool:
    """Whether field ``name`` holds its non-tensor form: PIL images, or numpy arrays for the audio."""
    return isinstance(_first_leaf(media), np.ndarray if name == "audio" else Image.Image)


def _take(media: Any, idx: list[int]) -> Any:
    if media is None:
        return None
    if isinstance(media, Tensor):
        return media[torch.as_tensor(idx, dtype=torch.long, device=media.device)]
    return [media[i] for i in idx]


def _size(media: Any, i: int) -> tuple | None:
    """Sample ``i``'s picture size (a video's first frame); one stacked tensor has one size."""
    if media is None:
        return None
    if isinstance(media, Tensor):
        return tuple(media.shape[-2:])
    leaf = _first_leaf(media[i])
    return None if leaf is None else leaf.size


# --- the inputs of one reward call ----------------------------------------------


@dataclass
class RewardInputs:
    """A batch of samples to score; every present field has one entry per prompt.

    Media are tensors in [0, 1] (``image`` (B, 3, H, W), ``video`` (B, F, 3, H, W), as the
    sampler makes them) or PIL images (lists as in the module docstring's table, as the
    reward server decodes them). ``pil`` and ``tensors`` give a field in either form.
    """

    prompt: list[str]
    image: Tensor | list | None = None
    video: Tensor | list | None = None
    condition_images: list | None = None  # per sample
    condition_videos: list | None = None  # per sample
    audio: Tensor | list | None = None  # waveforms (B, C, T) in [-1, 1], or numpy (C, T) each
    audio_sample_rate: int | None = None  # of ``audio``
    metadata: list[dict] | None = None  # per sample: the dataset row's other keys; None = {} for every sample
    _pil_cache: dict[str, list] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        n = len(self.prompt)
        if self.metadata is None:
            self.metadata = [{} for _ in range(n)]
        elif len(self.metadata) != n:
            raise ValueError(f"{len(self.metadata)} metadata for {n} prompts; need one per prompt")
        if isinstance(self.image, Tensor) and (self.image.ndim != 4 or self.image.shape[1] != 3):
            raise ValueError(f"images must be (B, 3, H, W), got shape {tuple(self.image.shape)}")
        if isinstance(self.video, Tensor) and (self.video.ndim != 5 or self.video.shape[2] != 3):
            raise ValueError(f"videos must be (B, F, 3, H, W), got shape {tuple(self.video.shape)}")
        if isinstance(self.audio, Tensor) and self.audio.ndim != 3:
            raise ValueError(f"audio must be (B, channels, samples), got shape {tuple(self.audio.shape)}")
        if self.audio is not None and self.audio_sample_rate is None:
            raise ValueError("audio needs its audio_sample_rate")
        for name in MEDIA_FIELDS:
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"{len(value)} {name} for {n} prompts; need one per prompt")

    def __len__(self) -> int:
        return len(self.prompt)

    def select(self, index: Sequence[int]) -> "RewardInputs":
        """Samples ``index``, in that order."""
        idx = list(index)
        sub = RewardInputs([self.prompt[i] for i in idx], *(_take(getattr(self, name), idx) for name in MEDIA_FIELDS),
                           audio_sample_rate=self.audio_sample_rate, metadata=[self.metadata[i] for i in idx])
        # PIL conversion is done once per batch, not once per chunk or per reward
        sub._pil_cache = {k: [v[i] for i in idx] for k, v in self._pil_cache.items()}
        return sub

    @classmethod
    def concat(cls, parts: Sequence["RewardInputs"]) -> "RewardInputs":
        """The samples of ``parts`` one after another; every part holds the same fields in the same form."""
        def join(name: str):
            values = [getattr(part, name) for part in parts]
            if values[0] is None:
                return None
            return torch.cat(values) if isinstance(values[0], Tensor) else [x for v in values for x in v]

        rates = {part.audio_sample_rate for part in parts}
        if len(rates) > 1:
            raise ValueError(f"audio of several sample rates {sorted(rates)} cannot be scored together")
        return cls([p for part in parts for p in part.prompt], *(join(name) for name in MEDIA_FIELDS),
                   audio_sample_rate=rates.pop(), metadata=[m for part in parts for m in part.metadata])

    def pil(self, name: str) -> list | None:
        """Field ``name`` as PIL images (audio: numpy arrays); tensors are converted once and kept."""
        value = getattr(self, name)
        if value is None or _holds_pil(value, name):
            return value
        if name not in self._pil_cache:
            self._pil_cache[name] = _CONVERT[name][0](value)
        return self._pil_cache[name]

    def tensors(self, name: str) -> Tensor | list | None:
        """Field ``name`` as tensors; PIL images are converted at each call, which the scoring
        makes on one chunk at a time, so the float copies stay small."""
        value = getattr(self, name)
        if value is None or not _holds_pil(value, name):
            return value
        return _CONVERT[name][1](value)

    def size_of(self, i: int) -> tuple:
        """Sample ``i``'s image size and video frame size: samples of one size can share a tensor."""
        return _size(self.image, i), _size(self.video, i)


# --- reward models --------------------------------------------------------------


class BaseRewardModel:
    """Shared constructor and call plumbing. Subclass ``PointwiseRewardModel`` or
    ``GroupwiseRewardModel``, not this.

    Two constructor forms; ``takes_config`` tells which one a class uses, and the RewardSet
    builds it accordingly:

    - Flow-Factory's: ``__init__(self, config: RewardArguments, accelerator: Accelerator)``
      calling ``super().__init__(config, accelerator)``. ``config`` is the whole reward entry
      (``flow_factory.hparams.RewardArguments``: the entry's own keys are its attributes),
      and ``self.config``, ``self.accelerator``, ``self.device`` (the process's device when
      the entry's ``device`` is null or ``cuda``), ``self.dtype`` are set.
    - The keyword form: ``__init__(self, model_name_or_path, device, dtype, batch_size,
      *, <the entry's own keys>)`` calling ``super().__init__(model_name_or_path, device,
      dtype, batch_size)``; a misspelt option fails on the signature instead of being
      ignored. ``self.config`` and ``self.accelerator`` are None.
    """

    required_fields: ClassVar[tuple[str, ...]] = ("prompt", "image")
    use_tensor_inputs: ClassVar[bool] = False

    @classmethod
    def models_to_load(cls, options: dict) -> list[str]:
        """The hub ids or folders the reward loads, given its entry's constructor options: ``ff-train`` checks
        each is here or reachable before a run starts. Its ``model_name_or_path``, unless a subclass says more
        (its default checkpoint, a processor) or less (a model a server runs)."""
        return [options["model_name_or_path"]] if options.get("model_name_or_path") else []

    @classmethod
    def servers_to_reach(cls, options: dict) -> list[str]:
        """The URLs the reward scores on (a reward server, a VLM's API): ``ff-train`` checks each answers
        before a run starts. None unless a subclass says."""
        return []

    def __init__(self, *args, **kwargs):
        # the config form arrives with the entry first (or as config=); anything else is the keyword form
        if (args and isinstance(args[0], RewardArguments)) or "config" in kwargs:
            self._init_from_config(*args, **kwargs)
        else:
            self._init_from_options(*args, **kwargs)

    def _init_from_config(self, config: RewardArguments, accelerator=None) -> None:
        if accelerator is None:  # built outside a run: the process's accelerator state, as a run would share it
            from accelerate import Accelerator

            accelerator = Accelerator()
        # Flow-Factory reads "cuda" as this process's GPU (cuda:<local rank>), and the CPU on a CPU run
        device = accelerator.device if config.device in (None, "cuda") else config.device
        self._init_from_options(config.model_name_or_path, device, config.dtype, config.batch_size)
        self.config, self.accelerator = config, accelerator

    def _init_from_options(self, model_name_or_path: str | None = None, device: str | torch.device = "cpu",
                           dtype: str | torch.dtype = torch.float32, batch_size: int = 16) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"{type(self).__name__}: batch_size must be >= 1, got {batch_size}")
        unknown = [f for f in self.required_fields if f not in KNOWN_FIELDS]
        if unknown:
            raise ValueError(f"{type(self).__name__}.required_fields has unknown {unknown}; "
                             f"known fields: {list(KNOWN_FIELDS)}")
        self.config: RewardArguments | None = None
        self.accelerator = None
        self.model_name_or_path = model_name_or_path
        self.device = torch.device(device)
        self.dtype = parse_dtype(dtype)
        self.batch_size = int(batch_size)
        self.model: torch.nn.Module | None = None  # set by subclasses that wrap a network

    def __call__(self, prompt: list[str] | None = None, image=None, video=None,
                 condition_images=None, condition_videos=None) -> RewardModelOutput:
        raise NotImplementedError  # abstract: each reward defines its scoring

    def score(self, inputs: RewardInputs, group_ids: Tensor | None = None) -> Tensor:
        """(B,) float32 scores on the CPU, in input order. ``group_ids`` (B,) mark which
        samples share a prompt; only groupwise models read them."""
        raise NotImplementedError  # Pointwise- and GroupwiseRewardModel define it

    def to(self, device: str | torch.device) -> "BaseRewardModel":
        if self.model is not None:
            self.model.to(device)
        self.device = torch.device(device)
        return self

    def _convert_media(self, inputs: RewardInputs) -> None:
        """PIL-convert the whole batch before it is split, so chunks and other rewards reuse it."""
        if not self.use_tensor_inputs:
            for name in self.required_fields:
                if name in MEDIA_FIELDS:
                    inputs.pil(name)

    def _score_once(self, inputs: RewardInputs) -> Tensor:
        """One ``__call__`` on ``inputs`` with only the required fields; -> float32 (n,) on CPU."""
        names = list(self.required_fields)
        # Flow-Factory passes the rate with the audio to a reward that takes it (its CLAP lists only "audio")
        if "audio" in names and "audio_sample_rate" not in names and _takes(self, "audio_sample_rate"):
            names.append("audio_sample_rate")
        kwargs = {}
        for name in names:
            if name in ("prompt", "metadata"):
                kwargs[name] = getattr(inputs, name)
            elif name == "audio_sample_rate":  # one per sample, as Flow-Factory gives it
                kwargs[name] = None if inputs.audio is None else [inputs.audio_sample_rate] * len(inputs)
            else:
                kwargs[name] = inputs.tensors(name) if self.use_tensor_inputs else inputs.pil(name)
        with torch.no_grad():
            out = self(**kwargs)
        rewards = out.rewards if isinstance(out, RewardModelOutput) else out
        if isinstance(rewards, Tensor):
            scores = rewards.detach().float().cpu().reshape(-1)
        else:
            scores = torch.from_numpy(np.asarray(rewards, dtype=np.float32)).reshape(-1)
        if scores.numel() != len(inputs):
            raise ValueError(f"{type(self).__name__} returned {scores.numel()} rewards "
                             f"for {len(inputs)} samples")
        return scores


def _takes(reward: BaseRewardModel, argument: str) -> bool:
    """Whether the reward's ``__call__`` accepts ``argument`` (by name, or through ``**kwargs``)."""
    params = inspect.signature(reward.__call__).parameters.values()
    return any(p.name == argument or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class PointwiseRewardModel(BaseRewardModel):
    """Scores each sample on its own; called on chunks of at most ``batch_size`` samples."""

    def score(self, inputs: RewardInputs, group_ids: Tensor | None = None) -> Tensor:
        self._convert_media(inputs)
        scores = torch.zeros(len(inputs), dtype=torch.float32)
        for chunk in self._chunks(inputs):
            scores[chunk] = self._score_once(inputs.select(chunk))
        return scores

    def _chunks(self, inputs: RewardInputs) -> list[list[int]]:
        """Sample indices in calls of at most ``batch_size``, in order. A tensor-input reward's
        calls each hold one image size (sizes by first appearance): a stacked batch has one
        size anyway, the reward server's merged requests may not."""
        by_size: dict[tuple, list[int]] = {}
        for i in range(len(inputs)):
            by_size.setdefault(inputs.size_of(i) if self.use_tensor_inputs else (), []).append(i)
        step = self.batch_size
        return [indices[k:k + step] for indices in by_size.values() for k in range(0, len(indices), step)]


class GroupwiseRewardModel(BaseRewardModel):
    """Scores a group of samples of one prompt together (ranks, pairwise preferences).

    Called once per group with every sample of that group, in batch order;
    ``batch_size`` is a hint for the model's own internal batching.
    """

    def score(self, inputs: RewardInputs, group_ids: Tensor | None = None) -> Tensor:
        """Samples sharing a group id are scored in one call."""
        if group_ids is None:
            raise ValueError(f"{type(self).__name__} scores groups of samples: it needs group_ids")
        group_ids = torch.as_tensor(group_ids).reshape(-1).cpu()
        if group_ids.numel() != len(inputs):
            raise ValueError(f"{group_ids.numel()} group ids for {len(inputs)} samples")
        self._convert_media(inputs)
        scores = torch.zeros(len(inputs), dtype=torch.float32)
        # groups in order of first appearance, so calls follow the batch order
        seen: dict[int, list[int]] = {}
        for i, g in enumerate(group_ids.tolist()):
            seen.setdefault(g, []).append(i)
        for members in seen.values():
            scores[torch.as_tensor(members)] = self._score_once(inputs.select(members))
        return scores


def takes_config(cls: type[BaseRewardModel]) -> bool:
    """Whether ``cls`` is built as Flow-Factory builds rewards, ``cls(config, accelerator)``, rather
    than with keyword options: its ``__init__``'s first parameter is named ``config``, or it has
    none of its own (the base takes either form; Flow-Factory's classes without one are built so).
    The one place that tells the two forms apart."""
    if cls.__init__ is BaseRewardModel.__init__:
        return True
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # after self
    return bool(params) and params[0].name == "config" and params[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def score_each_once(models: Iterable[BaseRewardModel], inputs: RewardInputs,
                    group_ids: Tensor | None = None) -> dict[int, Tensor]:
    """``{id(model): scores}``: an instance that several reward entries share scores the batch once."""
    scored: dict[int, Tensor] = {}
    for model in models:
        if id(model) not in scored:
            scored[id(model)] = model.score(inputs, group_ids)
    return scored
