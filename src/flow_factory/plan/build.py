"""A config's plan: the model's sizes, the measured calls, memory per GPU by backend, work and time per epoch.

``make_plan(cfg, gpu)`` builds the pipeline on the meta device (plan/pipeline.py), trains it as the
trainer does (LoRA through ``models.lora.apply_lora`` on ``model.target_components``, gradient
checkpointing, trained weights in ``master_weight_dtype``), measures one sampling call, one training
micro-batch and one decode (plan/measure.py), and the eval's calls and decodes at each of its sizes
(plan/evaluation.py), and puts the figures together with the config's epoch arithmetic
(``Config.samples_per_epoch``, ``micro_steps_per_epoch``, ``eval.eval_freq``) and the algorithm's own
``kept_states`` and weight snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..config.base import resolution_pair
from ..config.algorithms import ALGORITHM_SPECS, COUPLED_TRAINER_TYPES, OFFLINE_TRAINER_TYPES
from ..precision import Precision
from . import memory
from .blocks import measure_scaled
from .conditioning import conditioning
from .evaluation import EvalCall, EvalPlan, eval_plan
from .gpus import GPUS, UTILISATION
from .measure import Measured, measure_call, measure_velocity
from .memory import OPTIMIZER_STATE
from .pipeline import build_model, build_pipeline
from .roles import Call, add_phase_calls, generator_optimizer, phase_passes, role_memory, training_peak


@dataclass
class Plan:
    config: object
    gpu: str
    num_processes: int
    backend: str
    precision: Precision
    source: str
    components: dict[str, dict]  # name -> class, params, bytes, role
    trained: dict[str, int]  # trained parameters per network
    sizes: memory.Sizes
    calls: dict[str, Measured]  # rollout, training, decode, and the eval's (plan/evaluation.py)
    flops: dict[str, float] = field(default_factory=dict)  # per GPU per epoch, by phase
    notes: list[str] = field(default_factory=list)
    utilisation: float = UTILISATION
    evaluation: EvalPlan | None = None  # None: the run does not evaluate

    def memory(self, backend: str | None = None) -> dict[str, dict[str, int]]:
        return memory.per_gpu(self.sizes, backend or self.backend, self.num_processes)

    def peak(self, backend: str | None = None) -> tuple[str, int]:
        return memory.peak(self.memory(backend))

    @property
    def usable(self) -> int:
        return GPUS[self.gpu].memory - memory.RESERVE

    def fits(self, backend: str | None = None) -> bool:
        return self.peak(backend)[1] <= self.usable

    def seconds(self, flops: float) -> float:
        return flops / (GPUS[self.gpu].bf16_flops * self.utilisation)

    @property
    def seconds_per_epoch(self) -> float:
        return self.seconds(sum(self.flops.values()))

    @property
    def eval_flops(self) -> float:
        """FLOPs of one eval on the busiest GPU (its prompts counted where the test split was read)."""
        return self.evaluation.flops(self.calls) if self.evaluation else 0.0


def largest_block(module: nn.Module) -> int:
    """Parameters of the largest block of the network's ``*blocks`` lists: what FSDP2 gathers at a time."""
    sizes = [sum(p.numel() for p in block.parameters()) for name, child in module.named_children()
             if isinstance(child, nn.ModuleList) and name.endswith("blocks") for block in child]
    return max(sizes, default=sum(p.numel() for p in module.parameters()))


def make_trainable(adapter, cfg, master: torch.dtype) -> dict[str, int]:
    """The trainer's ``models.lora.make_trainable``, its LoRA weights made on the meta device; trained parameters
    per network."""
    from accelerate import init_empty_weights

    from ..models.lora import make_trainable as make_trainable_like_the_trainer

    with init_empty_weights():
        trained = make_trainable_like_the_trainer(adapter, cfg, master)
    return {name: sum(p.numel() for p in module.parameters() if p.requires_grad) for name, module in trained.items()}


