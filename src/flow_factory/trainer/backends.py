"""One object per accelerate backend (DDP, FSDP2, DeepSpeed ZeRO): the order each builds the trained model in,
what it gathers for a checkpoint, and how it tells whether the weights stayed finite; and the checks a sharded
launch makes before anything loads. The tensor-level work they call (wrapping, sharding, gathering one tensor)
is ``sharding.py``.

Each backend's ``build`` states its order once, from the steps ``ModelSetup`` (``weights.py``) offers:

- DDP (one process too): the weight copies, then the optimizer, ``torch.compile`` and the DDP wrapper; the
  checkpoint loads into the wrapped model. Every process holds every weight.
- FSDP2: ``torch.compile``, then the networks and their optimizer prepared together (the parameters become
  shards), then the copies (of the shards) and the checkpoint (each process keeps its shard of its tensors).
- DeepSpeed: its engine keeps fp32 master copies of the weights, so the checkpoint's weights load first, the
  engine is built around them and reads its own state (each process's partition of the master weights and
  AdamW's moments); the copies come last.

Under FSDP2 and DeepSpeed a trained network's forward or backward is a collective: a multi-expert model's
experts then run in lockstep (``LockstepExperts``), each process running an expert whenever any process does.
"""

from __future__ import annotations

import gc
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from ..checkpoint import PARTIAL, CheckpointContents, CheckpointError, checkpoint_dir
from ..config import ConfigError
from ..guards import all_finite
from ..models import get_adapter_class
from ..models.base import ExpertCalls
from ..models.preflight import pipeline_folder, read_json
from ..precision import Precision, avoid_cudnn_attention, enable_cpu_fp16, run_mixed_precision
from ..sharding import (DEEPSPEED_DIR, DEEPSPEED_TAG, accelerator_kwargs, all_finite_everywhere, backend_of,
                        fill_deepspeed_config, full_optimizer_state, full_state_dict, load_engine_state,
                        load_frozen_models_whole, local, optimized_model, prepare_sharded, release_gathered,
                        reshard_all, save_engine_state, shard_on_cpu)
from ..models.lora import trainable_params
from .weights import ModelSetup, WeightCopies

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


def end_process_group() -> None:
    """Destroys the process group of a launched run once nothing else of the run holds it (ff-train calls this
    after its Trainer is gone). DDP's reducer holds the group from C++: left as its last holder, freeing it would
    destroy the group while holding the GIL, and gloo's destructor joins its worker threads, one of which may
    still need the GIL to free the last collective's tensors, a deadlock after a finished run (seen as a
    two-process run that never exited; pytorch issue 56297). Freed from Python, the group's own destructor
    releases the GIL first."""
    gc.collect()  # the run's reference cycles, the DDP wrapper's among them
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def make_accelerator(cfg, tracker: str | None) -> tuple[Accelerator, Precision]:
    """The run's ``Accelerator`` for the launch's backend, and its precision (``tracker``: the logging backend).
    Under DeepSpeed, the models loaded outside its engine (text encoders, rewards) are told to load whole."""
    on_cpu = not torch.cuda.is_available()
    mixed_precision = run_mixed_precision(cfg.mixed_precision)  # "no" on CPU unless FF_CPU_MIXED_PRECISION
    accelerator = Accelerator(mixed_precision=mixed_precision, log_with=tracker,
                              project_dir=str(Path(cfg.log.save_dir).expanduser() / cfg.log.run_name),
                              **accelerator_kwargs(on_cpu))
    if on_cpu and mixed_precision == "fp16":
        enable_cpu_fp16(accelerator)  # accelerate runs fp16 on GPUs only
    if not on_cpu:
        avoid_cudnn_attention()
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        load_frozen_models_whole()  # before the rewards and the pipeline load
    precision = Precision.of(mixed_precision, accelerator.device, cfg.model.master_weight_dtype,
                             cfg.train.latent_storage_dtype)
    return accelerator, precision


