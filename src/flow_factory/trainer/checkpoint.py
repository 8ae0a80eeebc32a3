"""Checkpoints: the weights a user loads elsewhere, plus what an exact resume needs.

Layout of ``<run_dir>/checkpoints/epoch_<N>/`` (N = epochs completed):
- LoRA: ``pytorch_lora_weights.safetensors`` in the diffusers format, so a plain
  ``pipe.load_lora_weights(dir)`` loads it; full fine-tuning: ``transformer/``
  (``save_pretrained``), loadable with ``<TransformerClass>.from_pretrained``.
- ``optimizer.pt`` (AdamW moments) and ``trainer_state.json`` (epochs done, step).
Sampling randomness is seeded per epoch, so nothing else is needed to resume exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..models.lora import load_lora_state, save_lora

STATE_FILE = "trainer_state.json"


def save_checkpoint(out_dir: Path, adapter, finetune_type: str, optimizer, state: dict) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if finetune_type == "lora":
        save_lora(type(adapter.pipeline), adapter.transformer, out_dir)
    else:
        adapter.transformer.save_pretrained(out_dir / "transformer")
    torch.save(optimizer.state_dict(), out_dir / "optimizer.pt")
    (out_dir / STATE_FILE).write_text(json.dumps(state, indent=2))
    return out_dir


def load_checkpoint(path: str | Path, adapter, finetune_type: str, optimizer=None) -> dict:
    """Restore weights (and optimizer state when present); returns the trainer state."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model.resume_path: {path} is not a folder")
    if finetune_type == "lora":
        load_lora_state(adapter.transformer, path)
    else:
        source = type(adapter.transformer).from_pretrained(path / "transformer", dtype=torch.float32)
        adapter.transformer.load_state_dict(source.state_dict())
    if optimizer is not None and (path / "optimizer.pt").exists():
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    state_file = path / STATE_FILE
    return json.loads(state_file.read_text()) if state_file.exists() else {"epoch": 0, "global_step": 0}