def trajectory_bytes(cfg, adapter, latent_numel: int, storage: torch.dtype, cond_bytes: int) -> tuple[int, int]:
    """(this process's rollouts of an epoch, one micro-batch of them): the kept states, log-probs and each
    sample's conditioning, as ``Rollouts`` holds them on the device."""
    from ..algorithms import make_algorithm
    from ..dynamics import make_dynamics

    if cfg.train.trainer_type in OFFLINE_TRAINER_TYPES:  # no rollouts: a micro-batch of the dataset's latents
        batch = cfg.train.per_device_batch_size * (latent_numel * storage.itemsize + cond_bytes)
        return batch, batch
    algorithm = make_algorithm(cfg.train.trainer_type, cfg.train,
                               make_dynamics(cfg.scheduler.dynamics_type, cfg.scheduler.noise_level))
    steps = cfg.rollout_steps
    window = (cfg.sde_step_candidates[:cfg.trained_steps_per_sample]
              if cfg.train.trainer_type in COUPLED_TRAINER_TYPES else None)
    kept = len(algorithm.kept_states(steps, window))
    per_sample = kept * latent_numel * storage.itemsize + steps * 4 + cond_bytes
    samples = cfg.samples_per_epoch // cfg.num_processes
    return samples * per_sample, cfg.train.per_device_batch_size * per_sample


def weight_copies(cfg, trained_bytes: int, reference_bytes: int) -> tuple[dict[str, tuple[int, str]], tuple]:
    """The copies of the trained weights a run keeps, with where: EMA, the KL's reference (full fine-tuning; a
    LoRA's reference is the adapter switched off), the algorithm's snapshots (CRD, DGPO)."""
    from ..algorithms import make_algorithm
    from ..dynamics import make_dynamics

    train = cfg.train
    where = lambda device: "cpu" if device == "cpu" else "gpu"  # noqa: E731
    copies = {}
    if train.ema_decay > 0:
        copies["EMA"] = (trained_bytes, where(train.ema_device))
    if train.kl_beta > 0 and cfg.model.finetune_type == "full":
        copies["reference"] = (reference_bytes, where(train.ref_param_device))
    algorithm = make_algorithm(train.trainer_type, train, make_dynamics(cfg.scheduler.dynamics_type,
                                                                        cfg.scheduler.noise_level))
    for name in algorithm.weight_snapshots:
        copies[name] = (trained_bytes, "gpu")
    for name in algorithm.step_snapshots:
        copies[name] = (trained_bytes, where(train.ema_ref_device))
    return copies, tuple(copies)


def reward_models(cfg, notes: list[str], part: str = "rewards", counted: set | None = None) -> tuple[int, list]:
    """Bytes of the reward models (``part``: rewards or eval_rewards) on the device, and (name, meta model) of each
    that was built; a reward this version does not have (a config of Flow-Factory's naming one of its rewards:
    LTX-2's ``imagebind``) is a note. ``counted``: the ``reward_key`` of the models counted already, which the run
    shares (the training rewards', for its eval rewards); the ones counted here are added to it."""
    from ..precision import dtype_of
    from ..rewards.registry import resolve_reward_class
    from ..rewards.reward_set import reward_key

    total, built, counted = 0, [], set() if counted is None else counted
    for i, entry in enumerate(getattr(cfg, part) or []):
        try:
            cls = resolve_reward_class(entry.reward_model)
        except (ValueError, ImportError, TypeError) as err:  # the plan of the rest still answers; the run would stop
            notes.append(f"{part}[{i}].reward_model: {str(err).split('. ')[0]}; a run stops there (not counted)")
            continue
        key = reward_key(entry)
        shared = key in counted
        counted.add(key)
        sources = cls.models_to_load(entry.constructor_options())
        model = build_model(sources[0], dtype_of(entry.dtype)) if sources else None
        if model is None:
            if sources:
                notes.append(f"reward {entry.name}: {sources[0]}'s size is not known here (not counted)")
            continue
        if entry.device != "cpu" and not shared:
            total += sum(p.numel() * p.element_size() for p in model.parameters())
        built.append((entry.name, model))
    return total, built


