"""What a loss needs from the other training processes: its place among them, the batch of all
of them (CRD's centering), and sums over all of them (DGPO's group preference). Plain
``torch.distributed`` calls, and the identity in a single process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes; (0, 1) in a single process."""
    return (dist.get_rank(), dist.get_world_size()) if distributed() else (0, 1)


def gather(t: Tensor) -> Tensor:
    """``t`` (detached) of every process, concatenated in rank order."""
    if not distributed():
        return t.detach()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.detach().contiguous())
    return torch.cat(parts)


def sum_over_processes(t: Tensor) -> Tensor:
    """The element-wise sum of ``t`` (detached) over every process."""
    if not distributed():
        return t.detach()
    total = t.detach().clone()
    dist.all_reduce(total)
    return total
