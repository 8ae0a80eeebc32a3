"""What the trainer does differently when the launch shards the model (FSDP2, DeepSpeed ZeRO): the
checks made before anything loads, DeepSpeed's engine state on resume, and the gathering of full
tensors for a checkpoint. The sharding itself (wrapping, gathering one tensor) is ``sharding.py``."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from accelerate.utils import DistributedType

from ..checkpoint import PARTIAL, CheckpointError, checkpoint_dir
from ..config import ConfigError
from ..models import get_adapter_class
from ..models.preflight import pipeline_folder, read_json
from ..sharding import (DEEPSPEED_DIR, DEEPSPEED_TAG, full_optimizer_state, full_state_dict, load_engine_state,
                        optimized_model, save_engine_state)
from .ema import EMA_FILE

logger = logging.getLogger(__name__)


def check_shardable(cfg, accelerator, experts: int) -> None:
    """A model of several experts trains under ZeRO-1/2 with its trained experts bundled into DeepSpeed's one
    engine (``sharding.BundledExperts``), as Flow-Factory does. ZeRO-3 is refused for it, as there: it
    gathers each partitioned module in the order it traced, and the experts are called apart."""
    plugin = accelerator.state.deepspeed_plugin
    if accelerator.distributed_type == DistributedType.DEEPSPEED and experts > 1 and plugin.zero_stage == 3:
        raise ConfigError(f"config_file: {cfg.config_file} runs DeepSpeed ZeRO-3, which partitions one network and "
                          f"gathers it in the order it traced; {cfg.model.model_type} has {experts} experts, called "
                          "apart: use zero2 (the experts in one engine), fsdp2 (each expert sharded) or multi_gpu "
                          "(DDP)")


def check_deepspeed_skips_nonfinite(cfg, accelerator) -> None:
    """DeepSpeed's ZeRO optimizers, and its bf16 and fp16 ones, skip a step whose reduced gradients hold NaN
    or inf (the non-finite guard's skip, ``trainer/optimize.py``); without ZeRO in float32 its engine steps
    whatever they hold, so that launch is refused."""
    if (accelerator.distributed_type == DistributedType.DEEPSPEED
            and accelerator.state.deepspeed_plugin.zero_stage == 0 and accelerator.mixed_precision == "no"):
        raise ConfigError(f"config_file: {cfg.config_file} runs DeepSpeed without ZeRO (zero_stage 0) in float32, "
                          "where its engine steps NaN or inf gradients into the weights: use multi_gpu (DDP, the "
                          "same update) or a ZeRO stage (zero1, zero2, zero3)")


def check_optimizer_backend(cfg, backend: str) -> None:
    """Muon orthogonalises whole weight matrices; FSDP2 and DeepSpeed hand the optimizer shards of them."""
    if cfg.train.optimizer == "muon" and backend != "ddp":
        raise ConfigError(f"train.optimizer: muon updates each weight matrix whole, but config_file: "
                          f"{cfg.config_file} shards them ({backend}); use adamw, or multi_gpu (DDP)")


def check_experts_before_loading(cfg, accelerator) -> None:
    """``check_shardable`` from a pipeline folder's model_index.json, before anything loads (a hub id's
    experts are known once it has loaded: the trainer checks them then); and, as early,
    ``check_deepspeed_skips_nonfinite``."""
    check_deepspeed_skips_nonfinite(cfg, accelerator)
    folder = pipeline_folder(cfg.model.model_name_or_path)
    if accelerator.distributed_type == DistributedType.DEEPSPEED and folder is not None:
        experts = get_adapter_class(cfg.model.model_type).experts(read_json(folder / "model_index.json"))
        check_shardable(cfg, accelerator, len(experts))


def resume_engine_state(engine, checkpoint: Path, resumed: dict, processes: int) -> None:
    """DeepSpeed's partitions of the fp32 weights and AdamW's moments, from ``checkpoint`` (``resumed``: its
    trainer state). Each process reads the partition of its rank, so only a run on as many processes reads
    them; another restarts the optimizer from the consolidated weights."""
    folder = checkpoint / DEEPSPEED_DIR
    written_by = resumed.get("sharding", {}).get("processes")
    if folder.is_dir() and written_by != processes:
        logger.warning("model.resume_path %s: its DeepSpeed state was written by %s processes and this run has %d; "
                       "the optimizer restarts", checkpoint, written_by, processes)
    elif folder.is_dir():
        if not load_engine_state(engine, folder):
            raise CheckpointError(f"model.resume_path: DeepSpeed found no engine state in {folder} "
                                  f"(tag {DEEPSPEED_TAG})")
    else:
        logger.warning("model.resume_path %s holds no DeepSpeed state (%s/: saved by another backend or with "
                       "log.save_model_only); the optimizer restarts", checkpoint, DEEPSPEED_DIR)


@dataclass
class GatheredState:
    """What a checkpoint of a sharded model holds, gathered: full tensors on the main process."""

    weights: dict  # component -> its full state dict
    optimizer: dict | None  # the optimizer's full state (FSDP); None: saved in folders, or not at all
    extra: dict  # file name -> state: the EMA and the algorithm's weight copies
    folders: dict  # name -> a folder the checkpoint takes in (DeepSpeed's engine state)


def gather_for_save(trainer) -> GatheredState:
    """The full weights, optimizer state and weight copies of a sharded model (FSDP, DeepSpeed), and the
    folders the checkpoint takes in (DeepSpeed's engine state, each process's part written beside the
    checkpoint first): a collective, on every process; the tensors land on the main process."""
    t, acc = trainer, trainer.accelerator
    # every trained expert in turn, each a collective (DeepSpeed's engine wraps the modules themselves)
    weights = {name: full_state_dict(module, acc, t.sharding) for name, module in t.trained.items()}
    optimizer = None
    if not t.cfg.log.save_model_only and t.sharding == "fsdp":
        optimizer = full_optimizer_state(optimized_model(t.trained), getattr(t.optimizer, "optimizer", t.optimizer))
    extra = {EMA_FILE: t.ema.state_dict()} if t.ema is not None else {}
    extra.update({f"{n}.pt": snapshot.state_dict() for n, snapshot in t.snapshots.items()})
    folders = {}
    if not t.cfg.log.save_model_only and t.sharding == "deepspeed":
        out = checkpoint_dir(t.run_dir, t.epoch)
        staging = out.with_name(f".{out.name}.{DEEPSPEED_DIR}{PARTIAL}")
        if acc.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)  # left by a process killed during an earlier save
        acc.wait_for_everyone()
        save_engine_state(t.engine, staging)
        acc.wait_for_everyone()
        folders[DEEPSPEED_DIR] = staging
    return GatheredState(weights, optimizer, extra, folders)