def make_plan(cfg, gpu: str = "h100", num_processes: int | None = None, device: str = "cuda",
              text_tokens: int | dict[str, int] | None = None, utilisation: float = UTILISATION,
              calls: dict[str, Measured] | None = None) -> Plan:
    """The plan of ``cfg`` on ``num_processes`` (the config's by default) GPUs of kind ``gpu``; ``device`` "cpu"
    plans a CPU run (float32, as ``precision.run_mixed_precision`` makes it). ``calls``: measured calls to take as
    they are (another plan's, for a change that keeps them: where rollouts or copies are kept); the rest measured."""
    n = num_processes or cfg.num_processes
    mixed = cfg.mixed_precision if device == "cuda" else "no"
    precision = Precision.of(mixed, device, cfg.model.master_weight_dtype, cfg.train.latent_storage_dtype)
    meta = build_pipeline(cfg.model.model_type, cfg.model.model_name_or_path, precision.load)
    adapter, train, notes = meta.adapter, cfg.train, []
    trained = make_trainable(adapter, cfg, precision.master)
    size = TrainingSize.of(train, adapter)
    calls, evaluation = measure_calls(cfg, adapter, precision, text_tokens, n, notes, calls)

    networks = denoisers(adapter, trained, precision, calls["training"])
    trained_bytes = sum(net.trained * net.master_bytes for net in networks)
    reference = sum(net.params * net.load_bytes for net in networks if net.trained)
    copies, sharded = weight_copies(cfg, trained_bytes, reference)
    reward_bytes, rewards, eval_rewards = run_reward_models(cfg, notes)
    cond_bytes = sum(v[0].numel() * precision.load.itemsize for v in
                     conditioning(adapter, 1, train.guidance_scale, size.height, size.width, size.frames,
                                  size.condition_size, text_tokens).values())
    epoch, batch = trajectory_bytes(cfg, adapter, int(torch.Size(size.latent).numel()), precision.storage,
                                    cond_bytes)
    roles = meta.of_role
    sizes = memory.Sizes(
        networks=networks,
        text_encoders=sum(c.bytes for c in roles("text_encoder").values()),
        other_networks=sum(c.bytes for c in [*roles("vae").values(), *roles("image_encoder").values()]),
        rewards=reward_bytes,
        optimizer_bytes=OPTIMIZER_STATE[generator_optimizer(cfg)] * 4,
        copies=copies, sharded_copies=sharded, trajectories=epoch, trajectory_batch=batch,
        offload_samples=train.offload_samples_to_cpu, text_encoders_stay=not cfg.data.enable_preprocess,
        rollout_activations=calls["rollout"].peak, decode_activations=calls["decode"].peak,
        train_activations=training_peak(cfg, calls), **role_memory(cfg, networks, precision, notes),
        eval_activations=evaluation.activations(calls) if evaluation else None)
    plan = Plan(cfg, gpu, n, memory.backend_of(cfg.config_file), precision, meta.source,
                {name: {"class": c.class_name, "params": c.params, "bytes": c.bytes, "role": c.role}
                 for name, c in meta.components.items()}, trained, sizes, calls, notes=notes + meta.notes,
                utilisation=utilisation, evaluation=evaluation)
    plan.flops = epoch_flops(cfg, n, calls, rewards, steps_per_call(cfg))
    if evaluation and evaluation.counted:  # every eval_freq epochs: its share of each epoch
        evaluation.reward_flops_per_sample = reward_flops(cfg, eval_rewards, 1, cfg.eval.num_frames)
        plan.flops["eval"] = plan.eval_flops / evaluation.eval_freq
    return plan


@dataclass(frozen=True)
class TrainingSize:
    """What a training sample is generated at: its size, frames, condition images' size and latent shape."""

    height: int
    width: int
    frames: int | None
    condition_size: tuple[int, int] | None
    latent: tuple

    @staticmethod
    def of(train, adapter) -> "TrainingSize":
        (height, width), frames = train.height_width, train.num_frames
        condition_size = None if train.condition_image_size is None else resolution_pair(train.condition_image_size)
        return TrainingSize(height, width, frames, condition_size, tuple(adapter.latent_shape(height, width, frames)))


