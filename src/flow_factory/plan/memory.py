"""Memory per GPU, by phase and by backend, from the sizes the planner built and measured.

The phases of a run, each a sum of what a GPU holds through it:

- ``prompt cache``: every network loaded in its load dtype, the text encoders included, before the trained
  weights exist (the trainer caches every prompt first, then moves the text encoders off the device);
- ``rollout``: the networks, the trained weights' optimizer state and copies (EMA, reference, snapshots),
  the reward models, the epoch's trajectories as they grow, and the largest of one sampling call's and one
  VAE decode's own tensors (measured, plan/measure.py); a distillation run's other roles too (their weights,
  optimizer state and copies: plan/roles.py);
- ``training``: the same, with the gradients and one training micro-batch's activations (measured; a
  distillation run's: the largest phase's pass, plan/roles.py);
- ``eval`` (a run that evaluates): what stays on the device (the networks, reward models, optimizer state and
  copies), with the largest of the eval's sampling calls' and decodes' own tensors at its sizes
  (plan/evaluation.py); no trajectories (the trainer lets an epoch's rollouts go before it evaluates) and no
  gradients (set to None at each optimizer step).

The backends differ in what is split over the ``n`` processes (docs/scaling.md): ``multi_gpu`` (DDP) keeps
everything whole and a bucket copy of the gradients; ``zero1`` splits the optimizer state, ``zero2`` the
gradients too, ``zero3`` the trained network's weights too; ``fsdp2`` splits the trained networks' weights,
gradients and optimizer state, and gathers one block at a time (two: the next is prefetched);
``fsdp2_offload`` and ``zero2_offload`` keep the split parts in CPU memory. This is arithmetic on the
one-process figures; FSDPMemTracker could measure FSDP2 itself but not DeepSpeed (plan/measure.py says why
it is not used).

Not counted: the CUDA context and NCCL's buffers (the verdict keeps ``RESERVE`` free for them and for the
allocator's fragmentation), a reward model's own activations, autocast's float32 copies of a few operators'
inputs, the text encoders' activations while caching, and DeepSpeed's communication buckets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 2 ** 30
RESERVE = 2 * GiB  # left free on every GPU: CUDA context, NCCL, the caching allocator's fragmentation
BACKENDS = ("multi_gpu", "fsdp2", "fsdp2_offload", "zero2", "zero3")
PHASES = ("prompt cache", "rollout", "training", "eval")  # eval: only where the run evaluates
OPTIMIZER_STATE = {"adamw": 2, "muon": 1}  # float32 values per trained parameter (AdamW's two moments)


@dataclass
class Network:
    """One denoising network as the run holds it."""

    name: str
    params: int
    load_bytes: int  # per parameter, its load dtype
    trained: int = 0  # parameters that train (LoRA's, or all of them)
    master_bytes: int = 4  # per trained parameter
    block_params: int = 0  # its largest repeated block: what FSDP2 / ZeRO-3 gathers at a time
    stepped: int = -1  # trained parameters that get a gradient (and optimizer state); -1: all of them

    @property
    def graded(self) -> int:
        return self.trained if self.stepped < 0 else self.stepped

    @property
    def weight_bytes(self) -> int:
        frozen = self.params - self.trained if self.trained < self.params else 0
        return frozen * self.load_bytes + self.trained * self.master_bytes


@dataclass
class Sizes:
    """What the memory of a run is made of, in bytes (counts and measured peaks)."""

    networks: list[Network]
    text_encoders: int
    other_networks: int  # the VAE, an image encoder, LTX-2's audio VAE and vocoder: on the device throughout
    rewards: int  # reward models on the device
    optimizer_bytes: int  # per trained parameter (AdamW: two float32 moments)
    copies: dict[str, tuple[int, str]] = field(default_factory=dict)  # name -> (bytes, where: gpu or cpu)
    sharded_copies: tuple[str, ...] = ()  # copies the sharded backends split (of the shards)
    trajectories: int = 0  # this process's rollouts of an epoch, on the device
    trajectory_batch: int = 0  # one micro-batch of them (offload_samples_to_cpu)
    offload_samples: bool = False
    text_encoders_stay: bool = False  # no prompt cache: they stay on the device
    rollout_activations: int = 0
    decode_activations: int = 0
    train_activations: int = 0
    # a distillation run's other roles (plan/roles.py): part -> (bytes, where, split as: weights, optimizer or
    # copies); and the largest other role's gradients (one role's at a time)
    roles: dict[str, tuple[int, str, str]] = field(default_factory=dict)
    role_gradients: int = 0
    eval_activations: int | None = None  # the eval's largest call or decode; None: the run does not evaluate

    @property
    def trained(self) -> int:
        return sum(n.trained for n in self.networks)

    @property
    def trained_bytes(self) -> int:
        return sum(n.trained * n.master_bytes for n in self.networks)

    @property
    def graded(self) -> int:
        """Trained parameters that get a gradient and optimizer state."""
        return sum(n.graded for n in self.networks)

    @property
    def gradient_bytes(self) -> int:
        return sum(n.graded * n.master_bytes for n in self.networks)


def backend_of(config_file) -> str:
    """The backend a ``config_file`` launches: a shipped name, or what its accelerate YAML says."""
    from ..launch_configs import resolve, shipped_name

    if config_file is None:
        return "multi_gpu"
    name = shipped_name(str(config_file))
    if name in ("single_gpu", "multi_gpu", "multi_node"):
        return "multi_gpu"
    if name:
        return name
    import yaml

    launch = yaml.safe_load(resolve(str(config_file)).read_text()) or {}
    kind = launch.get("distributed_type")
    if kind == "FSDP":
        return "fsdp2_offload" if (launch.get("fsdp_config") or {}).get("fsdp_offload_params") else "fsdp2"
    if kind == "DEEPSPEED":
        ds = launch.get("deepspeed_config") or {}
        stage = int(ds.get("zero_stage", 2))
        offload = ds.get("offload_optimizer_device") not in (None, "none") and stage == 2
        return f"zero{stage}" + ("_offload" if offload else "")
    return "multi_gpu"


def split(backend: str, n: int) -> dict[str, float]:
    """The fraction of each part a GPU holds: trained networks' weights, gradients, optimizer state, copies."""
    whole, shard, off = 1.0, 1.0 / n, 0.0
    return {
        "multi_gpu": dict(weights=whole, grads=whole, optimizer=whole, copies=whole, bucket=whole if n > 1 else 0),
        "zero1": dict(weights=whole, grads=whole, optimizer=shard, copies=whole, bucket=0),
        "zero2": dict(weights=whole, grads=shard, optimizer=shard, copies=whole, bucket=0),
        "zero2_offload": dict(weights=whole, grads=shard, optimizer=off, copies=whole, bucket=0),
        "zero3": dict(weights=shard, grads=shard, optimizer=shard, copies=shard, bucket=0),
        "fsdp2": dict(weights=shard, grads=shard, optimizer=shard, copies=shard, bucket=0),
        "fsdp2_offload": dict(weights=off, grads=off, optimizer=off, copies=shard, bucket=0),
    }[backend]


