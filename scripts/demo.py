"""`make tiny-demo`: GRPO end to end on CPU, from one YAML, with nothing downloaded.

Builds a tiny SD3 pipeline from config into runs/tiny-sd3 (once), trains it with
examples/demo_tiny_sd3.yaml, and prints the eval reward before and after training.
Extra arguments are config overrides, e.g. `python scripts/demo.py train.max_epochs=4`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from flow_factory.config import load_config
from flow_factory.testing.tiny import build_tiny_pipeline
from flow_factory.trainer import Trainer

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "demo_tiny_sd3.yaml"


def main(overrides: list[str]) -> None:
    cfg = load_config(CONFIG, overrides)
    model_dir = Path(cfg.model.model_name_or_path)
    if not (model_dir / "model_index.json").exists():
        print(f"building a tiny SD3 pipeline from config into {model_dir}")
        build_tiny_pipeline("sd3-5", model_dir)
    start = time.perf_counter()
    trainer = Trainer(cfg)
    trainer.train()
    before, after = trainer.eval_history[0], trainer.eval_history[-1]
    minutes = (time.perf_counter() - start) / 60
    print(f"\ntrained {cfg.train.max_epochs} epochs in {minutes:.1f} min; run folder {trainer.run_dir}")
    for key in before:
        if key.startswith("eval/reward/"):
            name = key.removeprefix("eval/reward/")
            print(f"eval reward {name}: before {before[key]:.4f} -> after {after[key]:.4f} "
                  f"({after[key] - before[key]:+.4f})")


if __name__ == "__main__":
    main(sys.argv[1:])
