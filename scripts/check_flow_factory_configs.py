"""Which of Flow-Factory's configs load here, and why the others do not.

    python scripts/check_flow_factory_configs.py PATH/TO/Flow-Factory/examples [-v] [--plan [--gpu h100]]

Loads every ``*.yaml`` under the folder with ``ff-train``'s loader (no model, no data
needed) and prints how many load, and the reasons of the others, grouped and counted.
Configs for a model type or trainer this version does not have are counted apart, as
what they wait for. ``-v`` prints each refused file with its errors.

``--plan`` also plans each config that loads, as ``ff-train --plan CONFIG --gpu GPU`` does
(the cheapest change that fits included), and prints a line per config: the seconds the
plan took, its verdict (peak per GPU at its phase, fits or not, the change), or why it
could not be planned (a checkpoint whose configs the planner does not know, ...), then the counts (how many
planned, how many of those do not fit, the median and slowest seconds) and the refusals grouped by reason.
"""

from __future__ import annotations

import argparse
import collections
import re
import time
from pathlib import Path

import yaml

from flow_factory.config import ConfigError, load_config
from flow_factory.config.families import MODEL_TYPE_ALIASES
from flow_factory.config.algorithms import TRAINER_TYPES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--plan", action="store_true", help="also plan each config that loads (ff-train --plan)")
    p.add_argument("--gpu", default="h100", help="--plan: the GPU planned for (ff-train --plan's --gpu)")
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
    if args.plan:
        plan_each(loaded, args.folder, args.gpu)


def verdict(path: Path, gpu: str) -> str:
    """The plan's verdict on one config: its peak per GPU, whether it fits, the cheapest change that fits."""
    from flow_factory.plan.report import plan_for_cli

    plan, changes, fitted = plan_for_cli(str(path), [], gpu, None, 0.4)
    phase, peak = plan.peak()
    model = f"{plan.config.model.model_type}, {plan.num_processes} x {gpu}, {plan.backend}"
    out = f"{model}: {peak / 2 ** 30:.1f} GiB at {phase}, {'fits' if plan.fits() else 'does not fit'}"
    if not plan.fits():
        out += f"; change: {' '.join(changes)}" if fitted is not None else "; no change fits"
    missing = [n for n in plan.notes if "NOT MEASURED" in n]
    return out + (f"; {len(missing)} call(s) NOT MEASURED" if missing else "") + f"; {plan.seconds_per_epoch:.0f} s/epoch"


def refusal(err: Exception) -> str:
    """Why a plan was refused, in one line: the error's first line, a long list of known names dropped."""
    first = str(err).splitlines()[0]
    if len(first) > 160 and " (" in first[:160]:  # "... the planner knows (a, b, c, ...)": the names add nothing here
        first = first[:first.index(" (")]
    return f"{type(err).__name__}: {first[:160]}"


def plan_each(loaded: list[Path], folder: Path, gpu: str) -> None:
    """Plan each config that loaded: a line per config with the plan's time and verdict, then the counts
    and the refusals grouped by reason."""
    counts, seconds, reasons = collections.Counter(), [], collections.Counter()
    print(f"\nplans ({gpu}):")
    for path in loaded:
        start = time.perf_counter()
        try:
            line, kind = verdict(path, gpu), "planned"
        except Exception as err:  # a plan refused (unknown checkpoint, ...) is a finding, not the end of the list
            line, kind = f"not planned: {refusal(err)}", "not planned"
            reasons[re.sub(r"'[^']*'", "...", refusal(err))] += 1  # grouped by reason, the names left out
        took = time.perf_counter() - start
        counts[kind] += 1
        if kind == "planned":
            seconds.append(took)
            counts["does not fit"] += "does not fit" in line
        print(f"  {took:5.1f} s  {path.relative_to(folder)}: {line}", flush=True)
    slowest = f", slowest {max(seconds):.1f} s, median {sorted(seconds)[len(seconds) // 2]:.1f} s" if seconds else ""
    over = sum(s >= 60 for s in seconds)
    print(f"{counts['planned']} planned ({counts['does not fit']} do not fit), {counts['not planned']} not planned"
          f"{slowest}, {over} took a minute or more")
    for reason, n in reasons.most_common():
        print(f"  {n:3d}  {reason}")


if __name__ == "__main__":
    main()
