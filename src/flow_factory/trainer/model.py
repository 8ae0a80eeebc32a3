"""The model a run trains: the pipeline loaded and set as the config asks (``load_model``), and the check that the
steps a coupled algorithm trains are denoised by a trained expert (``check_trained_steps``). What trains in it is
``models.lora.make_trainable``'s, which ``ff-train --plan`` calls too."""

from __future__ import annotations

import logging

import torch

from ..config import ConfigError
from ..config.algorithms import COUPLED_TRAINER_TYPES
from ..guards import check_pipeline_finite
from ..models import load_adapter
from ..models.preflight import check_experts

logger = logging.getLogger(__name__)


def load_model(cfg, device: torch.device, dtype: torch.dtype):
    """The adapter of ``model.model_type`` over the pipeline at ``model.model_name_or_path``, loaded in ``dtype``,
    with the config's sampling settings; its weights checked finite."""
    train, model = cfg.train, cfg.model
    adapter = load_adapter(model.model_type, model.model_name_or_path, device, dtype)
    # a hub id's experts are known only now (a folder's were checked before loading)
    check_experts(adapter.experts(adapter.pipeline.config), cfg, model.model_name_or_path)
    adapter.guidance_scale_2 = train.guidance_scale_2
    if train.strength is not None:  # video-to-video (the config allows it for no other model)
        adapter.strength = train.strength
    if cfg.scheduler.flow_shift is not None:
        adapter.set_flow_shift(cfg.scheduler.flow_shift)
    check_pipeline_finite(adapter.pipeline, f"model.model_name_or_path: {model.model_name_or_path}")
    if model.attn_backend is not None:  # the name is checked before loading (models/preflight.py)
        adapter.set_attention_backend(model.attn_backend)
    return adapter


def check_trained_steps(cfg, adapter, train_size: tuple[int, int]) -> None:
    """A step of the grpo family trains the expert that denoises it: a step of an expert that the run leaves frozen
    (``model.target_components``, ``target_modules``) trains nothing (Wan2.2 A14B)."""
    if cfg.train.trainer_type not in COUPLED_TRAINER_TYPES or len(adapter.transformers) == 1:
        return
    trained = cfg.model.trained_components
    sigmas = adapter.sigmas(cfg.train.num_inference_steps, *train_size, cfg.train.num_frames)
    experts = adapter.experts_at(sigmas[:-1])
    frozen = {s: experts[s] for s in cfg.sde_step_candidates if experts[s] not in trained}
    if not frozen:
        return
    message = (f"scheduler.sde_steps: steps {sorted(frozen)} are denoised by {sorted(set(frozen.values()))}, "
               f"which the run does not train (it trains {trained}: model.target_components and target_modules)")
    if len(frozen) == len(cfg.sde_step_candidates):
        raise ConfigError(f"{message}; no step of the window trains anything: choose steps of {trained} "
                          f"(sigmas {[round(float(x), 3) for x in sigmas[:-1]]})")
    logger.warning("%s; those steps train nothing", message)
