"""``ff-eval CONFIG.yaml [--checkpoint DIR] [--out eval.json] [--grid grid.png] [section.key=value ...]``.

The ``section.key=value`` overrides may stand anywhere after the config, before or after the flags, as ff-train's.

Every eval reward of the config (``eval_rewards``, else ``rewards``) over its test
prompts (the test split of ``data.dataset_dir``, or of each evaluated dataset of ``data.datasets``;
``eval.num_samples`` of them split evenly over the datasets), sampled with the eval settings (ODE, ``eval.resolution``, ``eval.num_inference_steps``,
``eval.guidance_scale`` and ``guidance_scale_2``, or a dataset's own ``eval_num_inference_steps``,
``eval_guidance_scale`` and ``eval_resolution``, noise seeded by ``eval.seed``) through the same components as
the Trainer's eval, so the numbers match a run's ``eval/reward/*`` at that checkpoint.
Prints a table (reward, mean, std, min, max, n) and writes it as JSON with each
sample's prompt and scores, from which a benchmark can make its own tables (the
repository's scripts/shapebench_families.py: ShapeBench's per family); ``--grid`` also
saves a sample grid PNG.

On several processes (``accelerate launch --num_processes N -m flow_factory.evaluate ...``) each
samples its contiguous share of the prompts (``data.share_slice``, the Trainer's eval's rule) and the
table and JSON hold every prompt once, as one process's do; the grid shows 16 samples split evenly over the
evaluated datasets (each at least one), gathered from every process.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from . import own_process
from .config import load_config_for_cli


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ff-eval", description=__doc__.split("\n")[0])
    p.add_argument("config", help="the run's YAML file")
    p.add_argument("overrides", nargs="*", help="section.key=value, value parsed as YAML")
    p.add_argument("--checkpoint", help="an ff-train checkpoint folder (LoRA or full transformer)")
    p.add_argument("--out", help="JSON path (default: eval.json in the checkpoint folder, else the run folder)")
    p.add_argument("--grid", help="also save a grid of 16 samples, each evaluated dataset's first ones, to this PNG "
                   "(for a video model an mp4, or a GIF when the path ends in .gif)")
    return p.parse_intermixed_args(argv)  # overrides may follow the flags, as ff-train's


def summarise(scores: dict) -> dict[str, dict[str, float]]:
    return {name: {"mean": s.mean().item(), "std": s.std(unbiased=False).item(), "min": s.min().item(),
                   "max": s.max().item(), "n": int(s.numel())} for name, s in scores.items()}


def format_table(summary: dict[str, dict[str, float]]) -> str:
    width = max(len("reward"), *(len(k) for k in summary))
    lines = [f"{'reward':<{width}}  {'mean':>9}  {'std':>9}  {'min':>9}  {'max':>9}  {'n':>5}"]
    for name, s in summary.items():
        lines.append(f"{name:<{width}}  {s['mean']:>9.4f}  {s['std']:>9.4f}  {s['min']:>9.4f}  "
                     f"{s['max']:>9.4f}  {s['n']:>5d}")
    return "\n".join(lines)


def evaluate_config(cfg, checkpoint=None):
    """(summary over every test prompt, this process's rollouts of each part: ``eval_sampling.eval_parts``, each test
    prompt's dataset) of ``cfg``'s eval rewards on its test prompts, each dataset's sampled at its own eval steps,
    guidance and resolution; on several processes each samples its share of each part (``data.share_slice``)."""
    import torch
    from accelerate import Accelerator

    from .checkpoint import load_for_sampling
    from .data import share_slice
    from .models import get_adapter_class
    from .precision import Precision, avoid_cudnn_attention, run_mixed_precision
    from .prompt_cache import ConditionCache, PromptCache
    from .rewards import RewardSet
    from .eval_sampling import eval_items, eval_parts, eval_sizes, sample_eval
    from .sampling import load_split
    from .sharding import accelerator_kwargs

    own_process.imports_done()

    # this process's rank and device; made before the rewards, whose default one would not join the other
    # processes of a launch on CPU. The run's precision (mixed_precision), so the numbers are the run's eval's
    mixed_precision = run_mixed_precision(cfg.mixed_precision)
    acc = Accelerator(mixed_precision=mixed_precision, **accelerator_kwargs(not torch.cuda.is_available()))
    precision = Precision.of(mixed_precision, acc.device)
    if acc.device.type == "cuda":
        avoid_cudnn_attention()  # as the run's eval
    ev = cfg.eval
    adapter_cls = get_adapter_class(cfg.model.model_type)
    items = load_split(cfg, "test", adapter_cls)  # as the Trainer's eval: the same checks and size
    sizes = eval_sizes(cfg, items, adapter_cls)  # each dataset's
    items = eval_items(items, ev.num_samples)
    rewards = RewardSet.from_configs(cfg.eval_rewards or cfg.rewards, accelerator=acc)
    from .models.preflight import check_experts, check_reward_inputs

    check_reward_inputs(rewards, cfg.model.model_type, "eval_rewards" if cfg.eval_rewards else "rewards")

    adapter = load_for_sampling(cfg.model.model_type, cfg.model.model_name_or_path, checkpoint, acc.device,
                                precision.load)
    check_experts(adapter.experts(adapter.pipeline.config), cfg, cfg.model.model_name_or_path)
    adapter.guidance_scale_2 = ev.guidance_scale_2
    if ev.strength is not None:  # video-to-video
        adapter.strength = ev.strength
    if cfg.scheduler.flow_shift is not None:  # the schedule the run trained and evaluated on
        adapter.set_flow_shift(cfg.scheduler.flow_shift)
    # the run's prompt cache where it exists (the same embeddings its evaluation used); else encode
    cache = PromptCache.open(adapter, cfg.data.cache_dir) if cfg.data.enable_preprocess else None
    conditions = (ConditionCache.open(adapter, cfg.data.cache_dir) if cfg.data.enable_preprocess and
                  adapter.condition_inputs else None)
    scores, parts = sample_eval(adapter, items, eval_parts(cfg, items, sizes),
                                lambda n: share_slice(n, acc.process_index, acc.num_processes), reward_set=rewards,
                                prompt_cache=cache, condition_cache=conditions, autocast=precision.autocast)
    # a reward routed to some datasets scored only their prompts (NaN for the others): its summary is theirs
    datasets = [it.dataset for it in items]
    scores = {k: v[rewards.scored_mask(k, datasets, len(v))] for k, v in scores.items()}
    return summarise(scores), parts, datasets


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = load_config_for_cli("ff-eval", args.config, args.overrides)
    if cfg is None:
        return 2
    if args.checkpoint and not Path(args.checkpoint).is_dir():
        print(f"ff-eval: --checkpoint {args.checkpoint}: no such folder", file=sys.stderr)
        return 2
    if not (cfg.eval_rewards or cfg.rewards):  # a distillation run may train on none
        print(f"ff-eval: {args.config} names no eval_rewards (nor rewards): nothing to score the samples with; add "
              "eval_rewards: [{reward_model: ...}], or sample them with ff-sample", file=sys.stderr)
        return 2
    from .checkpoint import CheckpointError
    from .data import PromptFileError
    from .guards import NonFiniteError

    try:
        summary, parts, datasets = evaluate_config(cfg, args.checkpoint)
    except (CheckpointError, NonFiniteError, FileNotFoundError, PromptFileError) as e:
        print(f"ff-eval: {e}", file=sys.stderr)
        return 2
    from accelerate import PartialState
    from accelerate.utils import gather_object

    from .eval_sampling import grid_samples

    # every process's samples, in prompt order (shares may differ in size); the main process writes them
    # a reward routed to other datasets did not score a sample (NaN): the sample has no entry for it
    samples = [sample for rollouts in parts  # part by part: each gathered in prompt order
               for sample in gather_object([{"prompt": p, **{k: v[i].item() for k, v in rollouts.rewards.items()
                                                             if not math.isnan(v[i].item())}}
                                            for i, p in enumerate(rollouts.prompts)])]
    shown = grid_samples(parts, datasets) if args.grid else []  # each dataset's, from every process
    if not PartialState().is_main_process:
        return 0
    print(format_table(summary))
    default_dir = Path(args.checkpoint) if args.checkpoint else Path(cfg.log.save_dir) / cfg.log.run_name
    out = Path(args.out) if args.out else default_dir / "eval.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": str(args.config), "checkpoint": args.checkpoint,
                               "model": cfg.model.model_name_or_path, "rewards": summary, "samples": samples},
                              indent=1))
    if args.grid:
        from .media import VIDEO_FORMATS, VIDEO_FPS, eval_grid, save_grid
        from .models import get_adapter_class

        # a video grid: the format --grid's suffix names, else the config's log.video_format
        named = Path(args.grid).suffix.lstrip(".")
        save_grid(eval_grid(shown), args.grid, named if named in VIDEO_FORMATS else cfg.log.video_format,
                  getattr(get_adapter_class(cfg.model.model_type), "frame_rate", VIDEO_FPS))
    print(f"ff-eval: wrote {out}")
    return 0


def cli() -> int:
    """The ``ff-eval`` command: ``main`` in a process of its own (``own_process``)."""
    own_process.start()
    return main()


if __name__ == "__main__":
    sys.exit(cli())
