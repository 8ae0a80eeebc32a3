"""The GPUs a plan is made for: memory as torch reports it (``total_memory``) and the vendor's dense bf16 peak."""

from __future__ import annotations

from dataclasses import dataclass

UTILISATION = 0.4  # the share of the peak a run's transformer calls are assumed to reach (--utilisation)


@dataclass(frozen=True)
class GPU:
    name: str
    memory: int  # bytes, torch.cuda.get_device_properties(...).total_memory
    bf16_flops: float  # dense bf16 tensor-core peak, FLOP/s (no sparsity)


GPUS = {
    "h100": GPU("H100 80GB SXM", 85_031_714_816, 989e12),
    "h200": GPU("H200 141GB SXM", 150_109_880_320, 989e12),
    "a100-80": GPU("A100 80GB SXM", 85_198_045_184, 312e12),
    "a100-40": GPU("A100 40GB SXM", 42_505_273_344, 312e12),
    "l40s": GPU("L40S 48GB", 47_697_362_944, 362e12),
}
