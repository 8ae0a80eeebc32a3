"""The prompt cache: every prompt's text conditioning, encoded once, read from disk after; and for a
conditioned model its condition files' encodings (``ConditionCache``), the same way.

Flow-Factory's preprocessing (``data.enable_preprocess``): before training, each distinct
(prompt, negative prompt, CFG or not) of the train and test splits is encoded once, in
batches of ``data.preprocessing_batch_size``, into safetensors shards under
``data.cache_dir/<fingerprint>/``. Training then reads the rows it needs (memory-mapped),
so the text encoders can leave the device.

Never stale: the folder is named by a fingerprint of everything the encoding depends on
(the adapter class and text length, each text encoder's config and a checksum of every
weight tensor, each tokenizer's class, length limit and vocabulary; dtypes included), and an
entry by a hash of its prompt, negative prompt and CFG flag. Never corrupt: a shard is
written beside its final name and renamed once complete, and its name carries the
sha256 of its bytes, checked when the cache is opened; a shard that does not match is
removed (with a warning) and its prompts are encoded again. With several processes each
entry has one owner (by its place in the list), which encodes it if it is missing, and all read
the shards once every process is done (waiting a bounded time for a shared file system to list the
others' shards).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save
from tqdm.auto import tqdm

from .data import read_image, read_video
from .models.conditioning import Conditioning, pad_cat

logger = logging.getLogger(__name__)
FORMAT = 1  # bump when what a shard holds changes
SAMPLED_VALUES = 4096  # values of each weight tensor that enter the fingerprint
# how long a process waits, after the barrier, for the others' shards to show in the folder: a shared
# file system (NFS, data.preprocess_parallelism: global) may list a file written on another machine
# only after its directory cache expires (NFS's acdirmax is 60 s by default)
VISIBLE_WITHIN_S = 90.0
# a config's entries about itself, which no encoding depends on: names, versions, and diffusers' list of the keys
# left at their defaults (their values are hashed; the list is built from a set, in an order each interpreter's
# hash seed decides, so the processes of one launch would name different folders)
NOT_HASHED = ("_name_or_path", "transformers_version", "_diffusers_version", "_use_default_values")


def hashed_config(config: Mapping) -> str:
    """A config's entries that an encoding depends on, as the fingerprints hash them (a set's items sorted: its
    own order is the hash seed's)."""
    return json.dumps({k: v for k, v in config.items() if k not in NOT_HASHED}, sort_keys=True, default=_json_value)


def _json_value(value) -> object:
    return sorted(map(str, value)) if isinstance(value, (set, frozenset)) else str(value)


def encoder_fingerprint(adapter) -> str:
    """What the text conditioning depends on, hashed: 16 hex digits."""
    h = hashlib.sha256(f"format {FORMAT} {type(adapter).__name__} {adapter.max_sequence_length}".encode())
    for name, module in sorted(adapter.text_encoders().items()):
        # a transformers config, or a diffusers one (a FrozenDict: LTX-2's text connectors)
        config = module.config.to_dict() if hasattr(module.config, "to_dict") else dict(module.config)
        h.update(f"{name} {type(module).__name__} {hashed_config(config)}".encode())
        for key, tensor in module.state_dict().items():
            h.update(f"{key} {tuple(tensor.shape)} {tensor.dtype} {weight_checksum(tensor)}".encode())
    for name, tokenizer in sorted(adapter.tokenizers().items()):
        h.update(f"{name} {type(tokenizer).__name__} {tokenizer.model_max_length}".encode())
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    return h.hexdigest()[:16]


