"""Seconds per epoch, by phase, and peak memory, on a tiny SD3 pipeline (CPU, offline); with
``--baseline REV``, the same runs of another git revision of this project side by side.

    python bench/epoch_speed.py [--cases grpo nft] [--repeats 3] [--baseline main]
                                [--set train.steps_per_call=all] [--models all]

The world (fixed; change it only with a new entry in the experiment log): a random-init
SD3 pipeline built from config, float32, LoRA rank 4, 64x64, 10 steps, 16 rollouts an
epoch (4 prompts x group 4), per_device_batch_size 4, 2 optimizer steps an epoch, the
jpeg-compressibility reward, no eval, 5 epochs of which 2-5 are counted. Cases: grpo with
Flow-SDE 0.7 on every step; grpo with a 2-step window; nft and awm on ODE rollouts, with
their default training timesteps.

Each run is a fresh process (so peak RSS is its own); the two revisions alternate run by run
so that a noisy machine slows both alike, and each figure is the median over the repeats.
"startup" is config to a built Trainer; "launch" is the process's launch to its first epoch
(imports, the Trainer, everything before the first epoch: what a user waits for). "Outside model"
is the epoch's time minus the time spent inside the transformer, text encoders, VAE decode,
backward and optimizer step (timed by hooks): the framework's own cost.
``--set`` overrides apply to this checkout only (a key the baseline lacks would not load there).
``--models`` runs the same world on other families' tiny pipelines (video: 32x32, 5 frames; each
family's usual guidance), one table row per family, to show a family whose adapter adds overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ("grpo", "grpo-window2", "nft", "awm")
EPOCHS = 5
# tiny pipeline (flow_factory.testing) -> (model_type, resolution, num_frames, guidance_scale);
# sd3-5's row is the fixed world above
FAMILIES = {"sd3-5": ("sd3-5", 64, None, 4.5), "flux1": ("flux1", 64, None, 3.5),
            "wan2_t2v": ("wan2_t2v", 32, 5, 5.0), "wan2.2-a14b": ("wan2_t2v", 32, 5, 4.0),
            "wan2.2-ti2v-5b": ("wan2_t2v", 32, 5, 5.0), "qwen-image": ("qwen-image", 64, None, 4.0),
            "z-image": ("z-image", 64, None, 0.0), "flux2": ("flux2", 64, None, 4.0),
            "flux2-klein": ("flux2-klein", 64, None, 1.0), "hunyuanvideo15": ("hunyuanvideo15", 32, 5, 6.0),
            "ltx2_t2av": ("ltx2_t2av", 32, 9, 4.0)}


def case_config(case: str, tmp: Path, model: Path, family: str = "sd3-5") -> dict:
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    (data / "train.txt").write_text("\n".join(f"prompt number {i}: a red circle" for i in range(16)) + "\n")
    model_type, resolution, frames, guidance = FAMILIES[family]
    train = {"resolution": resolution, "num_inference_steps": 10, "guidance_scale": guidance, "per_device_batch_size": 4,
             "group_size": 4, "unique_sample_num_per_epoch": 4, "gradient_step_per_epoch": 2,
             "max_epochs": EPOCHS, "ema_decay": 0.0, **({"num_frames": frames} if frames else {})}
    scheduler = {"dynamics_type": "ODE"}
    if case.startswith("grpo"):
        train["trainer_type"] = "grpo"
        scheduler = {"dynamics_type": "Flow-SDE", "noise_level": 0.7}
        if case == "grpo":
            scheduler.update(sde_steps=list(range(10)), num_sde_steps=None)
        else:
            scheduler.update(num_sde_steps=2)
    else:
        train["trainer_type"] = case
    return {
        "seed": 0,
        "data": {"dataset_dir": str(data)},
        "model": {"model_name_or_path": str(model), "model_type": model_type,
                  "lora_rank": 4, "lora_alpha": 4},
        "scheduler": scheduler,
        "train": train,
        "eval": {"eval_freq": 0},
        "log": {"run_name": "speed", "save_dir": str(tmp / "saves"), "logging_backend": "none", "save_freq": 0},
        "rewards": [{"reward_model": "jpeg_compressibility"}],
    }


def apply_overrides(config: dict, overrides: list[str]) -> dict:
    for item in overrides:
        key, _, raw = item.partition("=")
        section, _, name = key.partition(".")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        config.setdefault(section, {})[name] = value
    return config


def run_one(case: str, model: Path, family: str, overrides: list[str], launched_at: float) -> dict:
    """One training run in this process (whichever flow_factory is importable); returns its figures.
    ``launched_at``: the wall-clock time the parent started this process."""
    import torch

    from flow_factory.config import parse_config
    from flow_factory.trainer import Trainer
    from model_clock import ModelClock  # bench/, this script's folder

    torch.set_num_threads(1)  # the same on every machine, and two runs never fight for cores
    clock = ModelClock()

    with tempfile.TemporaryDirectory() as tmp:
        config = apply_overrides(case_config(case, Path(tmp), model, family), overrides)
        start = time.perf_counter()
        trainer = Trainer(parse_config(config))
        startup = time.perf_counter() - start
        clock.watch_trainer(trainer)
        per_epoch_inside = []
        original = trainer.sample_epoch

        def sample_epoch(epoch):  # model time per epoch: the hook totals at each epoch's start
            if not per_epoch_inside:
                first_epoch_at.append(time.time())
            per_epoch_inside.append(clock.total())
            return original(epoch)
        first_epoch_at = []
        trainer.sample_epoch = sample_epoch
        history = trainer.train()
    per_epoch_inside.append(clock.total())
    model_time = [b - a for a, b in zip(per_epoch_inside, per_epoch_inside[1:])]
    counted = history[1:]
    phases = {p: statistics.mean(r[f"time/{p}"] for r in counted)
              for p in ("sampling", "decode", "reward", "training", "other")}
    epoch = statistics.mean(r["time/epoch"] for r in counted)
    return {"epoch": epoch, "first_epoch": history[0]["time/epoch"], "startup": startup,
            "launch": first_epoch_at[0] - launched_at, **phases,
            "outside_model": epoch - statistics.mean(model_time[1:]),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def checkout(rev: str, where: Path) -> Path:
    """The tree of ``rev`` in ``where`` (git archive: no worktree left behind)."""
    where.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def spawn(src: Path, case: str, model: Path, family: str, overrides: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, "--child", case, "--model", str(model), "--family", family,
           "--launched-at", repr(time.time()), *sum([["--set", o] for o in overrides], [])]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{family} {case} with {src} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case per revision")
    parser.add_argument("--baseline", metavar="REV", help="a git revision to run side by side (e.g. main, HEAD~3)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="config override for this checkout's runs (JSON values)")
    parser.add_argument("--models", nargs="+", default=["sd3-5"], metavar="FAMILY",
                        help=f"tiny families to run: {', '.join(FAMILIES)}, or all")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--family", default="sd3-5", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--launched-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child, Path(args.model), args.family, args.set, args.launched_at)))
        return
    families = list(FAMILIES) if args.models == ["all"] else args.models
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"--models: {', '.join(unknown)} unknown; expected {', '.join(FAMILIES)} or all")

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sys.path.insert(0, str(ROOT / "src"))
        from flow_factory.testing import build_tiny_pipeline
        models = {family: build_tiny_pipeline(family, tmp / family) for family in families}
        sides = {"this": ROOT / "src"}
        if args.baseline:
            sides[args.baseline] = checkout(args.baseline, tmp / "baseline") / "src"
        rows = [(family, case) for family in families for case in args.cases]
        results = {(row, side): [] for row in rows for side in sides}
        for r in range(args.repeats):
            for family, case in rows:
                for side, src in (sides.items() if r % 2 == 0 else reversed(sides.items())):
                    overrides = args.set if side == "this" else []
                    runs = results[(family, case), side]
                    runs.append(spawn(src, case, models[family], family, overrides))
                    print(f"  repeat {r + 1}/{args.repeats} {family:<15} {case:<13} {side:<10} "
                          f"{runs[-1]['epoch']:.3f} s/epoch", file=sys.stderr, flush=True)

    def median(row, side, key):
        return statistics.median(run[key] for run in results[row, side])

    print(f"tiny {', '.join(families)}; {EPOCHS} epochs (2-{EPOCHS} counted), median of {args.repeats} runs, "
          "one thread" + (f"; overrides on this checkout: {' '.join(args.set)}" if args.set else ""))
    cols = ["epoch", "sampling", "training", "other", "first_epoch", "startup", "launch", "outside_model",
            "peak_rss_mb"]
    print(f"{'family':<16}{'case':<14}{'revision':<12}" + "".join(f"{c:>14}" for c in cols))
    for row in rows:
        for side in sides:
            print(f"{row[0]:<16}{row[1]:<14}{side:<12}" + "".join(f"{median(row, side, c):>14.3f}" for c in cols))
        epoch = median(row, "this", "epoch")
        print(f"{'':<42}outside model {median(row, 'this', 'outside_model') / epoch:.1%} of the epoch; "
              f"first epoch {median(row, 'this', 'first_epoch') / epoch:.2f}x the others")
        if args.baseline:
            ratio = epoch / median(row, args.baseline, "epoch")
            rss = median(row, "this", "peak_rss_mb") / median(row, args.baseline, "peak_rss_mb")
            launch = median(row, "this", "launch") / median(row, args.baseline, "launch")
            print(f"{'':<42}this / {args.baseline}: epoch {ratio:.2f}x, peak RSS {rss:.2f}x, "
                  f"launch to first epoch {launch:.2f}x")
    if len(families) > 1:
        print("\nframework overhead per epoch (time outside model compute), by family:")
        print(f"{'family':<16}{'case':<14}{'epoch s':>10}{'outside s':>11}{'outside %':>11}")
        for row in rows:
            epoch, outside = median(row, "this", "epoch"), median(row, "this", "outside_model")
            print(f"{row[0]:<16}{row[1]:<14}{epoch:>10.3f}{outside:>11.3f}{outside / epoch:>11.1%}")
    print(f"took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
