"""A transformer call measured on a few of its blocks and scaled to all of them.

A diffusion transformer is mostly stacks of identical blocks (FLUX.1-dev: 19 double-stream and 38
single-stream; Qwen-Image: 60; LTX-2: 48), and the meta device's cost is Python's, per operator: a call
through every block of a 20 B model takes most of a minute's plan. The call is measured with each stack
cut to ``BASE`` blocks, then once more per stack with one more block, and each figure is taken as
affine in the number of blocks: ``figure(N) = figure(BASE) + (N - BASE) * (figure(BASE + 1) - figure(BASE))``.

Why that is exact for FLOPs: the blocks of a group have the same class, the same parameters (names, shapes,
dtypes, trained or not) and the same submodules, and each block maps its inputs to outputs of the same
shapes (the residual stream), so every block of a group does the same operators on the same shapes, in the
forward, the backward and checkpointing's recomputation. The parameters given a gradient are counted the
same way, also exactly: which block is the stack's last stays so (the text branch of FLUX's last
double-stream block feeds no output, in the cut stack as in the whole one).

What it can miss: (1) blocks that differ only by a setting that holds no parameter (a flag given to the
constructor that changes the forward but no weight's shape). On every shipped example (eleven model types) the
scaled FLOPs, peaks and gradients equal the whole call's to the unit (docs/experiments/plan.md,
2026-11-29), and tests/test_plan.py holds them to it on deeper tiny pipelines. (2) The peak is affine in the
block count only where each block adds the same to it wherever it stands: with gradients it does (each
block's saved tensors, or under checkpointing its inputs, stay until the backward reaches it); a no-grad
call's peak is one moment inside some block, which holds nothing of the blocks before it, so adding blocks
adds nothing, and a difference below 0 (a temporary landing elsewhere: 0.5 MiB in Qwen-Image's sampling
call) counts as 0. Where a cut call's peak fell outside the blocks (an output layer larger than anything a
block holds), the difference would understate what blocks add; the base is 2 blocks, not 1, so that the
difference is taken between two calls whose peak lies in the blocks. Blocks that differ from their
stack's others (SD3.5's last block, whose text branch has no output projection; SD3.5-medium's first 13,
with a second attention) form groups of their own, each scaled by its own count; a group of ``BASE + 1``
blocks or fewer stays whole.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

from torch import nn

BASE = 2  # blocks of each group the base call keeps


@dataclass(frozen=True)
class Group:
    """Blocks of one ``ModuleList`` of a network that are alike (same class, parameters and submodules)."""

    network: str
    stack: str  # the ModuleList's attribute on the network
    blocks: tuple[int, ...]  # their places in it


def signature(block: nn.Module) -> tuple:
    """What makes two blocks do the same operators on the same shapes: their submodules' classes and their
    parameters' names, shapes, dtypes and whether they train."""
    return (tuple(type(m).__name__ for m in block.modules()),
            tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in block.named_parameters()))


def repeated_groups(networks: dict[str, nn.Module]) -> list[Group]:
    """The groups of alike blocks worth scaling (more than ``BASE + 1``) in each network's ``ModuleList``
    children."""
    groups = []
    for network, module in networks.items():
        for stack, child in module.named_children():
            if not isinstance(child, nn.ModuleList):
                continue
            alike: dict[tuple, list[int]] = {}
            for i, block in enumerate(child):
                alike.setdefault(signature(block), []).append(i)
            groups += [Group(network, stack, tuple(places)) for places in alike.values() if len(places) > BASE + 1]
    return groups


@contextmanager
def cut(networks: dict[str, nn.Module], groups: list[Group], kept: dict[Group, int]):
    """Each group's stack holding only its first ``kept[group]`` blocks (the blocks of no group all stay),
    in their order; the whole stacks are put back after."""
    stacks = {(g.network, g.stack) for g in groups}
    whole = {key: getattr(networks[key[0]], key[1]) for key in stacks}
    try:
        for network, stack in stacks:
            dropped = {i for g in groups if (g.network, g.stack) == (network, stack) for i in g.blocks[kept[g]:]}
            blocks = whole[(network, stack)]
            setattr(networks[network], stack, nn.ModuleList([b for i, b in enumerate(blocks) if i not in dropped]))
        yield
    finally:
        for (network, stack), blocks in whole.items():
            setattr(networks[network], stack, blocks)


def measure_scaled(measure, networks: dict[str, nn.Module]):
    """``measure()`` (a ``Measured`` of a call through ``networks``) for the whole networks, from calls with
    their stacks cut to ``BASE`` blocks and to one more; the whole call where no stack is deep enough."""
    groups = repeated_groups(networks)
    if not groups:
        return measure()
    start, base = time.perf_counter(), {g: BASE for g in groups}
    with cut(networks, groups, base):
        at_base = measure()
    flops, peak, gradients = at_base.flops, at_base.peak, dict(at_base.gradients)
    for group in groups:
        with cut(networks, groups, {**base, group: BASE + 1}):
            deeper = measure()
        more = len(group.blocks) - BASE
        flops += more * (deeper.flops - at_base.flops)
        # a no-grad call's peak is one moment inside a block that holds nothing of the blocks before it: one block
        # more can move it by a temporary either way (Qwen-Image's sampling call: 0.5 MiB less with 3 blocks than
        # with 2). No block frees what the call held before it, so a fall counts as none
        peak += more * max(0, deeper.peak - at_base.peak)
        for name, count in deeper.gradients.items():
            gradients[name] = gradients.get(name, 0) + more * (count - at_base.gradients.get(name, 0))
    return replace(at_base, flops=flops, peak=peak, gradients=gradients, seconds=time.perf_counter() - start)