@dataclass
class Built:
    """What a backend's ``build`` returns: the parameters the optimizer steps (shards under FSDP2), the optimizer,
    and the weight copies."""

    params: list
    optimizer: torch.optim.Optimizer
    copies: WeightCopies


class LockstepExperts(ExpertCalls):
    """A multi-expert model whose trained experts' forward and backward are collectives (FSDP2 gathers weights and
    reduce-scatters gradients, ZeRO reduces gradients in buckets every process must fill alike): every process runs
    an expert whenever one does. One small all-reduce per call decides; an expert this process runs only for the
    others runs on one row with weight 0, so that its backward joins theirs with a zero gradient.

    When does a process need an expert the others do not? NFT's per-sample sigmas can put one process's rows on
    either side of the experts' boundary and another's on one side; GRPO's micro-batches are one step each, the
    same expert on every process. Skipping the pass does not fail: the ranks' reductions pair up wrongly and the
    run silently diverges from DDP's (tests/test_wan22.py compares them)."""

    def __init__(self, experts: frozenset[str], device: torch.device):
        self.experts, self.device = experts, device
        self.idle_passes = 0  # what the lockstep cost: passes no row of this process needed

    def to_run(self, needed):
        import torch.distributed as dist

        names = list(needed)
        anywhere = torch.tensor([float(needed[n]) for n in names], device=self.device)
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
        return {n: needed[n] or (n in self.experts and bool(anywhere[i])) for i, n in enumerate(names)}

    def idle_pass(self, out, run_one_row):
        self.idle_passes += 1
        return out + 0 * run_one_row().sum()


class Backend:
    """What the launch's backend changes in the trainer (subclasses: one per backend, ``Backend.of``)."""

    name: ClassVar[str]  # as checkpoints record it: ddp, fsdp, deepspeed
    # the backend averages the gradients across processes (DDP's wrapper, FSDP2, the engine); False: the optimize
    # loop does (a multi-expert model under DDP)
    syncs_gradients: bool = True

    def __init__(self, accelerator, cfg):
        self.accelerator, self.cfg = accelerator, cfg
        self.lockstep: LockstepExperts | None = None
        self.record: dict = {}  # what the checkpoint's sharding record adds (set by checkpoint_contents)

    @staticmethod
    def of(accelerator, cfg) -> "Backend":
        kind = {"ddp": DataParallel, "fsdp": FSDP2, "deepspeed": DeepSpeedZeRO}[backend_of(accelerator)]
        return kind(accelerator, cfg)

    def check_before_loading(self) -> None:
        check_experts_before_loading(self.cfg, self.accelerator)
        check_optimizer_backend(self.cfg, self.name)

    def build(self, setup: ModelSetup) -> Built:
        raise NotImplementedError

    def syncing_module(self, adapter):
        """What ``optimize_epoch`` defers the gradient sync to, or None when it averages them itself."""
        return adapter.denoiser if self.syncs_gradients else None

    def all_finite(self, params: list) -> bool:
        """Whether the trained weights are finite, the same answer on every process."""
        return all_finite_everywhere(params)

    def held(self, trained: dict) -> tuple[list[int], dict[str, list[int]]]:
        """The trained values each process holds (all of them unless sharded), in total and by component: the
        checkpoint records them."""
        acc = self.accelerator
        held = torch.tensor([sum(local(p).numel() for p in module.parameters() if p.requires_grad)
                             for module in trained.values()], device=acc.device)
        held = acc.gather(held).reshape(acc.num_processes, len(trained))
        return held.sum(1).tolist(), dict(zip(trained, held.T.tolist()))

    def checkpoint_contents(self, trained: dict, optimizer, copies: WeightCopies, run_dir: Path,
                            epoch: int) -> CheckpointContents:
        """On every process (a collective for a sharded model); the main process writes what it returns."""
        saved = None if self.cfg.log.save_model_only else optimizer
        return CheckpointContents(None, saved, copies.state_files(), {})

    def idle_expert_passes(self) -> int | None:
        """The lockstep's idle passes since last asked, over every process (None: no lockstep)."""
        if self.lockstep is None:
            return None
        idle = torch.tensor([self.lockstep.idle_passes], device=self.accelerator.device)
        self.lockstep.idle_passes = 0
        return int(self.accelerator.gather(idle).sum())

    def _use_prepared(self, setup: ModelSetup, prepared: dict, collective: tuple[str, ...] = ()) -> None:
        """The prepared networks are what the model's forward calls; several experts run in lockstep: the trained
        ones and the ``collective`` others (frozen experts sharded too, whose forward all-gathers)."""
        adapter = setup.adapter
        adapter.callers = {name: module for name, module in prepared.items()
                           if module is not adapter.transformers[name]}
        if len(adapter.transformers) > 1:
            self.lockstep = adapter.expert_calls = LockstepExperts(frozenset(prepared) | frozenset(collective),
                                                                   self.accelerator.device)


