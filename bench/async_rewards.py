"""Sync vs async rewards, side by side, with a reward server of fixed latency.

    python bench/async_rewards.py [--latency 0.2] [--workers 4] [--epochs 2]

Starts ``ff-reward-server`` serving ``LatencyServer`` (every compute call sleeps
``--latency`` seconds; concurrent requests are merged into one call) on loopback, then
trains the same tiny SD3 GRPO run twice: the remote reward scored after sampling
(``async_reward: false``), and scored per micro-batch in a pool of ``--workers`` threads
while sampling goes on (``async_reward: true``). Prints seconds per epoch and in the reward
phase for both, and their ratio; the first epoch of each run is a warm-up.
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

from reward_servers import free_port, start_server, stop_server  # noqa: E402


def make_config(tmp: Path, model: str, url: str, args, run: str, is_async: bool) -> dict:
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    (data / "train.txt").write_text("\n".join(f"prompt {i}: a red circle" for i in range(16)) + "\n")
    reward = {"name": "remote", "reward_model": "remote", "server_url": url, "batch_size": args.request_size,
              "timeout": 30.0}
    if is_async:
        reward |= {"async_reward": True, "num_workers": args.workers}
    return {
        "seed": 0,
        "data": {"dataset_dir": str(data)},
        "model": {"model_name_or_path": model, "model_type": "sd3-5", "lora_rank": 8, "lora_alpha": 8},
        # every step stochastic and trained, fp32 trajectories, no EMA: the world this bench was measured in
        "scheduler": {"dynamics_type": "Flow-SDE", "noise_level": 0.7, "sde_steps": list(range(args.steps)),
                      "num_sde_steps": None},
        "train": {"trainer_type": "grpo", "resolution": 64, "num_inference_steps": args.steps,
                  "latent_storage_dtype": "fp32", "ema_decay": 0.0, "global_std": False, "advantage_aggregation": "sum",
                  "guidance_scale": 4.5, "per_device_batch_size": args.micro_batch, "group_size": 4,
                  "unique_sample_num_per_epoch": args.prompts, "gradient_step_per_epoch": 1,
                  "max_epochs": args.epochs + 1},
        "eval": {"eval_freq": 0},
        "log": {"run_name": run, "save_dir": str(tmp / "saves"), "logging_backend": "none"},
        "rewards": [reward],
    }


PHASES = ("epoch", "sampling", "reward", "training")


def measure(tmp: Path, model: str, url: str, args, is_async: bool) -> dict[str, float]:
    trainer = Trainer(parse_config(make_config(tmp, model, url, args, "async" if is_async else "sync", is_async)))
    history = trainer.train()[1:]  # first epoch: warm-up
    return {p: sum(r[f"time/{p}"] for r in history) / len(history) for p in PHASES}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--latency", type=float, default=0.2, help="seconds per server compute call")
    p.add_argument("--workers", type=int, default=4, help="num_workers of the async run")
    p.add_argument("--epochs", type=int, default=2, help="measured epochs per run (after one warm-up)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per epoch (group size 4)")
    p.add_argument("--micro-batch", type=int, default=2, help="sampling micro-batch (per_device_batch_size)")
    p.add_argument("--request-size", type=int, default=2, help="samples per request (the reward's batch_size)")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()

    port = free_port()
    server = start_server("reward_servers.LatencyServer", port,
                          "--option", f"latency={args.latency}")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model = str(build_tiny_pipeline("sd3-5", Path(tmp) / "sd3"))
            url = f"http://127.0.0.1:{port}"
            sync = measure(Path(tmp), model, url, args, is_async=False)
            asyn = measure(Path(tmp), model, url, args, is_async=True)
    finally:
        stop_server(server)
    samples = args.prompts * 4
    print(f"tiny SD3 GRPO epoch: {samples} samples, micro-batch {args.micro_batch}, {samples // args.request_size} "
          f"reward requests of {args.request_size}, server latency {args.latency:g} s per call\n")
    print(f"{'seconds per epoch':<26}" + "".join(f"{p:>10}" for p in PHASES))
    print(f"{'sync':<26}" + "".join(f"{sync[p]:>10.2f}" for p in PHASES))
    print(f"{f'async, num_workers {args.workers}':<26}" + "".join(f"{asyn[p]:>10.2f}" for p in PHASES))
    print(f"\nreward phase async / sync: {asyn['reward'] / sync['reward']:.2f}; "
          f"epoch async / sync: {asyn['epoch'] / sync['epoch']:.2f}")
    print("(sampling and training do not depend on the reward mode: where they differ, the machine's load moved)")


if __name__ == "__main__":
    main()
