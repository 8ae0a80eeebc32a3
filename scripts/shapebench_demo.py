"""GRPO on ShapeBench (`make demo`), end to end on CPU, from one YAML, with nothing downloaded.

Trains the committed pretrained ShapeBench pipeline (assets/shapebench/sd3, made by
scripts/pretrain_shapebench.py) with examples/shapebench_grpo.yaml on the verifiable
``shapebench`` rewards, evaluates 256 held-out prompts (fixed seeds) before and after,
and prints one line with the strict and partial accuracy before -> after. The run
folder gets ``reward_curve.png`` (train and eval rewards per epoch) and
``before_after.png`` (the same held-out prompts and seeds, before | after).
Extra arguments are config overrides, e.g. `python scripts/shapebench_demo.py train.max_epochs=10`.
Measured figures: the header of examples/shapebench_grpo.yaml.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from PIL import Image, ImageDraw

from flow_factory.config import load_config
from flow_factory.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "shapebench_grpo.yaml"


def before_after(run_dir: Path, first: int, last: int, algorithm: str) -> Path:
    """The first and last eval grids (same prompts, same seeds) side by side, labelled."""
    a, b = (Image.open(run_dir / "samples" / f"eval_epoch_{e:04d}.png").convert("RGB") for e in (first, last))
    pad, head = 16, 24
    out = Image.new("RGB", (a.width + b.width + pad, max(a.height, b.height) + head), "white")
    out.paste(a, (0, head))
    out.paste(b, (a.width + pad, head))
    draw = ImageDraw.Draw(out)
    draw.text((4, 6), f"before (epoch {first})", fill="black")
    draw.text((a.width + pad + 4, 6), f"after {algorithm} (epoch {last})", fill="black")
    path = run_dir / "before_after.png"
    out.save(path)
    return path


def main(overrides: list[str]) -> None:
    os.chdir(ROOT)  # the config's paths (model, prompts, runs) are relative to the repository
    cfg = load_config(CONFIG, overrides)
    model_dir = ROOT / cfg.model.model_name_or_path
    if not (model_dir / "model_index.json").exists():
        raise SystemExit(f"{model_dir} has no pipeline: it is committed with the repository "
                         f"(re-create it with scripts/pretrain_shapebench.py)")
    start = time.perf_counter()
    trainer = Trainer(cfg)
    trainer.train()
    before, after = trainer.eval_history[0], trainer.eval_history[-1]
    minutes = (time.perf_counter() - start) / 60
    algorithm = cfg.train.trainer_type
    grid = before_after(trainer.run_dir, before["epoch"], after["epoch"], algorithm)
    n = min(cfg.eval.num_samples or len(trainer.test_prompts), len(trainer.test_prompts))
    s0, s1 = before["eval/reward/shapebench_strict"], after["eval/reward/shapebench_strict"]
    p0, p1 = before["eval/reward/shapebench"], after["eval/reward/shapebench"]
    print(f"\nShapeBench held-out ({n} prompts): strict {s0:.3f} -> {s1:.3f} ({s1 - s0:+.3f}), "
          f"partial {p0:.3f} -> {p1:.3f} ({p1 - p0:+.3f}); {algorithm} {cfg.train.max_epochs} epochs in "
          f"{minutes:.1f} min; {trainer.run_dir / 'reward_curve.png'}, {grid}")


if __name__ == "__main__":
    main(sys.argv[1:])