def steps_per_call(cfg) -> int:
    """The trained steps of a sample one training call takes (``train.steps_per_call``, "all": every one)."""
    return cfg.trained_steps_per_sample if cfg.train.steps_per_call == "all" else cfg.train.steps_per_call


def measure_calls(cfg, adapter, precision: Precision, text_tokens, n: int, notes: list[str],
                  calls: dict[str, Measured] | None) -> tuple[dict[str, Measured], EvalPlan | None]:
    """Each call the plan counts, measured on the meta device unless ``calls`` holds it (another plan's): the
    rollout's, the training micro-batch's and the decode's at the training size, the distillation phases', and the
    eval's at each of its sizes; with the eval's plan on ``n`` processes (None: the run does not evaluate)."""
    train, size = cfg.train, TrainingSize.of(cfg.train, adapter)

    def call(rows: int, scale: float, grad: bool, at: EvalCall | None = None) -> Measured:
        """A transformer call at the training size, or at an eval call's (``at``)."""
        h, w, f, c = (size.height, size.width, size.frames, size.condition_size) if at is None else \
            (at.height, at.width, at.num_frames, at.condition_size)
        shape, cond = adapter.latent_shape(h, w, f), conditioning(adapter, rows, scale, h, w, f, c, text_tokens)
        return unless_values_read(lambda: measure_scaled(
            lambda: measure_velocity(adapter, torch.zeros(rows, *shape), 0.9 if grad else 1.0, cond, scale, grad,
                                     precision.autocast_dtype), adapter.transformers),
            f"{'training' if grad else 'sampling' if at is None else at.key} call", notes)

    b, per_call = train.per_device_batch_size, steps_per_call(cfg)
    loss_scale = getattr(train, "loss_guidance_scale", train.guidance_scale)
    rows = b * 2 if ALGORITHM_SPECS[train.trainer_type].pairs_per_group else b  # dpo: a micro-batch of b pairs
    calls = {**offline_calls(cfg, notes), **(calls or {})}
    for name, measure in (("rollout", lambda: call(b, train.guidance_scale, False)),
                          ("training", lambda: call(rows * per_call, loss_scale, True)),
                          ("decode", lambda: decode(adapter, b, size.latent, precision, notes))):
        calls[name] = calls[name] if name in calls else measure()
    add_phase_calls(cfg, adapter, call, calls, Call(rows * per_call, float(loss_scale), True))  # distillation
    evaluation = eval_plan(cfg, type(adapter), n, notes)
    add_eval_calls(evaluation, calls, call, lambda at: decode(adapter, at.rows, adapter.latent_shape(
        at.height, at.width, at.num_frames), precision, notes))
    return calls, evaluation


def run_reward_models(cfg, notes: list[str]) -> tuple[int, list, list]:
    """Bytes of every reward model a run holds, and (name, meta model) of each of its ``rewards`` and of its
    ``eval_rewards`` (a set of their own, beside the training one for the whole run; a model the two share,
    ``Trainer._setup_rewards``, counted once)."""
    counted = set()
    total, rewards = reward_models(cfg, notes, counted=counted)
    if not cfg.eval_rewards:
        return total, rewards, rewards
    eval_bytes, eval_rewards = reward_models(cfg, notes, "eval_rewards", counted)
    return total + eval_bytes, rewards, eval_rewards


def add_eval_calls(evaluation: EvalPlan | None, calls: dict[str, Measured], call, decode_at) -> None:
    """``calls`` gains each distinct eval call (``call(rows, guidance, False, at)``, no gradients) and decode
    (``decode_at(at)``) the eval makes, unless it holds it (another plan's)."""
    for at in dict.fromkeys(part.call for part in evaluation.parts) if evaluation else ():
        if at.key not in calls:
            calls[at.key] = call(at.rows, at.guidance, False, at)
        if at.decode_key not in calls:
            calls[at.decode_key] = decode_at(at)


