"""How fast the shapebench reward scores an image: pixel analysis alone, and the reward call.

    python bench/shapebench_reward_speed.py [N]

Prints milliseconds per 64x64 image (generated scenes, median of 5 passes).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

from flow_factory.shapebench import ShapeBenchReward, detect, generate


def per_image_ms(fn, n: int, passes: int = 5) -> float:
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) / n * 1e3)
    return statistics.median(times)


def main(n: int = 512) -> None:
    samples = generate(n, seed=0)
    images = [s.image for s in samples]
    prompts = [s.prompt for s in samples]
    tensor = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 255
    reward = ShapeBenchReward()
    analysis = per_image_ms(lambda: [detect(im) for im in images], n)
    full = per_image_ms(lambda: reward(prompt=prompts, image=tensor), n)
    print(f"{n} images 64x64: detect {analysis:.3f} ms/image; shapebench reward (parse + detect + judge, "
          f"from a float tensor) {full:.3f} ms/image")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 512)
