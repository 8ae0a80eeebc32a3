"""Where an epoch's rollouts live and how many bytes they take, per memory setting.

    python bench/rollout_memory.py [--size 128] [--steps 10] [--samples 16]

Samples one epoch's rollouts on a tiny SD3 pipeline (built offline) with each of
``train.latent_storage_dtype`` fp32 / fp16 / bf16 and ``train.offload_samples_to_cpu``
off / on, and prints, measured from the tensors themselves, the bytes of the stored
trajectory and of everything the rollouts keep (trajectory, log-probs, conditioning), split
by device. On a GPU it also prints ``torch.cuda.max_memory_allocated`` over the sampling
of each setting. Then it scales the trajectory bytes to FLUX.1-dev at 1024 px (16 latent
channels at 1/8 resolution, 10 steps, 48 prompts x 24 per epoch over 8 processes), the
geometry of Flow-Factory's GRPO examples, where the trajectory is what these settings move.

Last, the on-policy ratio of a GRPO step trained on an fp16-stored trajectory, two ways:
the rollout integrating on the stored (rounded) values, as here, and the float32
trajectory rounded after sampling; max |ratio - 1| over the trained steps of each.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from flow_factory.data import PromptItem  # noqa: E402
from flow_factory.dynamics import make_dynamics  # noqa: E402
from flow_factory.models import load_adapter  # noqa: E402
from flow_factory.sampling import SamplingSettings, collect_rollouts  # noqa: E402
from flow_factory.testing import build_tiny_pipeline  # noqa: E402
from flow_factory.algorithms import make_algorithm  # noqa: E402
from flow_factory.algorithms.base import TrainBatch  # noqa: E402
from flow_factory.config.train import TrainConfig  # noqa: E402
from flow_factory.models.lora import apply_lora  # noqa: E402
from flow_factory.trajectory import TrajectoryOptions, sample_trajectory  # noqa: E402
from flow_factory.sampling import on_device  # noqa: E402
from flow_factory.trainer.policy import AdapterPolicy  # noqa: E402

SETTINGS = [("fp32", torch.float32, False), ("fp16", torch.float16, False), ("bf16", torch.bfloat16, False),
            ("fp16 + offload", torch.float16, True)]


def kept_bytes(rollouts) -> dict[str, int]:
    """Bytes per device type of what the rollouts keep for training."""
    out: dict[str, int] = {}
    for t in [rollouts.latents, rollouts.log_probs, *rollouts.cond.values()]:
        out[t.device.type] = out.get(t.device.type, 0) + t.nbytes
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--samples", type=int, default=16)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = build_tiny_pipeline("sd3-5", Path(tempfile.mkdtemp()) / "sd3")
    adapter = load_adapter("sd3-5", folder, device)
    items = [PromptItem(f"prompt {i // 4}") for i in range(args.samples)]
    groups = torch.arange(args.samples) // 4
    print(f"tiny SD3 on {device}: {args.samples} samples, {args.size} px, {args.steps} steps, Flow-SDE")
    print(f"{'setting':<16}{'trajectory MB':>14}{'x fp32':>8}{'rollouts MB':>13}  {'stored on':<10}"
          f"{'peak cuda MB':>13}")
    fp32_traj = None
    for name, dtype, offload in SETTINGS:
        settings = SamplingSettings(args.size, args.size, None, args.steps, 3.0, 4, 0, storage_dtype=dtype,
                                    offload=offload)
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        rollouts = collect_rollouts(adapter, make_dynamics("Flow-SDE", 0.7), items, groups,
                                    list(range(args.samples)), settings, epoch=0)
        peak = f"{torch.cuda.max_memory_allocated() / 2**20:.1f}" if device == "cuda" else "-"
        kept = kept_bytes(rollouts)
        traj = rollouts.latents.nbytes
        fp32_traj = fp32_traj or traj
        print(f"{name:<16}{traj / 2**20:>14.2f}{traj / fp32_traj:>8.2f}{sum(kept.values()) / 2**20:>13.2f}  "
              f"{'+'.join(sorted(kept)):<10}{peak:>13}")
        del rollouts
    if device == "cpu":
        print("(CPU only: the training device is the CPU, so offloading cannot lower memory here; on a GPU the "
              "offloaded rollouts leave its memory, which the peak column then shows)")
    per_sample = 16 * (1024 // 8) ** 2 * (args.steps + 1)  # FLUX.1-dev latent values per trajectory
    samples_per_process = 48 * 24 // 8  # Flow-Factory's GRPO example: 48 prompts x group 24 over 8 GPUs
    for name, nbytes in (("fp32", 4), ("fp16", 2)):
        gib = per_sample * nbytes * samples_per_process / 2**30
        print(f"FLUX.1-dev, 1024 px, {args.steps} steps, {samples_per_process} samples per process: "
              f"trajectories {gib:.2f} GiB in {name}")

    ratio_drift(folder, args.steps)


def ratio_drift(folder, steps: int) -> None:
    adapter = load_adapter("sd3-5", folder)
    apply_lora(adapter.transformer, 4, 4, "default", adapter.default_lora_targets)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # LoRA B starts at zero: give the policy weights of its own
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    dynamics = make_dynamics("Flow-SDE", 0.7)
    algorithm = make_algorithm("grpo", TrainConfig(kl_type="v-based"), dynamics)
    policy = AdapterPolicy(adapter, 3.0, "lora", keep_reference=False)
    cond = adapter.encode(["a red cube", "a blue ball"], None, 3.0)
    noise = adapter.initial_noise(2, 64, 64, torch.Generator().manual_seed(1))
    sigmas = adapter.sigmas(steps, 64, 64)

    def drift(traj, latents) -> float:
        worst = 0.0
        for step in traj.sde_steps:
            n = len(latents)
            batch = on_device(TrainBatch(
                x=latents[:, step], x_next=latents[:, step + 1], sigma=traj.sigmas[step].expand(n),
                sigma_next=traj.sigmas[step + 1].expand(n), old_log_prob=traj.log_probs[:, step],
                advantages=torch.tensor([1.0, -1.0]), cond=cond, step=torch.full((n,), step, dtype=torch.long)), "cpu")
            _, m = algorithm.loss(policy, batch)
            worst = max(worst, abs(m["ratio_min"].item() - 1), abs(m["ratio_max"].item() - 1))
        return worst

    kept = sample_trajectory(adapter, dynamics, cond, noise, sigmas, 3.0, generator=torch.Generator().manual_seed(2),
                             options=TrajectoryOptions(storage_dtype=torch.float16))
    full = sample_trajectory(adapter, dynamics, cond, noise, sigmas, 3.0, generator=torch.Generator().manual_seed(2))
    print(f"GRPO on an fp16 trajectory, 64 px, {steps} Flow-SDE steps, max |ratio - 1|: integrating on the stored "
          f"values {drift(kept, kept.latents):.1e}; rounding the fp32 trajectory afterwards "
          f"{drift(full, full.latents.half()):.1e} (clip_range default 1e-4)")


if __name__ == "__main__":
    main()