def per_gpu(s: Sizes, backend: str, n: int) -> dict[str, dict[str, int]]:
    """phase -> part -> bytes on one GPU."""
    part = split(backend, n)
    sharded_weights = part["weights"] < 1
    frozen = sum(net.params * net.load_bytes for net in s.networks)
    weights = 0
    for net in s.networks:
        if net.trained and sharded_weights:  # split, and one block gathered while the next is prefetched
            weights += int(net.weight_bytes * part["weights"]) + 2 * net.block_params * net.load_bytes
        else:
            weights += net.weight_bytes
    copies = sum(int(size * (part["copies"] if name in s.sharded_copies else 1))
                 for name, (size, where) in s.copies.items() if where == "gpu")
    fixed = {"networks": weights, "VAE and other encoders": s.other_networks, "reward models": s.rewards,
             "optimizer state": int(s.graded * s.optimizer_bytes * part["optimizer"]), "weight copies": copies}
    if s.text_encoders_stay:
        fixed["text encoders"] = s.text_encoders
    # a distillation run's other roles train beside DeepSpeed's engine, whole (trainer/roles.py); FSDP2 shards them
    beside_engine = backend.startswith("zero")
    fixed.update({name: int(size * (1.0 if beside_engine else part[kind]))
                  for name, (size, where, kind) in s.roles.items() if where == "gpu"})
    trajectories = s.trajectory_batch if s.offload_samples else s.trajectories
    grads = max(int(s.gradient_bytes * part["grads"]),
                int(s.role_gradients * (1.0 if beside_engine else part["grads"])))
    phases = {
        "prompt cache": {"networks": frozen, "text encoders": s.text_encoders, "VAE and other encoders": s.other_networks,
                         "reward models": s.rewards},
        "rollout": {**fixed, "trajectories": s.trajectories if not s.offload_samples else 0,
                    "sampling / decoding activations": max(s.rollout_activations, s.decode_activations)},
        "training": {**fixed, "trajectories": trajectories, "gradients": grads,
                     "DDP gradient buckets": int(s.trained_bytes * part["bucket"]),
                     "activations": s.train_activations},
    }
    if s.eval_activations is not None:
        phases["eval"] = {**fixed, "eval call / decode activations": s.eval_activations}
    return phases


def peak(phases: dict[str, dict[str, int]]) -> tuple[str, int]:
    """(the phase that needs most, its bytes)."""
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    worst = max(totals, key=totals.get)
    return worst, totals[worst]
