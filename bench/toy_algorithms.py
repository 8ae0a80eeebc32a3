"""Side by side on the toy 2-D flow (bench/toy.py): each algorithm's mean reward
before / after 30 epochs (3 seeds) and its seconds per epoch, relative to grpo.

    python bench/toy_algorithms.py
"""

import time

from toy import train_toy

CASES = {"grpo": {"clip_range": 0.2}, "grpo-guard": {"clip_range": 1e-2}, "nft": {}, "awm": {},
         "dpo": {"beta": 200.0, "lr": 1e-2}, "nft (DPM-Solver++2M rollouts)": {"dynamics": "DPM-Solver++2M"}}

rows = []
for label, kwargs in CASES.items():
    algo = label.split(" ")[0]
    start, gains, before, after = time.perf_counter(), [], [], []
    for seed in (0, 1, 2):
        h = train_toy(algo, seed, epochs=30, **kwargs)
        before.append(h[0]), after.append(h[-1])
    per_epoch = (time.perf_counter() - start) / 90
    rows.append((label, sum(before) / 3, sum(after) / 3, per_epoch))
base = rows[0][3]
print(f"{'algorithm':32s} {'reward before':>14s} {'after':>8s} {'s/epoch':>8s} {'x grpo':>7s}")
for label, b, a, t in rows:
    print(f"{label:32s} {b:14.3f} {a:8.3f} {t:8.4f} {t / base:7.2f}")
