"""Which of Flow-Factory's configs load here, and why the others do not.

    python scripts/check_flow_factory_configs.py PATH/TO/Flow-Factory/examples [-v]

Loads every ``*.yaml`` under the folder with ``ff-train``'s loader (no model, no data
needed) and prints how many load, and the reasons of the others, grouped and counted.
Configs for a model type or trainer this version does not have are counted apart, as
what they wait for. ``-v`` prints each refused file with its errors.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import yaml

from flow_factory.config import ConfigError, load_config
from flow_factory.config.families import MODEL_TYPE_ALIASES
from flow_factory.config.train import TRAINER_TYPES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args()
    loaded, refused, waiting = [], [], collections.Counter()
    reasons = collections.Counter()
    for path in sorted(args.folder.rglob("*.yaml")):
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError:
            raw = {}
        model = str((raw.get("model") or {}).get("model_type", ""))
        trainer = str((raw.get("train") or {}).get("trainer_type", "grpo"))
        known_model = model.lower().replace("_", "-").replace(".", "-") in {
            k.lower().replace("_", "-").replace(".", "-") for k in MODEL_TYPE_ALIASES}
        if not known_model or trainer not in TRAINER_TYPES:
            waiting[f"model_type {model}" if not known_model else f"trainer_type {trainer}"] += 1
            continue
        try:
            load_config(path)
            loaded.append(path)
        except ConfigError as err:
            refused.append((path, str(err)))
            for problem in err.problems:  # each starts with its key; YAML errors with where they are
                key, _, why = problem.partition(": ")
                line = why if key.startswith(str(path)) else f"{key}: {why}"
                reasons[line.split(";")[0][:110]] += 1
    total = len(loaded) + len(refused)
    print(f"{total} configs for this version's model types and trainers: {len(loaded)} load, {len(refused)} refused")
    for key, n in reasons.most_common():
        print(f"  {n:3d}  {key}")
    print(f"{sum(waiting.values())} wait for model types or trainers not in this version:")
    for key, n in waiting.most_common():
        print(f"  {n:3d}  {key}")
    if args.verbose:
        for path, err in refused:
            print(f"\n== {path}\n{err}")


if __name__ == "__main__":
    main()
