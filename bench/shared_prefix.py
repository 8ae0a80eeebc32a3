"""What integrating a group's shared prefix once saves: one GRPO epoch's sampling, side by side.

    python bench/shared_prefix.py [--model assets/shapebench/sd3] [--prompts 16] [--group 8] [--repeats 2]

With ``same_latent`` a group's samples share their starting noise and prompt, so they are
one trajectory until the window's stochastic step k; ``sample_trajectory`` with
``TrajectoryOptions(shared_rows=...)`` integrates those k steps once per group. For each k of a window (default steps 0-4 of 10,
the demo's window on the first ShapeBench model) this samples the demo's epoch (prompts x
group, cfg 2) with and without it, interleaved, and prints seconds and the ratio; the mean
over k is what a random window saves. The demo now noises step 0 only, where there is no
prefix to share.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from flow_factory.dynamics import make_dynamics  # noqa: E402
from flow_factory.models import load_adapter  # noqa: E402
from flow_factory.trajectory import TrajectoryOptions, sample_trajectory  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ROOT / "assets" / "shapebench" / "sd3"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--window", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    adapter = load_adapter("sd3-5", args.model)
    lines = (ROOT / "examples" / "data" / "shapebench_prompts" / "train.txt").read_text().splitlines()
    prompts = [line for line in lines if line.strip()][:args.prompts]
    groups = torch.arange(args.prompts).repeat_interleave(args.group)
    cond = adapter.encode([prompts[g] for g in groups.tolist()], None, 2.0)
    noise = adapter.initial_noise(args.prompts, 64, 64, torch.Generator().manual_seed(0))[groups]
    sigmas = adapter.sigmas(args.steps, 64, 64)
    dynamics = make_dynamics("Flow-SDE", 0.7)

    def seconds(k: int, shared) -> float:
        start = time.perf_counter()
        sample_trajectory(adapter, dynamics, cond, noise, sigmas, 2.0, generator=torch.Generator().manual_seed(1),
                          options=TrajectoryOptions(sde_steps=[k], shared_rows=shared))
        return time.perf_counter() - start

    seconds(0, None)  # warm-up
    print(f"{args.prompts} prompts x {args.group}, {args.steps} steps, cfg 2, {args.threads} threads")
    print(f"{'k':>3} {'every row s':>12} {'shared s':>9} {'ratio':>6}")
    ratios = []
    for k in args.window:
        alone, shared = [], []
        for _ in range(args.repeats):
            alone.append(seconds(k, None))
            shared.append(seconds(k, groups))
        a, s = statistics.median(alone), statistics.median(shared)
        ratios.append(s / a)
        print(f"{k:>3} {a:>12.2f} {s:>9.2f} {s / a:>6.2f}")
    print(f"mean ratio over the window: {statistics.mean(ratios):.2f} "
          f"(expected from counting rows: {statistics.mean([1 - k / args.steps * (1 - 1 / args.group) for k in args.window]):.2f})")


if __name__ == "__main__":
    main()
