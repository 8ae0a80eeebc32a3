"""ShapeBench's table per prompt family, from the JSON ff-eval writes (as GenEval reports its tasks).

    ff-eval examples/shapebench_grpo.yaml --checkpoint DIR --out eval.json
    python scripts/shapebench_families.py eval.json

ff-eval knows no benchmark: its JSON lists every sample's prompt and scores. This groups
them by the ShapeBench family of the prompt and prints each reward's mean per family, in
the order of ``FAMILIES``, with the number of samples.
"""

from __future__ import annotations

import argparse
import json
import sys

from flow_factory.shapebench.prompts import FAMILIES, prompt_family


def by_family(samples: list[dict]) -> dict[str, dict[str, float]]:
    """``{family: {reward: mean, "n": count}}`` of ff-eval's samples (``{"prompt": ..., reward: score}``);
    a ValueError names the first prompt that is not ShapeBench's."""
    groups: dict[str, list[dict]] = {}
    for sample in samples:
        family = prompt_family(sample["prompt"])
        if family is None:
            raise ValueError(f"not a ShapeBench prompt: {sample['prompt']!r}")
        groups.setdefault(family, []).append(sample)
    out = {}
    for family in (f for f in FAMILIES if f in groups):
        rows = groups[family]
        rewards = [k for k in rows[0] if k != "prompt"]
        out[family] = {r: sum(s[r] for s in rows) / len(rows) for r in rewards} | {"n": len(rows)}
    return out


def format_family_table(table: dict[str, dict[str, float]]) -> str:
    names = [k for k in next(iter(table.values())) if k != "n"]
    width = max(len("family"), *(len(f) for f in table))
    cols = [max(9, len(n)) for n in names]
    lines = [f"{'family':<{width}}  " + "  ".join(f"{n:>{c}}" for n, c in zip(names, cols)) + f"  {'n':>5}"]
    for family, row in table.items():
        lines.append(f"{family:<{width}}  " + "  ".join(f"{row[n]:>{c}.4f}" for n, c in zip(names, cols))
                     + f"  {row['n']:>5d}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("eval_json", help="the JSON file ff-eval wrote (--out)")
    args = p.parse_args(argv)
    with open(args.eval_json) as f:
        samples = json.load(f)["samples"]
    try:
        table = by_family(samples)
    except ValueError as e:
        print(f"shapebench_families: {args.eval_json}: {e}", file=sys.stderr)
        return 2
    if not table:
        print(f"shapebench_families: {args.eval_json}: no samples", file=sys.stderr)
        return 2
    print(format_family_table(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
