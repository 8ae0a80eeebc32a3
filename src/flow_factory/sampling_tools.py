"""Sampling a model outside training, the way the Trainer's eval does (ff-sample, ff-eval, scripts).

Same components as ``Trainer.evaluate``: ``collect_rollouts`` with the ODE dynamics,
per-sample noise seeded by ``(seed, -1, sample index)``, rewards from a RewardSet. So
the eval of a run and ``ff-eval`` on its checkpoint draw the same noise for the same
test prompt, and their numbers agree.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .dynamics.ode import ODE
from .trainer.guards import check_pipeline_finite
from .trainer.sampling import Rollouts, collect_rollouts
from .trainer.timer import PhaseTimer


class _Device:
    """What collect_rollouts asks of an accelerator, for single-process use without one."""

    def __init__(self, device):
        self.device = torch.device(device)

    def autocast(self):
        from contextlib import nullcontext

        return nullcontext()


@torch.no_grad()
def sample_prompts(adapter, items: list, *, seed: int, num_steps: int, guidance_scale: float, height: int,
                   width: int, batch_size: int = 8, num_frames: int | None = None, reward_set=None,
                   accelerator=None, timer: PhaseTimer | None = None) -> Rollouts:
    """ODE samples of ``items`` (PromptItem-like), sample ``i`` seeded as the Trainer's eval seeds it."""
    ids = list(range(len(items)))
    acc = accelerator or _Device(adapter.device)
    return collect_rollouts(
        adapter, ODE(), acc, items, torch.tensor(ids), ids, seed=seed, epoch=-1, batch_size=batch_size,
        height=height, width=width, num_frames=num_frames, num_steps=num_steps, guidance_scale=guidance_scale,
        sde_steps=[], same_latent=False, timer=timer or PhaseTimer(), keep_trajectory=False, reward_set=reward_set)


def load_for_sampling(model_type: str, model_path, checkpoint=None, device=None):
    """The adapter of the pipeline at ``model_path``, with a training checkpoint applied.

    ``checkpoint``: a folder holding ``pytorch_lora_weights.safetensors`` (a LoRA, loaded
    with the pipeline's own ``load_lora_weights``) or ``transformer/`` (full weights), as
    ``ff-train`` writes them under ``checkpoints/epoch_N``.
    """
    from .models import load_adapter

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    adapter = load_adapter(model_type, model_path, device)
    if checkpoint is not None:
        _apply_checkpoint(adapter, Path(checkpoint))
    check_pipeline_finite(adapter.pipeline, f"{model_path}" + (f" with checkpoint {checkpoint}" if checkpoint else ""))
    adapter.transformer.eval()
    return adapter


def _apply_checkpoint(adapter, ckpt: Path) -> None:
    if (ckpt / "pytorch_lora_weights.safetensors").is_file():
        adapter.pipeline.load_lora_weights(str(ckpt))
    elif (ckpt / "transformer").is_dir():
        full = type(adapter.transformer).from_pretrained(ckpt / "transformer", dtype=adapter.dtype)
        adapter.transformer.load_state_dict(full.state_dict())
    else:
        raise FileNotFoundError(f"checkpoint {ckpt}: expected pytorch_lora_weights.safetensors (LoRA) or a "
                                f"transformer/ folder (full fine-tuning), as ff-train writes under checkpoints/epoch_N")