class DataParallel(Backend):
    """DDP, and one process: every process holds every weight; gradients are averaged by DDP's wrapper."""

    name = "ddp"

    def build(self, setup: ModelSetup) -> Built:
        params = trainable_params(setup.trained)
        copies = setup.weight_copies(params)  # before the wrapper and torch.compile
        optimizer = self.accelerator.prepare(setup.make_optimizer(params))
        setup.compile()
        self.syncs_gradients = self._wrap(setup.adapter)
        setup.start.load_weights(setup.adapter, optimizer, self.accelerator.scaler, setup.say)
        setup.start.load_copies(copies)
        return Built(params, optimizer, copies)

    def _wrap(self, adapter) -> bool:
        """The transformer in DDP's wrapper (``accelerator.prepare``). A model with several experts is left
        unwrapped (False): DDP syncs only when every process calls the wrapped network in a micro-step, and a
        micro-step at low noise calls only the low-noise expert; the optimize loop averages their gradients."""
        if len(adapter.transformers) > 1:
            return False
        wrapped = self.accelerator.prepare(adapter.transformer)
        adapter.callers = {"transformer": wrapped} if wrapped is not adapter.transformer else {}
        return True

    def all_finite(self, params: list) -> bool:
        return all_finite(params)


class FSDP2(Backend):
    """Each trained network (each expert) its own FSDP2 root, one optimizer over their shards. A network of
    ``model.target_components`` that trains nothing (Flow-Factory's ``target_modules: transformer.default`` with
    both Wan2.2 experts named) is sharded too, frozen, so that each process holds a part of it (``shard_frozen``)."""

    name = "fsdp"

    def __init__(self, accelerator, cfg):
        super().__init__(accelerator, cfg)
        self.frozen: dict[str, torch.nn.Module] = {}  # the frozen networks sharded, by component

    def build(self, setup: ModelSetup) -> Built:
        setup.compile()
        prepared, optimizer, _ = prepare_sharded(self.accelerator, self.name, setup.trained, setup.make_optimizer)
        self.frozen = self.shard_frozen(setup)
        self._use_prepared(setup, prepared, tuple(self.frozen))
        params = trainable_params(setup.trained)  # FSDP2 replaced every parameter with its shard
        # a swap into the shards frees the gathered weights, so that the next forward gathers the swapped ones
        copies = setup.weight_copies(params, lambda: reshard_all(setup.trained.values()), sharded=True)
        setup.start.load_weights(setup.adapter, optimizer, self.accelerator.scaler, setup.say)
        setup.start.load_copies(copies)
        return Built(params, optimizer, copies)

    def shard_frozen(self, setup: ModelSetup) -> dict[str, torch.nn.Module]:
        """Each network ``model.target_components`` names that trains nothing, sharded as the trained ones are
        (every block a unit, then the root, over all processes; its parameters keep ``requires_grad`` False and
        join no optimizer). Its forward is then a collective: it runs in the experts' lockstep. Upstream's memory
        trick: a process holds 1/N of the frozen Wan2.2 expert instead of all of it."""
        named = set(self.cfg.model.target_components) - set(setup.trained)
        frozen = {name: module for name, module in setup.adapter.transformers.items() if name in named}
        for name, module in frozen.items():
            assert not any(p.requires_grad for p in module.parameters()), f"{name} is frozen, yet has a trained weight"
            shard_on_cpu(module)  # torch's fully_shard on the default mesh: the GPUs' too
            setup.say(f"fsdp2: {name} trains nothing and is sharded frozen beside the trained networks")
        return frozen

    def frozen_record(self) -> dict:
        """What each process holds of each frozen sharded network, and the sum of all its values (that it stayed
        as loaded), for the checkpoint's sharding record; a collective."""
        from torch.distributed.tensor import DTensor

        acc, record = self.accelerator, {}
        for name, module in self.frozen.items():
            params = list(module.parameters())
            held = acc.gather(torch.tensor([sum(local(p).numel() for p in params)], device=acc.device))
            total = acc.reduce(torch.stack([local(p).detach().double().sum() for p in params]).sum().to(acc.device),
                               "sum")
            record[name] = {"values_per_process": held.tolist(), "sum": float(total),
                            "all_dtensors": all(isinstance(p, DTensor) for p in params)}
        return {"frozen_sharded": record} if record else {}

    def checkpoint_contents(self, trained, optimizer, copies, run_dir, epoch) -> CheckpointContents:
        self.record = self.frozen_record()
        # every trained expert in turn, each a collective
        weights = {name: full_state_dict(module, self.accelerator, self.name) for name, module in trained.items()}
        state = None
        if not self.cfg.log.save_model_only:
            state = full_optimizer_state(optimized_model(trained), getattr(optimizer, "optimizer", optimizer))
        return CheckpointContents(weights, state, copies.state_files(), {})


