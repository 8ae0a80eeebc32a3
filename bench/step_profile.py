"""Where a GRPO epoch's time goes, on a tiny SD3 pipeline built from config (CPU, offline).

    python bench/step_profile.py [--epochs 3] [--steps 10] [--prompts 4] [--group 4]

Prints seconds per phase (sampling, decode, reward, training, other), as the trainer
measures them, and splits the epoch into model computation (transformer forward,
text encoders, VAE decode, backward, optimizer step; timed by hooks around those
calls) and everything else: the framework's own overhead. The model here is tiny,
so that fraction is an upper bound of what a real model would see.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flow_factory.config import parse_config  # noqa: E402
from flow_factory.testing import build_tiny_pipeline  # noqa: E402
from flow_factory.trainer import Trainer  # noqa: E402
from model_clock import ModelClock  # noqa: E402

CLOCK = ModelClock()


def make_config(tmp: Path, args) -> dict:
    data = tmp / "data"
    data.mkdir()
    (data / "train.txt").write_text("\n".join(f"prompt number {i}: a red circle" for i in range(16)) + "\n")
    return {
        "seed": 0,
        "data": {"dataset_dir": str(data)},
        "model": {"model_name_or_path": str(build_tiny_pipeline("sd3-5", tmp / "sd3")), "model_type": "sd3-5",
                  "lora_rank": 8, "lora_alpha": 8},
        # every step stochastic and trained, fp32 trajectories, no EMA: the world this bench was measured in
        "scheduler": {"dynamics_type": "Flow-SDE", "noise_level": 0.7, "sde_steps": list(range(args.steps)),
                      "num_sde_steps": None},
        "train": {"trainer_type": "grpo", "resolution": 64, "num_inference_steps": args.steps,
                  "latent_storage_dtype": "fp32", "ema_decay": 0.0, "global_std": False, "advantage_aggregation": "sum",
                  "guidance_scale": 4.5, "per_device_batch_size": args.group, "group_size": args.group,
                  "unique_sample_num_per_epoch": args.prompts, "gradient_step_per_epoch": 2,
                  "max_epochs": args.epochs + 1},
        "eval": {"eval_freq": 0},
        "log": {"run_name": "profile", "save_dir": str(tmp / "saves"), "logging_backend": "none"},
        "rewards": [{"reward_model": "jpeg_compressibility"}],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3, help="measured epochs (one more runs first, as warm-up)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(parse_config(make_config(Path(tmp), args)))
        CLOCK.watch_trainer(trainer)

        # warm-up epoch, then reset the hook totals and measure
        warm = {}
        original_sample = trainer.sample_epoch

        def sample_epoch(epoch):
            if epoch == 1:
                warm.update(CLOCK.seconds)
                CLOCK.clear()
            return original_sample(epoch)

        trainer.sample_epoch = sample_epoch
        history = trainer.train()[1:]

    n = len(history)
    phases = ["sampling", "decode", "reward", "training", "other"]
    per_epoch = {p: sum(r[f"time/{p}"] for r in history) / n for p in phases}
    epoch = sum(r["time/epoch"] for r in history) / n
    model = {k: v / n for k, v in CLOCK.seconds.items()}
    rollouts = args.prompts * args.group
    print(f"tiny SD3 GRPO epoch: {rollouts} rollouts x {args.steps} steps at 64x64, "
          f"mean of {n} epochs after one warm-up\n")
    print(f"{'phase':<12}{'s/epoch':>10}{'share':>9}")
    for p in phases:
        print(f"{p:<12}{per_epoch[p]:>10.3f}{per_epoch[p] / epoch:>9.1%}")
    print(f"{'epoch':<12}{epoch:>10.3f}{1:>9.1%}\n")
    print(f"{'model computation':<22}{'s/epoch':>10}")
    for k, v in sorted(model.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<20}{v:>10.3f}")
    inside = sum(model.values())
    print(f"\noutside model computation: {epoch - inside:.3f} s of {epoch:.3f} s "
          f"= {(epoch - inside) / epoch:.1%} of the epoch")


if __name__ == "__main__":
    main()