def weight_checksum(tensor: torch.Tensor) -> str:
    """The integer sum of the tensor's bits (exact, so the same on any device and thread count;
    any one changed value changes it) and a strided sample of its values (which places them)."""
    flat = tensor.detach().contiguous().reshape(-1)
    bits = flat.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[flat.element_size()])
    total = int(bits.sum(dtype=torch.int64))
    sample = flat[:: max(1, flat.numel() // SAMPLED_VALUES)].cpu().contiguous()
    return f"{total} {hashlib.sha256(sample.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]}"


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]


def entry_key(prompt: str, negative_prompt: str | None, cfg: bool) -> str:
    negative = (negative_prompt or "") if cfg else ""  # without CFG the negative prompt is not encoded
    return hashlib.sha256(f"{prompt}\0{negative}\0{int(cfg)}".encode()).hexdigest()[:32]


class PromptCache:
    """The shards of one fingerprint: ``lookup`` gives the conditioning of a batch of prompts."""

    what = "prompt"  # for messages

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.index: dict[str, tuple[Path, list[str]]] = {}  # entry key -> (shard, its tensor names)
        self._open: dict[Path, object] = {}

    @classmethod
    def build(cls, adapter, items: list[tuple[str, str | None, float]], root, batch_size: int, *,
              force: bool = False, share: tuple[int, int, bool] = (0, 1, True),
              barrier=lambda: None) -> "PromptCache":
        """The cache holding every ``(prompt, negative_prompt, guidance_scale)`` of ``items``,
        encoding whatever is missing. ``share``: (this process's index, how many processes share
        the folder, whether this one tidies it); ``barrier``: waits for all of those processes."""
        wanted = {}
        for prompt, negative, guidance in items:
            cfg = adapter.uses_cfg(guidance)
            wanted.setdefault(entry_key(prompt, negative, cfg), (prompt, negative or "", guidance))
        return cls._build(adapter, encoder_fingerprint(adapter), wanted, root, batch_size, force, share, barrier)

    @classmethod
    def _build(cls, adapter, fingerprint: str, wanted: dict, root, batch_size: int, force: bool,
               share: tuple[int, int, bool], barrier) -> "PromptCache":
        """The cache under ``root/fingerprint`` holding every entry of ``wanted`` (key -> what ``_encode``
        encodes for it), each process encoding the missing ones it owns."""
        rank, world, main = share
        cache = cls(Path(root).expanduser() / fingerprint)
        if main:
            cache.folder.mkdir(parents=True, exist_ok=True)
            if force:
                for shard in cache.folder.glob("*.safetensors"):
                    shard.unlink()
            cache.scan(check=True, remove=True)  # once, here: what is written later is complete by construction
        barrier()
        cache.scan()
        # each entry has one owner, by its place in `wanted`, whatever this scan saw: a process that scans
        # after another has already written sees fewer entries missing, and shares cut from the lists each
        # process saw would leave some entries to nobody
        mine = [v for i, (k, v) in enumerate(wanted.items()) if i % world == rank and k not in cache.index]
        seen_missing = sum(k not in cache.index for k in wanted)
        cache._encode(adapter, mine, batch_size, f"{rank:03d}", show=main)
        barrier()
        absent = cache._await_entries(wanted)
        if absent:
            raise RuntimeError(f"{cls.what} cache {cache.folder}: {len(absent)} entries missing after encoding "
                               f"(e.g. {absent[0]!r}) on process {rank} of {world}, which saw {seen_missing} of "
                               f"{len(wanted)} missing and encoded the {len(mine)} it owns, then waited "
                               f"{VISIBLE_WITHIN_S:g} s for the other processes' shards to show; is data.cache_dir "
                               "shared by every process?")
        return cache

    def _await_entries(self, wanted: dict) -> list:
        """Scan until every entry of ``wanted`` is indexed or ``VISIBLE_WITHIN_S`` has passed; what is still
        absent (the entries' first fields: their prompts or rows)."""
        deadline = time.monotonic() + VISIBLE_WITHIN_S
        for attempt in itertools.count():
            self.scan()
            absent = [v[0] for k, v in wanted.items() if k not in self.index]
            if not absent or time.monotonic() >= deadline:
                return absent
            if attempt == 0:
                logger.warning("%s cache: %d entries encoded by other processes are not in %s yet; waiting up to "
                               "%g s for them to show", self.what, len(absent), self.folder, VISIBLE_WITHIN_S)
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    @classmethod
    def open(cls, adapter, root) -> "PromptCache | None":
        """The existing cache of this adapter's encoders under ``root``, read-only; None when there
        is none (``ff-eval``: what is cached is read, the rest is encoded)."""
        folder = Path(root).expanduser() / encoder_fingerprint(adapter)
        if not folder.is_dir():
            return None
        cache = cls(folder)
        cache.scan(check=True)
        return cache

    def scan(self, check: bool = False, remove: bool = False) -> None:
        """Index the shards. ``check``: first compare each one's bytes with the checksum in its name
        and skip one that differs (``remove``: delete it, so its prompts are encoded again)."""
        self.index, self._open = {}, {}
        for shard in sorted(self.folder.glob("*.safetensors")):
            if check and _digest(shard) != shard.stem.rpartition("-")[2]:
                if remove:
                    logger.warning("prompt cache: %s is damaged (its bytes do not match its checksum); it is "
                                   "removed and its prompts are encoded again", shard)
                    shard.unlink(missing_ok=True)
                continue
            with safe_open(shard, "pt") as f:
                for name in f.keys():
                    key, _, tensor_name = name.partition(".")
                    self.index.setdefault(key, (shard, []))[1].append(tensor_name)

    def _encode(self, adapter, items: list, batch_size: int, tag: str, show: bool) -> None:
        by_guidance: dict[float, list] = {}
        for prompt, negative, guidance in items:
            by_guidance.setdefault(guidance, []).append((prompt, negative))
        bar = tqdm(total=len(items), desc="encoding prompts", disable=not show or not items)
        for guidance, pairs in by_guidance.items():
            cfg = adapter.uses_cfg(guidance)
            for start in range(0, len(pairs), batch_size):
                batch = pairs[start:start + batch_size]
                with torch.no_grad():
                    cond = adapter.encode([p for p, _ in batch], [n for _, n in batch], guidance)
                tensors = {f"{entry_key(p, n, cfg)}.{name}": value[i].detach().cpu().contiguous()
                           for name, value in cond.items() for i, (p, n) in enumerate(batch)}
                self._write(tensors, f"{tag}-{guidance:g}-{start:07d}")
                bar.update(len(batch))
        bar.close()

    def _write(self, tensors: dict, stem: str) -> None:
        data = save(tensors)
        partial = self.folder / f".{stem}.partial"
        with open(partial, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, self.folder / f"{stem}-{hashlib.sha256(data).hexdigest()[:16]}.safetensors")

    def lookup(self, pairs: list[tuple[str, str | None]], cfg: bool, device) -> Conditioning | None:
        """The conditioning of ``pairs`` (prompt, negative prompt) stacked in order, on ``device``;
        None when one of them is not cached."""
        return self.rows([entry_key(p, n, cfg) for p, n in pairs], device)

    def rows(self, keys: list[str], device) -> Conditioning | None:
        """The entries ``keys`` stacked in order, on ``device``; None when one of them is not cached."""
        if not all(k in self.index for k in keys):
            return None
        names = self.index[keys[0]][1]
        rows = {name: [] for name in names}
        for key in keys:
            shard, _ = self.index[key]
            handle = self._open.get(shard)
            if handle is None:
                handle = self._open[shard] = safe_open(shard, "pt")
            for name in names:
                rows[name].append(handle.get_tensor(f"{key}.{name}"))
        # a ragged entry (Qwen-Image-Edit-Plus's condition tokens) is padded to the longest, as cat_cond pads
        return {name: pad_cat(values, stack=True).to(device) for name, values in rows.items()}



# --- conditioned models: the encodings of their condition files ----------------------------


def condition_fingerprint(adapter) -> str:
    """What a conditioned model's condition encodings depend on, hashed: the adapter class, the networks and
    processors ``prepare_conditions`` / ``encode_conditions`` use (configs and weights)."""
    h = hashlib.sha256(f"format {FORMAT} conditions {type(adapter).__name__}".encode())
    if adapter.text_reads_conditions:  # the prompts are encoded here, with their conditions
        h.update(encoder_fingerprint(adapter).encode())
    for name, part in sorted(adapter.condition_encoders().items()):
        config = getattr(part, "config", None)  # diffusers' and transformers' models and diffusers' processors
        config = (config.to_dict() if hasattr(config, "to_dict") else dict(config) if config is not None
                  else part.to_dict())  # transformers' image processors
        h.update(f"{name} {type(part).__name__} {hashed_config(config)}".encode())
        if isinstance(part, torch.nn.Module):
            for key, tensor in part.state_dict().items():
                h.update(f"{key} {tuple(tensor.shape)} {tensor.dtype} {weight_checksum(tensor)}".encode())
    return "conditions-" + h.hexdigest()[:16]


Geometry = tuple  # (height, width, num_frames, condition_size): what a condition is prepared for


def condition_key(item, geometry: Geometry, text: tuple | None = None) -> str:
    """An entry's key: the row's condition files (path, size in bytes, modification time: a changed file is
    a new entry) and the geometry they are prepared for; ``condition_text``'s part for a model whose text
    encoder reads the conditions."""
    files = [(str(f.path.resolve()), f.path.stat().st_size, f.path.stat().st_mtime_ns)
             for f in (*item.images, *item.videos)]
    return hashlib.sha256(json.dumps([files, list(geometry), *([text] if text else [])],
                                     default=str).encode()).hexdigest()[:32]


def condition_text(adapter, item, guidance_scale: float | None) -> tuple | None:
    """What of a row besides its files its condition encoding depends on: for a model whose text encoder reads
    the conditions (``text_reads_conditions``), its prompt, negative prompt and whether CFG encodes the latter;
    None for the others."""
    if not adapter.text_reads_conditions:
        return None
    if guidance_scale is None:
        raise ValueError(f"{adapter.model_type} encodes its prompts with the conditions: give the guidance scale")
    cfg = adapter.uses_cfg(guidance_scale)
    return item.prompt, (item.negative_prompt or "") if cfg else "", cfg


def encode_condition_rows(adapter, media, items: list, geometry: Geometry,
                          guidance_scale: float | None = None) -> Conditioning:
    """The conditioning of rows ``items`` from their ``media``: ``encode_conditions``, and for a model whose text
    encoder reads the conditions (``text_reads_conditions``) their prompts encoded with them."""
    cond = adapter.encode_conditions(media, *geometry[:3])
    if adapter.text_reads_conditions:
        cond = {**cond, **adapter.encode([it.prompt for it in items], [it.negative_prompt or "" for it in items],
                                         guidance_scale, conditions=media)}
    return cond


def condition_media(adapter, items: list, geometry: Geometry):
    """``prepare_conditions`` of the rows ``items`` (their files read) for ``geometry``."""
    takes = adapter.condition_inputs
    images = [[read_image(f) for f in it.images] for it in items] if "images" in takes else None
    videos = [[read_video(f) for f in it.videos] for it in items] if "videos" in takes else None
    return adapter.prepare_conditions(images, videos, *geometry)


class ConditionCache(PromptCache):
    """A conditioned model's condition encodings (VAE latents, image-encoder states), one entry per row's
    condition files and geometry, under ``data.cache_dir/conditions-<fingerprint>``: encoded once before
    training, as the prompts are; ``lookup`` gives a batch's. For a model whose text encoder reads the conditions
    (Qwen-Image-Edit-Plus) an entry is a row's files with its prompts, and holds their text encoding too."""

    what = "condition"
    adapter = None  # the model whose encodings these are (its text_reads_conditions and uses_cfg name an entry)

    @classmethod
    def build(cls, adapter, requests: list[tuple], root, batch_size: int, *, force: bool = False,
              share: tuple[int, int, bool] = (0, 1, True), barrier=lambda: None) -> "ConditionCache":
        """The cache holding every ``(item, geometry)`` of ``requests`` (``(item, geometry, guidance_scale)`` for a
        model whose text encoder reads the conditions), encoding whatever is missing."""
        wanted = {}
        for item, geometry, *guidance in requests:
            guidance = guidance[0] if guidance else None
            key = condition_key(item, geometry, condition_text(adapter, item, guidance))
            wanted.setdefault(key, (item, geometry, guidance))
        cache = cls._build(adapter, condition_fingerprint(adapter), wanted, root, batch_size, force, share, barrier)
        cache.adapter = adapter
        return cache

    @classmethod
    def open(cls, adapter, root) -> "ConditionCache | None":
        folder = Path(root).expanduser() / condition_fingerprint(adapter)
        if not folder.is_dir():
            return None
        cache = cls(folder)
        cache.scan(check=True)
        cache.adapter = adapter
        return cache

    def _encode(self, adapter, requests: list, batch_size: int, tag: str, show: bool) -> None:
        by_geometry: dict[tuple, list] = {}
        for item, geometry, guidance in requests:
            by_geometry.setdefault((tuple(geometry), guidance), []).append(item)
        bar = tqdm(total=len(requests), desc="encoding conditions", disable=not show or not requests)
        for number, ((geometry, guidance), items) in enumerate(by_geometry.items()):
            for start in range(0, len(items), batch_size):
                batch = items[start:start + batch_size]
                media = condition_media(adapter, batch, geometry)
                with torch.no_grad():
                    cond = encode_condition_rows(adapter, media, batch, geometry, guidance)
                keys = [condition_key(it, geometry, condition_text(adapter, it, guidance)) for it in batch]
                tensors = {f"{key}.{name}": value[i].detach().cpu().contiguous()
                           for name, value in cond.items() for i, key in enumerate(keys)}
                self._write(tensors, f"{tag}-c{number}-{start:07d}")
                bar.update(len(batch))
        bar.close()

    def lookup(self, items: list, geometry: Geometry, device,
               guidance_scale: float | None = None) -> Conditioning | None:
        """The condition encodings of rows ``items`` for ``geometry`` (and ``guidance_scale``, for a model whose text
        encoder reads the conditions), stacked in order, on ``device``; None when one of them is not cached."""
        return self.rows([condition_key(it, geometry, condition_text(self.adapter, it, guidance_scale))
                          for it in items], device)
