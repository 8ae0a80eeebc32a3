"""What ``train.rollout_cache`` saves where a rollout's attention is a large part of its cost.

ShapeBench's transformer (4 blocks at 64 px) spends little of an epoch in attention, and there the cache
saved nothing measurable (docs/experiments/shapebench.md, section 13). This bench builds an SD3 transformer
of a chosen width and depth (random weights: the cost of a call does not depend on them), saves it in the
tiny SD3 pipeline and loads that through the real ``load_adapter``, then times ODE rollouts with CFG, the
cache off and on, alternating, in one process on one torch thread (CPU seconds stand for a quiet machine's
wall time). It prints the seconds per rollout of each, their ratio, and how far the cached rollout's final
latent is from the uncached one (relative RMS).

    python bench/rollout_cache_speed.py                       # 512 px, 8 blocks of width 768, 10 steps
    python bench/rollout_cache_speed.py --policy taylorseer --params '{"cache_interval": 2}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch


def build_adapter(folder: str, blocks: int, heads: int, size: int):
    """The tiny SD3 pipeline with a transformer of ``blocks`` joint blocks of ``heads`` x 64, saved and loaded."""
    from diffusers import SD3Transformer2DModel

    from flow_factory.models import load_adapter
    from flow_factory.testing.tiny import tiny_pipeline

    pipe = tiny_pipeline("sd3-5")
    torch.manual_seed(0)
    pipe.transformer = SD3Transformer2DModel(
        sample_size=size // 8, patch_size=2, in_channels=16, num_layers=blocks, attention_head_dim=64,
        num_attention_heads=heads, caption_projection_dim=heads * 64, joint_attention_dim=32,
        pooled_projection_dim=64, out_channels=16, pos_embed_max_size=size // 8)
    pipe.save_pretrained(folder)
    return load_adapter("sd3-5", folder)


def rollout(adapter, cache, noise, cond, sigmas, guidance: float) -> tuple[torch.Tensor, float]:
    """One ODE rollout (the cache's hooks on when ``cache`` is given): its final latent and CPU seconds."""
    from contextlib import nullcontext

    from flow_factory.dynamics.ode import ODE
    from flow_factory.trajectory import sample_trajectory

    start = time.process_time()
    with torch.no_grad(), (cache.applied(adapter) if cache else nullcontext()):
        if cache:
            cache.new_trajectory(adapter)
        final = sample_trajectory(adapter, ODE(), cond, noise, sigmas, guidance).final
    return final, time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=512, help="image side in pixels (default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=8, help="joint transformer blocks (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=12, help="attention heads of 64 (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="rollout steps (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2, help="rollouts of each, alternating (default: %(default)s)")
    parser.add_argument("--policy", default="pyramid", help="train.rollout_cache (default: %(default)s)")
    parser.add_argument("--params", default='{"spatial_attention_block_skip_range": 2}',
                        help="train.rollout_cache_params as JSON (default: %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    from flow_factory.rollout_cache import RolloutCache

    with tempfile.TemporaryDirectory() as folder:
        adapter = build_adapter(folder, args.blocks, args.heads, args.size)
        cache = RolloutCache(args.policy, json.loads(args.params))
        cond = adapter.encode(["a red circle above a blue square"], None, 4.5)
        noise = adapter.initial_noise(1, args.size, args.size, torch.Generator().manual_seed(0))
        sigmas = adapter.sigmas(args.steps, args.size, args.size)
        seconds = {"off": [], "on": []}
        for _ in range(args.repeats):
            plain, t_off = rollout(adapter, None, noise, cond, sigmas, 4.5)
            cached, t_on = rollout(adapter, cache, noise, cond, sigmas, 4.5)
            seconds["off"].append(t_off)
            seconds["on"].append(t_on)
    tokens = (args.size // 16) ** 2
    off, on = statistics.median(seconds["off"]), statistics.median(seconds["on"])
    rms = ((cached - plain).pow(2).mean() / plain.pow(2).mean()).sqrt().item()
    print(f"SD3 transformer: {args.blocks} blocks x {args.heads * 64} wide, {args.size} px ({tokens} image tokens), "
          f"{args.steps} steps with CFG, one thread; {args.policy} {args.params}")
    print(f"CPU s per rollout, median of {args.repeats}: cache off {off:.1f} (each: "
          f"{', '.join(f'{s:.1f}' for s in seconds['off'])}), on {on:.1f} (each: "
          f"{', '.join(f'{s:.1f}' for s in seconds['on'])}); on / off {on / off:.2f}")
    print(f"final latent, cached against uncached: relative RMS difference {rms:.3f}")


if __name__ == "__main__":
    main()