class DeepSpeedZeRO(Backend):
    """DeepSpeed's one engine around the trained network (several experts bundled: ``sharding.BundledExperts``)."""

    name = "deepspeed"

    def __init__(self, accelerator, cfg):
        super().__init__(accelerator, cfg)
        self.engine = None

    def build(self, setup: ModelSetup) -> Built:
        acc, train = self.accelerator, self.cfg.train
        check_shardable(self.cfg, acc, len(setup.adapter.transformers))
        setup.compile()
        setup.start.load_weights(setup.adapter, say=setup.say)  # the engine's master copies start from them
        fill_deepspeed_config(acc.state.deepspeed_plugin, train.per_device_batch_size, self.cfg.gradient_accumulation,
                              train.max_grad_norm, acc.num_processes)
        prepared, optimizer, self.engine = prepare_sharded(acc, self.name, setup.trained, setup.make_optimizer)
        self._use_prepared(setup, prepared)
        if setup.start.resume_from is not None:
            resume_engine_state(self.engine, setup.start.resume_from, setup.start.resumed, acc.num_processes)
        params = trainable_params(setup.trained)
        # ZeRO-3's partitions are swapped in place: its gathered weights are freed around a swap
        zero3 = acc.state.deepspeed_plugin.zero_stage == 3
        copies = setup.weight_copies(params, (lambda: release_gathered(params)) if zero3 else None, sharded=True)
        setup.start.load_copies(copies)
        return Built(params, optimizer, copies)

    def checkpoint_contents(self, trained, optimizer, copies, run_dir, epoch) -> CheckpointContents:
        """The full weights; the engine's own state, each process's part written beside the checkpoint first."""
        acc = self.accelerator
        weights = {name: full_state_dict(module, acc, self.name) for name, module in trained.items()}
        folders = {}
        if not self.cfg.log.save_model_only:
            out = checkpoint_dir(run_dir, epoch)
            staging = out.with_name(f".{out.name}.{DEEPSPEED_DIR}{PARTIAL}")
            if acc.is_main_process:
                shutil.rmtree(staging, ignore_errors=True)  # left by a process killed during an earlier save
            acc.wait_for_everyone()
            save_engine_state(self.engine, staging)
            acc.wait_for_everyone()
            folders[DEEPSPEED_DIR] = staging
        return CheckpointContents(weights, None, copies.state_files(), folders)
