"""Reward / optimisation overlap on and off, side by side, with a slow (sleeping) async reward.

    python bench/reward_overlap.py [--latency 0.5] [--workers 2] [--epochs 2] [--repeats 1]

Trains the same tiny SD3 GRPO run (CPU, random-init pipeline built from config, LoRA rank 8, 64x64, 10 steps,
4 prompts x group 4, sampling and training micro-batches of 2, 2 optimizer steps an epoch, global_std: false,
advantage_aggregation: sum) with ``train.reward_optimization_overlap`` false and true, in sample order
(``shuffle_samples: false``) and shuffled. The reward sleeps ``--latency`` seconds a call (2 samples a call, in
``--workers`` threads; a remote or VLM reward that waits on its server), then scores each image's brightness. Prints
seconds per epoch (the first epoch of each run is a warm-up), the reward phase (with overlap: time the optimise loop
waited for a group's scores, taken out of training) and the training phase, and checks that both runs end with the same LoRA.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from flow_factory.config import parse_config  # noqa: E402
from flow_factory.rewards import PointwiseRewardModel, RewardModelOutput  # noqa: E402
from flow_factory.testing import build_tiny_pipeline  # noqa: E402
from flow_factory.trainer import Trainer  # noqa: E402


class SleepyBrightness(PointwiseRewardModel):
    """Each image's mean brightness, after ``latency`` seconds of waiting (the GIL released, as a server's)."""

    required_fields = ("prompt", "image")
    use_tensor_inputs = True

    def __init__(self, latency: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        self.latency = latency

    def __call__(self, prompt, image):
        time.sleep(self.latency)
        return RewardModelOutput(rewards=image.float().mean(dim=(1, 2, 3)))


def make_config(tmp: Path, model: str, args, run: str, overlap: bool, shuffle: bool) -> dict:
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    (data / "train.txt").write_text("\n".join(f"prompt {i}: a red circle" for i in range(16)) + "\n")
    return {
        "seed": 0,
        "data": {"dataset_dir": str(data)},
        "model": {"model_name_or_path": model, "model_type": "sd3-5", "lora_rank": 8, "lora_alpha": 8},
        "scheduler": {"dynamics_type": "Flow-SDE", "noise_level": 0.7, "sde_steps": list(range(args.steps)),
                      "num_sde_steps": args.sde_steps},
        "train": {"trainer_type": "grpo", "resolution": 64, "num_inference_steps": args.steps,
                  "latent_storage_dtype": "fp32", "ema_decay": 0.0, "global_std": False,
                  "advantage_aggregation": "sum", "guidance_scale": 4.5, "per_device_batch_size": 2, "group_size": 4,
                  "unique_sample_num_per_epoch": 4, "gradient_step_per_epoch": 2, "shuffle_samples": shuffle,
                  "reward_optimization_overlap": overlap, "max_epochs": args.epochs + 1},
        "eval": {"eval_freq": 0},
        "log": {"run_name": run, "save_dir": str(tmp / "saves"), "logging_backend": "none", "save_freq": 0},
        "rewards": [{"name": "sleepy", "reward_model": "reward_overlap.SleepyBrightness", "latency": args.latency,
                     "batch_size": 2, "async_reward": True, "num_workers": args.workers}],
    }


PHASES = ("epoch", "sampling", "reward", "training")


def measure(tmp: Path, model: str, args, run: str, overlap: bool, shuffle: bool) -> tuple[dict, list]:
    trainer = Trainer(parse_config(make_config(tmp, model, args, run, overlap, shuffle)))
    history = trainer.train()[1:]  # the first epoch: warm-up
    times = {p: sum(r.get(f"time/{p}", 0.0) for r in history) / len(history) for p in PHASES}
    return times, [p.detach().clone() for p in trainer.params]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--latency", type=float, default=0.5, help="seconds a reward call sleeps (2 samples a call)")
    p.add_argument("--workers", type=int, default=2, help="num_workers of the async reward")
    p.add_argument("--epochs", type=int, default=2, help="measured epochs per run (after one warm-up)")
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs per case; the median is printed")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--sde-steps", type=int, default=None, help="trained steps per rollout (null: every step)")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_pipeline("sd3-5", Path(tmp) / "sd3"))
        for shuffle in (False, True):
            found = {False: [], True: []}
            for r in range(args.repeats):
                for overlap in (False, True):  # alternating, so that a noisy machine slows both alike
                    name = f"{'shuffled' if shuffle else 'ordered'}-{'on' if overlap else 'off'}-{r}"
                    found[overlap].append(measure(Path(tmp), model, args, name, overlap, shuffle))
            same = max(float((a - b).abs().max()) for (_, pa), (_, pb) in zip(found[False], found[True])
                       for a, b in zip(pa, pb))
            med = {o: {ph: statistics.median(t[ph] for t, _ in found[o]) for ph in PHASES} for o in found}
            rows.append((shuffle, med, same))
    print(f"reward {args.latency:g} s a call of 2 samples, {args.workers} workers; 16 samples an epoch; "
          f"median of {args.repeats} run(s), {args.epochs} epochs each after a warm-up; torch threads "
          f"{torch.get_num_threads()}")
    print("| order | overlap | s / epoch | sampling | reward (waited) | training | saved | max LoRA difference |")
    print("|---|---|---|---|---|---|---|---|")
    for shuffle, med, same in rows:
        off, on = med[False], med[True]
        order = "shuffled" if shuffle else "in sample order"
        saved = f"{off['epoch'] - on['epoch']:.2f} s ({1 - on['epoch'] / off['epoch']:.0%})"
        for overlap, t in ((False, off), (True, on)):
            tail = f"{saved} | {same:.1e}" if overlap else " | "
            print(f"| {order} | {'on' if overlap else 'off'} | {t['epoch']:.2f} | {t['sampling']:.2f} | "
                  f"{t['reward']:.2f} | {t['training']:.2f} | {tail} |")

if __name__ == "__main__":
    main()
