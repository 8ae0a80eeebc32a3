"""The verdict against the GPU's memory, and the cheapest change that makes an over-budget config fit.

The changes are tried one at a time, cheapest first: those that cost no compute (rollouts in CPU memory,
weight copies in CPU memory), then, where the eval alone is over the GPU, a smaller eval batch (a slower eval,
every ``eval_freq`` epochs), then sharding (communication; ZeRO-2 leaves the weights whole, FSDP2 splits
them), then gradient checkpointing (a second forward in the backward), fewer steps per call, ZeRO-3 and
FSDP2's CPU offload (slow), and last a smaller batch (fewer samples per call: the slowest epoch). When no
single one fits, they are taken together in that order until the config fits (a smaller eval batch only while
the eval is still over). A plan fits when every phase does, the eval's included: a change that lowers training's
memory and leaves the eval over the GPU does not fit.
"""

from __future__ import annotations

from collections.abc import Callable

from .build import Plan


def _candidates(plan: Plan) -> list[str]:
    cfg, train = plan.config, plan.config.train
    experts = len(plan.trained) > 1 or len([c for c in plan.components.values() if c["role"] == "transformer"]) > 1
    out = []
    if not train.offload_samples_to_cpu:
        out.append("train.offload_samples_to_cpu=true")
    if train.ema_decay > 0 and train.ema_device != "cpu":
        out.append("train.ema_device=cpu")
    if train.kl_beta > 0 and cfg.model.finetune_type == "full" and train.ref_param_device != "cpu":
        out.append("train.ref_param_device=cpu")
    if not _eval_fits(plan):
        out += _halved("eval.per_device_batch_size", cfg.eval.per_device_batch_size or train.per_device_batch_size)
    for backend in ("zero2", "fsdp2"):
        if plan.backend not in (backend, "zero3", "fsdp2_offload") and plan.num_processes > 1:
            out.append(f"config_file={backend}")
    if not train.enable_gradient_checkpointing:
        out.append("train.enable_gradient_checkpointing=true")
    if train.steps_per_call != 1:
        out.append("train.steps_per_call=1")
    if plan.backend != "zero3" and not experts and plan.num_processes > 1:
        out.append("config_file=zero3")
    if plan.backend != "fsdp2_offload":
        out.append("config_file=fsdp2_offload")
    return out + _halved("train.per_device_batch_size", train.per_device_batch_size)


def _halved(key: str, batch: int) -> list[str]:
    """``key=batch/2``, ``key=batch/4``, ... down to 1."""
    out = []
    while batch > 1:
        batch //= 2
        out.append(f"{key}={batch}")
    return out


def _eval_fits(plan: Plan) -> bool:
    """Whether the eval's phase fits the GPU (a run without an eval: yes)."""
    phases = plan.memory()
    return "eval" not in phases or sum(phases["eval"].values()) <= plan.usable


def cheapest_fit(plan: Plan, replan: Callable[[list[str]], Plan]) -> tuple[list[str], Plan | None]:
    """(the overrides that make ``plan`` fit, the plan with them); ([], plan) when it fits as it is; (all the
    changes tried, None) when nothing does. ``replan`` plans the config with more ``key=value`` overrides
    (a change of backend alone is arithmetic on ``plan``, not planned again); ([], None) when the networks alone,
    loaded whole on every GPU to cache the prompts, are too large for it, which no change of the list alters."""
    if plan.fits():
        return [], plan
    if sum(plan.memory()["prompt cache"].values()) > plan.usable:  # loading alone: no change of the list helps
        return [], None
    tried = {}

    def planned(changes: list[str]) -> Plan | None:
        key = tuple(changes)
        if key not in tried:
            try:
                tried[key] = replan(changes)
            except ValueError:  # the config refuses this change (a batch the epoch cannot divide)
                tried[key] = None
        return tried[key]

    candidates = _candidates(plan)
    for change in candidates:
        candidate = planned([change])
        if candidate is not None and candidate.fits():
            return [change], candidate
    taken: list[str] = []
    for change in candidates:
        key = change.split("=")[0]
        if key == "eval.per_device_batch_size" and taken and _eval_fits(planned(list(taken)) or plan):
            continue  # the eval fits already: no smaller eval batch than it needs
        if key in ("config_file", "train.per_device_batch_size", "eval.per_device_batch_size"):
            taken = [c for c in taken if not c.startswith(key + "=")]  # the new value replaces the one taken
        taken.append(change)
        candidate = planned(list(taken))
        if candidate is not None and candidate.fits():
            return list(taken), candidate
    return taken, None
