"""Checkpoints: the weights a user loads elsewhere, plus what an exact resume needs.

Layout of ``<run_dir>/checkpoints/epoch_<N>/`` (N = epochs completed):
- LoRA: ``pytorch_lora_weights.safetensors`` in the diffusers format, so a plain
  ``pipe.load_lora_weights(dir)`` loads it; full fine-tuning: ``transformer/``
  (``save_pretrained``), loadable with ``<TransformerClass>.from_pretrained``.
  Each other trained expert (``model.target_components``: Wan2.2's ``transformer_2``) has
  its own: ``pytorch_lora_weights_transformer_2.safetensors`` (``pipe.load_lora_weights(dir,
  weight_name=..., load_into_transformer_2=True)``) or ``transformer_2/``.
- ``optimizer.pt`` (AdamW moments), ``ema.pt`` when an EMA is kept, and
  ``trainer_state.json`` (epochs done, step, histories, what was trained, and the size
  of every other file of the folder).
Sampling randomness is seeded per epoch, so nothing else is needed to resume exactly.

A checkpoint is never seen half-written. It is written into ``.epoch_<N>.partial``
beside its final place, every file is flushed to disk, ``trainer_state.json`` comes
last, and one ``rename`` publishes the folder (as accelerate and torchtune do for their
checkpoints, a rename within a file system is atomic). A process killed at any point
leaves either the previous checkpoints alone or the new one complete; a ``.partial``
folder left by a kill is removed by the next save. ``find_checkpoint`` accepts only a
folder whose files all have the sizes ``trainer_state.json`` lists.

Two loaders read a checkpoint: ``load_checkpoint`` resumes training (weights into the
live LoRA or transformer, and the optimizer), ``load_for_sampling`` gives ``ff-sample``
and ``ff-eval`` a pipeline with the weights applied the way a user would apply them
(``load_lora_weights``, ``from_pretrained``). Both refuse an incomplete folder and
weights holding NaN or inf.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .guards import check_pipeline_finite, nonfinite_tensors
from .models.lora import (LORA_WEIGHT_NAME, load_lora_into, load_lora_state, lora_module_state, lora_weight_name,
                          save_lora)
from .sharding import is_sharded, load_full_optimizer_state, load_full_state_dict, optimized_model

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
CHECKPOINTS = "checkpoints"
PARTIAL = ".partial"
RUN_CONFIG = "config.yaml"  # a run's resolved config (Config.to_yaml), in its run folder


class CheckpointError(ValueError):
    """A resume source that is missing, incomplete, foreign or does not fit this run."""


# ------------------------------------------------------------------ writing
@dataclass
class CheckpointContents:
    """What a checkpoint holds beyond the trainer state. ``weights``: None reads the adapter's own (whole) weights,
    else component -> its full state dict, gathered from a sharded model whose own parameters are shards
    (``sharding.py``); ``optimizer``: the optimizer or its state dict (None: the weights only,
    ``log.save_model_only``, or DeepSpeed's state in ``folders``); ``extra``: file name -> object for
    ``torch.save`` (the weight copies); ``folders``: name -> a folder written beforehand (by every process:
    DeepSpeed's engine state), moved into the checkpoint under that name."""

    weights: dict | None = None
    optimizer: object = None
    extra: dict = field(default_factory=dict)
    folders: dict = field(default_factory=dict)


def save_checkpoint(out_dir: Path, adapter, finetune_type: str, state: dict, contents: CheckpointContents,
                    components: list[str] = ("transformer",)) -> Path:
    """Write the checkpoint atomically to ``out_dir``: the trained networks ``components``
    (``model.target_components``) and ``contents``, with the trainer ``state``."""
    weights, optimizer, extra, folders = contents.weights, contents.optimizer, contents.extra, contents.folders
    out_dir = Path(out_dir)
    trained = {name: adapter.transformers[name] for name in components}
    if weights is None:
        params = [p for module in trained.values() for p in module.parameters() if p.requires_grad]
    else:
        params = [t for full in weights.values() for t in full.values() if t.is_floating_point()]
    bad = sum(int(not torch.isfinite(p).all()) for p in params)
    if bad:  # the optimisation loop skips non-finite steps; reaching here is a bug, never a checkpoint
        raise FloatingPointError(f"refusing to save {out_dir}: {bad} trained tensors hold NaN or inf")
    tmp = out_dir.with_name(f".{out_dir.name}{PARTIAL}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a process killed during an earlier save
    tmp.mkdir(parents=True)
    for name, module in trained.items():
        full = None if weights is None else weights[name]
        if finetune_type == "lora":
            save_lora(type(adapter.pipeline), module, tmp, lora_weight_name(name), state_dict=full)
        elif full is None:
            module.save_pretrained(tmp / name)
        else:
            _plain_copy(module, full).save_pretrained(tmp / name)
    if optimizer is not None:  # None: the weights only (log.save_model_only)
        torch.save(optimizer if isinstance(optimizer, dict) else optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    for name, obj in (extra or {}).items():
        torch.save(obj, tmp / name)
    for name, folder in (folders or {}).items():
        os.replace(folder, tmp / name)
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    state = {**state, "finetune_type": finetune_type, "target_components": list(components), "files": files}
    _sync_tree(tmp)
    write_atomic(tmp / STATE_FILE, json.dumps(state, indent=2))
    _publish(tmp, out_dir)
    return out_dir


def _plain_copy(module, state: dict):
    """A model of ``module``'s class and config holding the full tensors ``state``: what ``save_pretrained``
    writes for a sharded model (built on the meta device, so no second set of weights is allocated)."""
    with torch.device("meta"):
        copy = type(module).from_config(module.config)
    copy.load_state_dict(state, assign=True)
    return copy


def write_atomic(path: Path, data: str | bytes) -> None:
    """``path`` holds the old content or the new, never a mix (write beside it, flush, rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}{PARTIAL}")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sync_tree(folder: Path) -> None:
    # rename is atomic for the names, not for the data: flush the data first, so a machine
    # that loses power right after the rename does not publish empty files
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def _publish(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists():  # the same epoch saved again (e.g. the final save): swap, then drop the old
        old = out_dir.with_name(f".{out_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out_dir)
    fd = os.open(out_dir.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power loss
    finally:
        os.close(fd)


# ------------------------------------------------------------------ finding and checking
def read_state(path: Path) -> dict:
    """The trainer state of a complete checkpoint folder, or ``CheckpointError`` naming what is missing."""
    path = Path(path)
    state_file = path / STATE_FILE
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder")
    if path.name.endswith(PARTIAL):
        raise CheckpointError(f"{path} is a save that was interrupted before it was published")
    if not state_file.is_file():
        raise CheckpointError(f"{path} has no {STATE_FILE}: not a complete ff-train checkpoint "
                              f"(a save that was interrupted, or a folder ff-train did not write)")
    try:
        state = json.loads(state_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{state_file} is not valid JSON ({e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("epoch"), int):
        raise CheckpointError(f"{state_file} does not hold an ff-train trainer state (no integer 'epoch')")
    files = state.get("files")
    if files is None:  # written before checkpoints listed their files: check what they always held
        files = {OPTIMIZER_FILE: None}
        weights = [LORA_WEIGHT_NAME, "transformer"]
        if not any((path / w).exists() for w in weights):
            raise CheckpointError(f"{path} holds neither {weights[0]} (LoRA) nor {weights[1]}/ (full weights)")
    problems = []
    for name, size in files.items():
        f = path / name
        if not f.is_file():
            problems.append(f"{name} is missing")
        elif size is not None and f.stat().st_size != size:
            problems.append(f"{name} has {f.stat().st_size} bytes, {size} were written")
    if problems:
        raise CheckpointError(f"{path} is incomplete: {'; '.join(problems)}")
    return state


def checkpoint_dir(run_dir: Path, epoch: int) -> Path:
    """Where a run saves the weights after ``epoch`` epochs."""
    return Path(run_dir) / CHECKPOINTS / f"epoch_{epoch}"


def checkpoint_epoch(path: Path) -> int | None:
    """N of an ``epoch_N`` folder name; None for any other name."""
    number = Path(path).name.removeprefix("epoch_")
    return int(number) if Path(path).name.startswith("epoch_") and number.isdigit() else None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """``epoch_N`` folders of a run, oldest first (complete or not)."""
    found = [p for p in (Path(run_dir) / CHECKPOINTS).glob("epoch_*") if p.is_dir() and checkpoint_epoch(p) is not None]
    return sorted(found, key=checkpoint_epoch)


def run_config_file(checkpoint: str | Path) -> Path | None:
    """The saved config of the run that wrote ``checkpoint``: a ``config.yaml`` in the checkpoint folder (one
    copied out of its run keeps its config beside it), else the run folder's (``RUN/checkpoints/epoch_N`` ->
    ``RUN/config.yaml``); None when neither exists (a folder ff-train did not write)."""
    ckpt = Path(checkpoint)
    places = [ckpt / RUN_CONFIG]
    if ckpt.parent.name == CHECKPOINTS:  # only a run's own layout: a bare folder's grandparent is no run
        places.append(ckpt.parent.parent / RUN_CONFIG)
    return next((path for path in places if path.is_file()), None)


def find_checkpoint(resume_path: str | Path, run_dir: Path) -> tuple[Path, dict]:
    """The checkpoint folder ``model.resume_path`` names, and its trainer state: a checkpoint itself,
    a run folder (its newest complete checkpoint), or ``latest`` (this run's newest complete checkpoint)."""
    key = "model.resume_path"
    if str(resume_path) == "latest":
        path = Path(run_dir)
        if not (path / CHECKPOINTS).is_dir():
            raise CheckpointError(f"{key}: latest: this run's folder {path} holds no checkpoints/; set "
                                  "log.run_name (and log.save_dir) to those of the run to resume")
    else:
        path = Path(resume_path).expanduser()
        if not path.exists():
            raise CheckpointError(f"{key}: {path} does not exist")
    if (path / STATE_FILE).exists() or not (path / CHECKPOINTS).is_dir():
        try:
            return path, read_state(path)
        except CheckpointError as e:
            raise CheckpointError(f"{key}: {e}; name a checkpoints/epoch_N folder, a run folder or 'latest'") from None
    skipped = []
    for candidate in reversed(list_checkpoints(path)):
        try:
            return candidate, read_state(candidate)
        except CheckpointError as e:
            skipped.append(str(e))
    why = f" ({'; '.join(skipped)})" if skipped else ""
    raise CheckpointError(f"{key}: run folder {path} holds no complete checkpoint{why}")


# ------------------------------------------------------------------ loading
def check_fits(path: Path, state: dict, finetune_type: str, components: list[str] = ("transformer",)) -> None:
    """A LoRA checkpoint resumes only a LoRA run, full weights only a full fine-tune, of the same components."""
    saved_type = state.get("finetune_type") or ("lora" if (Path(path) / LORA_WEIGHT_NAME).exists() else "full")
    if saved_type != finetune_type:
        raise CheckpointError(f"model.resume_path: {path} holds a {saved_type} checkpoint, but "
                              f"model.finetune_type is {finetune_type!r}; set model.finetune_type: {saved_type}")
    saved = state.get("target_components", ["transformer"])  # checkpoints written before the key trained one
    if list(saved) != list(components):
        raise CheckpointError(f"model.resume_path: {path} trained {saved}, but model.target_components is "
                              f"{list(components)}; set model.target_components: {saved}")


def load_checkpoint(path: str | Path, adapter, finetune_type: str, optimizer=None,
                    components: list[str] = ("transformer",)) -> bool:
    """Restore the weights of ``components`` (and the optimizer state) of a checkpoint that ``find_checkpoint``
    found and ``check_fits`` accepted; False when an optimizer was given and the checkpoint holds no state
    for it. Raises ``CheckpointError`` for weights holding NaN or inf."""
    path = Path(path)
    sharded = False
    for name in components:
        module = adapter.transformers[name]
        if is_sharded(module):  # every process reads the full tensors and keeps its shard
            sharded = True
            if finetune_type == "lora":
                state = lora_module_state(module, path, lora_weight_name(name))
            else:
                state = type(module).from_pretrained(path / name, dtype=torch.float32).state_dict()
            bad = [k for k, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]
            if not bad:
                load_full_state_dict(module, state, strict=finetune_type != "lora")
        elif finetune_type == "lora":
            load_lora_state(module, path, lora_weight_name(name))
            bad = nonfinite_tensors(module)
        else:
            source = type(module).from_pretrained(path / name, dtype=torch.float32)
            module.load_state_dict(source.state_dict())
            bad = nonfinite_tensors(module)
        if bad:
            raise CheckpointError(f"model.resume_path: {path} holds NaN or inf in {len(bad)} tensors of {name} "
                                  f"(e.g. {bad[0]})")
    if optimizer is None:
        return True
    if not (path / OPTIMIZER_FILE).exists():
        return False
    saved = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    if sharded:  # saved gathered, keyed by parameter name (sharding.py)
        model = optimized_model({name: adapter.transformers[name] for name in components})
        load_full_optimizer_state(model, getattr(optimizer, "optimizer", optimizer), saved)
    else:
        optimizer.load_state_dict(saved)
    return True


def load_for_sampling(model_type: str, model_path, checkpoint=None, device=None, dtype=torch.float32):
    """The adapter of the pipeline at ``model_path``, in eval mode, with ``checkpoint`` applied.

    ``checkpoint``: a folder holding ``pytorch_lora_weights.safetensors`` (loaded with the
    pipeline's own ``load_lora_weights``) or ``transformer/`` (full weights), as ``ff-train``
    writes them under ``checkpoints/epoch_N`` (checked complete when it holds a trainer state). ``dtype``:
    the pipeline's load dtype (``precision.Precision.load``).
    """
    from .models import load_adapter

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    ckpt = Path(checkpoint) if checkpoint is not None else None
    if ckpt is not None and (ckpt / STATE_FILE).exists():
        read_state(ckpt)  # before the model loads: an incomplete save is named, not half-applied
    adapter = load_adapter(model_type, model_path, device, dtype)
    if ckpt is not None:
        _apply_weights(adapter, ckpt)
    check_pipeline_finite(adapter.pipeline, f"{model_path}" + (f" with checkpoint {ckpt}" if ckpt else ""))
    for transformer in adapter.transformers.values():
        transformer.eval()
    return adapter


def _apply_weights(adapter, ckpt: Path) -> None:
    """Each component's weights the way a user applies them: the pipeline's ``load_lora_weights`` (the
    transformer's ``load_lora_adapter`` where the pipeline has none), or ``from_pretrained`` of the component's
    folder."""
    found = False
    for name, module in adapter.transformers.items():
        if (ckpt / lora_weight_name(name)).is_file():
            load_lora_into(adapter.pipeline, name, ckpt, lora_weight_name(name),
                           **adapter.lora_load_kwargs.get(name, {}))
        elif (ckpt / name).is_dir():
            module.load_state_dict(type(module).from_pretrained(ckpt / name, dtype=adapter.dtype).state_dict())
        else:
            continue
        found = True
    if not found:
        raise CheckpointError(f"checkpoint {ckpt}: expected {LORA_WEIGHT_NAME} (LoRA) or a transformer/ folder "
                              "(full fine-tuning), or those of another expert, as ff-train writes under "
                              "checkpoints/epoch_N")