def offline_calls(cfg, notes: list[str]) -> dict[str, Measured]:
    """An offline trainer's (sft, offline-dpo) calls that do not run: it samples nothing and decodes nothing
    in an epoch, so neither is measured nor counted (its eval samples and decodes as every trainer's does)."""
    if cfg.train.trainer_type not in OFFLINE_TRAINER_TYPES:
        return {}
    notes.append(f"{cfg.train.trainer_type} trains on the dataset's media: no rollout and no decode in an epoch; "
                 "the VAE's encoding of the media (before training) is not counted, and the epoch counted is "
                 f"{cfg.samples_per_epoch} samples (unique_sample_num_per_epoch x group_size) where the run's "
                 "is one pass over the dataset")
    return {"rollout": Measured(0, 0), "decode": Measured(0, 0)}


def denoisers(adapter, trained: dict[str, int], precision: Precision, training: Measured) -> list[memory.Network]:
    """The denoising networks as the run holds them; a trained one's parameters that get a gradient are those
    the measured training call gave one, or all of them where the call did not run it (the other expert)."""
    return [memory.Network(name, sum(p.numel() for p in module.parameters()), precision.load.itemsize,
                           trained.get(name, 0), precision.master.itemsize, largest_block(module),
                           training.gradients.get(name) or -1)
            for name, module in adapter.transformers.items()]


def unless_values_read(measure, what: str, notes: list[str]) -> Measured:
    """``measure()``, or nothing measured (0 FLOPs, 0 bytes) with a note where the code reads values that meta
    tensors do not hold and ``KnownValues`` does not keep either (computed from the weights, or larger than its
    limit: plan/values.py); HunyuanVideo-1.5's masks it keeps."""
    try:
        return measure()
    except Exception as err:
        notes.append(f"{what} NOT MEASURED, its memory and FLOPs are missing ({type(err).__name__}: "
                     f"{str(err).splitlines()[0][:80]})")
        return Measured(0, 0)


def decode(adapter, n: int, latent: tuple, precision: Precision, notes: list[str]) -> Measured:
    return unless_values_read(lambda: measure_call(adapter.decode, torch.zeros(n, *latent, device="meta",
                                                                                dtype=precision.load),
                                                   autocast=precision.autocast_dtype), "VAE decode", notes)


def epoch_flops(cfg, n: int, calls: dict[str, Measured], rewards: list, per_call: int) -> dict[str, float]:
    """FLOPs one GPU does in an epoch, by phase: the rollout's transformer calls and decodes, the training
    forward and backward (and the KL's reference forward), and the reward models."""
    train = cfg.train
    batches = cfg.batches_per_epoch  # sampling batches per process
    rollout = batches * cfg.rollout_steps * calls["rollout"].flops
    micro_calls = cfg.micro_steps_per_epoch * train.num_inner_epochs / per_call
    training = micro_calls * calls["training"].flops
    if train.kl_beta > 0:  # one reference forward per micro-batch: about a third of a forward and backward
        training += micro_calls * calls["training"].flops / 3
    passes = phase_passes(cfg)
    if passes:  # every phase's passes over every chunk of the epoch (plan/roles.py)
        chunks = cfg.optimize_batches_per_epoch * train.num_inner_epochs
        training = chunks * sum(n * calls[f"{role} pass"].flops for role, n in passes)
    flops = {"rollout": rollout, "decode": batches * calls["decode"].flops, "training": training}
    flops["rewards"] = reward_flops(cfg, rewards, batches * train.per_device_batch_size)
    return flops


def reward_flops(cfg, rewards: list, samples: int, num_frames: int | None = None) -> float:
    """A CLIP-type reward model's forward per image (its image and text towers), times the samples a GPU scores
    (each frame of a video: ``num_frames``, None: training's). Other reward models: not counted."""
    total = 0.0
    frames = (num_frames or cfg.train.num_frames) or 1
    for _, model in rewards:
        vision = getattr(getattr(model, "config", None), "vision_config", None)
        if vision is None or not hasattr(model, "get_image_features"):
            continue
        pixels = torch.zeros(1, 3, vision.image_size, vision.image_size, device="meta", dtype=model.dtype)
        tokens = torch.zeros(1, 77, dtype=torch.long, device="meta")
        measured = measure_call(lambda: (model.get_image_features(pixel_values=pixels),
                                         model.get_text_features(input_ids=tokens)))
        total += measured.flops * samples * frames
    return total
