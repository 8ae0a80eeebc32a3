"""How much signal one batch's policy gradient carries, per algorithm and reward.

    python bench/gradient_snr.py [--algorithms grpo-fast nft] [--rewards shapebench_strict jpeg_compressibility]
                                 [--batches 6] [--config examples/shapebench_grpo.yaml] [key=value ...]

For each algorithm (changed from the config as bench/shapebench_compare.py changes it) and
each reward (replacing the config's training rewards), the trainer samples the same epoch's
prompts ``--batches`` times with other noise and takes the gradient of the algorithm's loss
over all trained parameters, as an epoch would, without an optimizer step. Two such
gradients share only what the reward systematically asks for, so the mean cosine ``c``
between them measures the signal: for batches of ``n`` samples whose per-sample gradient has
signal-to-noise ratio ``s2`` (squared norm of the expected gradient over the variance),
``c ~= n s2 / (1 + n s2)``. The table gives ``c`` (± its standard error over pairs; pairs share
gradients, so read it as rough) and, where ``c`` exceeds that error, ``s2`` and ``1 / s2``: the
samples after which a batch gradient is half signal.

What it is for: a batch gradient that is mostly noise shows here in a minute, before a run of
the whole budget. It does not say what the noise does: on ShapeBench awm climbs with a cosine
as low as GRPO's, whose noise drifts the model (docs/DESIGN.md, "Signal and damage", measures
the drift with a reward that ignores the image).
Figures move with the machine's float sums; compare rows of one run.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from flow_factory.config import load_config  # noqa: E402
from flow_factory.trainer import Trainer  # noqa: E402
from flow_factory.seeding import generator  # noqa: E402

# a sibling module: python puts bench/ on sys.path for `python bench/gradient_snr.py`, pytest's
# pythonpath (pyproject.toml) for the tests
from shapebench_compare import ALGORITHMS, CONFIG  # noqa: E402

# rewards by name: the ShapeBench pair from its module, a built-in by its registry name
REWARDS = {
    "shapebench": "flow_factory.shapebench.reward.ShapeBenchReward",
    "shapebench_strict": "flow_factory.shapebench.reward.ShapeBenchStrictReward",
    "jpeg_compressibility": "jpeg_compressibility",
}


def batch_gradient(trainer: Trainer, seed: int) -> tuple[torch.Tensor, float]:
    """Gradient of one epoch-0 batch sampled with ``seed`` (same prompts, other noise); its mean reward."""
    trainer.seed = seed  # the prompt draw was seeded at construction; noise keys read this seed
    rollouts = trainer.sample_epoch(0)
    advantages = trainer.compute_advantages(rollouts, epoch=0)
    algorithm = trainer.algorithm
    trainer.optimizer.zero_grad()
    trainer.adapter.transformer.train()
    units = algorithm.training_units(rollouts.group_ids, advantages)
    for batch in algorithm.micro_batches(rollouts, advantages, units, generator("train", seed, 0)):
        loss, _ = algorithm.loss(trainer.policy, batch)
        loss.backward()
    trainer.adapter.transformer.eval()
    grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in trainer.params])
    reward = sum(r.float().mean().item() for r in rollouts.rewards.values()) / len(rollouts.rewards)
    return grad, reward


def measure(config: Path, algorithm: str, reward: str, batches: int, overrides: list[str]) -> dict:
    entry = f"[{{name: {reward}, reward_model: {REWARDS.get(reward, reward)}}}]"
    cfg = load_config(config, ALGORITHMS[algorithm] + overrides + [
        f"rewards={entry}", "train.max_epochs=1", "eval.eval_freq=0", "log.logging_backend=none",
        "log.save_freq=0", "log.run_name=gradient_snr"])
    trainer = Trainer(cfg)
    start = time.perf_counter()
    grads, rewards = zip(*(batch_gradient(trainer, 1000 + b) for b in range(batches)))
    trainer.close()  # the next cell claims the same run folder
    cos = torch.stack([torch.nn.functional.cosine_similarity(a, b, dim=0)
                       for a, b in itertools.combinations(grads, 2)])
    n = cfg.samples_per_epoch
    c = cos.mean().item()
    s2 = max(c, 1e-12) / (1 - c) / n
    return {"algorithm": algorithm, "reward": reward, "n": n, "cos": c,
            "se": (cos.std() / len(cos) ** 0.5).item() if len(cos) > 1 else float("inf"), "s2": s2, "mean_reward": sum(rewards) / len(rewards),
            "seconds": (time.perf_counter() - start) / batches}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--algorithms", nargs="+", default=["grpo-fast", "nft"], choices=list(ALGORITHMS))
    p.add_argument("--rewards", nargs="+", default=["shapebench_strict", "shapebench", "jpeg_compressibility"],
                   help=f"names in {list(REWARDS)} or any reward_model a config accepts")
    p.add_argument("--batches", type=int, default=6, help="independent batches per cell (>= 2)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides for every cell")
    args = p.parse_args(argv)
    if args.batches < 2:
        p.error("--batches must be at least 2: a cosine needs two gradients")
    rows = []
    for algorithm, reward in itertools.product(args.algorithms, args.rewards):
        rows.append(measure(args.config, algorithm, reward, args.batches, args.overrides))
        r = rows[-1]
        print(f"{algorithm} / {reward}: cos {r['cos']:.3f} +- {r['se']:.3f} ({r['seconds']:.1f} s a batch)",
              flush=True)
    print(f"\nGradient cosine between independent batches ({args.config.name}, {args.batches} batches a cell)")
    print(f"{'algorithm':10s} {'reward':22s} {'n':>5s} {'mean r':>8s} {'cos':>7s} {'+-':>6s} {'s2':>9s} "
          f"{'1/s2':>8s}")
    for r in rows:
        # a cosine within its error of zero measures no signal: no finite sample count to give
        resolved = r["cos"] > r["se"]
        s2 = f"{r['s2']:9.2e}" if resolved else f"{'-':>9s}"
        need = f"{1 / r['s2']:8.0f}" if resolved else f"{'-':>8s}"
        print(f"{r['algorithm']:10s} {r['reward']:22s} {r['n']:5d} {r['mean_reward']:8.4f} {r['cos']:7.3f} "
              f"{r['se']:6.3f} {s2} {need}")


if __name__ == "__main__":
    main()
