"""``ff-train --plan``: the plan as text for a person, or as JSON (``--json``) for a script."""

from __future__ import annotations

import dataclasses
import json

from . import memory
from .build import Plan, make_plan
from .fit import cheapest_fit
from .gpus import GPUS
from .roles import phase_passes

GB = 1e9
NOT_COUNTED = ("the CUDA context, NCCL buffers and allocator fragmentation (2 GiB kept free for them)",
               "reward models' activations",
               "autocast's float32 copies of some operators' inputs", "data loading and checkpoint writing",
               "communication time (all-reduce, FSDP gathers)")


# keys whose change leaves the measured calls as they were: only where things are kept changes (a smaller eval
# batch: its calls are measured anew, under keys of their own, the rest kept)
SAME_CALLS = ("config_file", "train.offload_samples_to_cpu", "train.ema_device", "train.ref_param_device",
              "eval.per_device_batch_size")


def plan_for_cli(path: str, overrides: list[str], gpu: str, num_processes: int | None,
                 utilisation: float) -> tuple[Plan, list[str], Plan | None]:
    """The plan of the config, and the cheapest change that makes it fit with the plan it makes."""
    from ..config import load_config

    cfg = load_config(path, overrides)
    plan = make_plan(cfg, gpu, num_processes, utilisation=utilisation)

    def replan(changes: list[str]) -> Plan:
        changed = load_config(path, overrides + changes)
        if all(c.startswith("config_file=") for c in changes):  # the same sizes, split otherwise
            return dataclasses.replace(plan, config=changed, backend=memory.backend_of(changed.config_file))
        same_calls = all(c.split("=")[0] in SAME_CALLS for c in changes)
        return make_plan(changed, gpu, num_processes, utilisation=utilisation,
                         calls=plan.calls if same_calls else None)

    changes, fitted = cheapest_fit(plan, replan)
    return plan, changes, fitted


def as_json(plan: Plan, changes: list[str], fitted: Plan | None) -> dict:
    peak_phase, peak = plan.peak()
    backends = list(dict.fromkeys([plan.backend, *memory.BACKENDS]))
    return {
        "config": {"model": plan.config.model.model_name_or_path, "model_type": plan.config.model.model_type,
                   "source": plan.source, "gpu": plan.gpu, "num_processes": plan.num_processes,
                   "backend": plan.backend, "mixed_precision": plan.precision.mixed_precision},
        "components": plan.components, "trained_params": plan.trained,
        "memory": {b: plan.memory(b) for b in backends},
        "peak": {b: dict(zip(("phase", "bytes"), plan.peak(b))) for b in backends},
        "gpu_memory": GPUS[plan.gpu].memory, "usable": plan.usable,
        "fits": plan.fits(), "peak_phase": peak_phase, "peak_bytes": peak,
        "change": changes if fitted is not None and changes else None,
        "planned_with_change": None if fitted is None or not changes else {
            "peak": dict(zip(("phase", "bytes"), fitted.peak())), "seconds_per_epoch": fitted.seconds_per_epoch},
        "calls": {k: dataclasses.asdict(v) for k, v in plan.calls.items()},
        "flops_per_epoch_per_gpu": plan.flops, "utilisation": plan.utilisation,
        "peak_flops": GPUS[plan.gpu].bf16_flops, "seconds_per_epoch": plan.seconds_per_epoch,
        "eval": eval_json(plan, backends),
        "notes": plan.notes, "not_counted": list(NOT_COUNTED),
    }


def eval_json(plan: Plan, backends: list[str]) -> dict | None:
    """The eval's parts, its phase's bytes per backend, its FLOPs and seconds (None: the run does not evaluate)."""
    ev = plan.evaluation
    if ev is None:
        return None
    return {"eval_freq": ev.eval_freq,
            "parts": [{"dataset": p.dataset, "height": p.call.height, "width": p.call.width,
                       "num_frames": p.call.num_frames, "steps": p.steps, "guidance_scale": p.call.guidance,
                       "rows_per_call": p.call.rows, "prompts_per_gpu": p.prompts,
                       "call": p.call.key, "decode": p.call.decode_key} for p in ev.parts],
            "activations": plan.sizes.eval_activations,
            "bytes": {b: sum(plan.memory(b)["eval"].values()) for b in backends},
            # None where the test prompts are not readable here: its time is not counted
            "flops_per_eval_per_gpu": plan.eval_flops if ev.counted else None,
            "seconds_per_eval": plan.seconds(plan.eval_flops) if ev.counted else None,
            "flops_per_epoch_per_gpu": plan.flops.get("eval")}


def eval_line(plan: Plan) -> list[str]:
    """The report's lines on the eval: each part's size, its phase's peak, its seconds per eval."""
    ev = plan.evaluation
    if ev is None:
        return ["eval: none (eval.eval_freq 0, no reward, or no dataset with a test split)"]
    parts = "; ".join(
        f"{p.dataset}: {p.call.height}x{p.call.width}{f'x{p.call.num_frames}' if p.call.num_frames else ''}, "
        f"{p.steps} steps, guidance {p.call.guidance:g}, {p.call.rows} a call, "
        f"{'test prompts unknown' if p.prompts is None else f'{p.prompts} prompts per GPU'}" for p in ev.parts)
    phase, _ = plan.peak()
    peak = sum(plan.memory()["eval"].values())
    seconds = (f"{plan.seconds(plan.eval_flops):.0f} s per eval, {plan.seconds(plan.flops['eval']):.1f} s per epoch"
               if ev.counted else "its time not counted (test prompts unknown)")
    return [f"eval every {ev.eval_freq} epochs ({parts}): {_gib(peak)} GiB per GPU"
            f"{' (the peak)' if phase == 'eval' else ''}, {_gib(plan.sizes.eval_activations)} of it the eval's "
            f"sampling / decoding activations; {seconds}"]


def _gib(n: float) -> str:
    return f"{n / 2 ** 30:.1f}"


def as_text(plan: Plan, changes: list[str], fitted: Plan | None) -> str:
    cfg, gpu = plan.config, GPUS[plan.gpu]
    lines = [f"plan: {cfg.model.model_name_or_path} ({cfg.model.model_type}, configs from {plan.source}), "
             f"{plan.num_processes} x {gpu.name}, {plan.backend}, {plan.precision.mixed_precision}",
             "", "model                      class                                params     bytes"]
    for name, c in plan.components.items():
        trains = f"   trains {plan.trained[name] / 1e6:.1f} M ({cfg.model.finetune_type})" if name in plan.trained else ""
        lines.append(f"  {name:<24} {c['class'][:36]:<36} {c['params'] / 1e9:6.2f} B {c['bytes'] / GB:6.1f} GB{trains}")
    backends = list(dict.fromkeys([plan.backend, *memory.BACKENDS]))
    lines += ["", "memory per GPU, GiB     " + "".join(f"{b:>14}" for b in backends)]
    tables = {b: plan.memory(b) for b in backends}
    for phase in tables[plan.backend]:
        lines.append(f"  {phase:<22}" + "".join(f"{_gib(sum(tables[b][phase].values())):>14}" for b in backends))
    lines.append(f"  {'fits ' + _gib(plan.usable) + ' usable':<22}" +
                 "".join(f"{'yes' if plan.fits(b) else 'no':>14}" for b in backends))
    phase, peak = plan.peak()
    lines += ["", f"{plan.backend}, {phase} (the peak), GiB per GPU:"]
    lines += [f"  {part:<34} {_gib(size):>8}" for part, size in tables[plan.backend][phase].items() if size]
    if plan.fits():
        lines.append(f"verdict: fits, {_gib(peak)} of {_gib(plan.usable)} GiB usable on a {gpu.name}")
    elif fitted is not None:
        lines.append(f"verdict: does not fit ({_gib(peak)} GiB at {phase}, {_gib(plan.usable)} usable); the cheapest "
                     f"change that fits: {' '.join(changes)} -> {_gib(fitted.peak()[1])} GiB at {fitted.peak()[0]}, "
                     f"{fitted.seconds_per_epoch:.0f} s per epoch")
    elif not changes:
        lines.append(f"verdict: does not fit ({_gib(peak)} GiB at {phase}): every network is loaded whole on each GPU, "
                     "and the prompts cached, before anything is split; a GPU with more memory")
    else:
        lines.append(f"verdict: does not fit ({_gib(peak)} GiB at {phase}), not even with {' '.join(changes)}: "
                     "more GPUs, or a GPU with more memory")
    total = sum(plan.flops.values())
    lines += ["", f"work per GPU per epoch: {total / 1e15:.1f} PFLOP; at {plan.utilisation:.0%} of "
              f"{gpu.bf16_flops / 1e12:.0f} TFLOP/s bf16: {plan.seconds_per_epoch:.0f} s per epoch"]
    for name, flops in plan.flops.items():
        lines.append(f"  {name:<12} {flops / 1e15:10.2f} PFLOP  {flops / total if total else 0:6.1%}")
    calls = plan.calls
    lines.append(f"  one sampling call {calls['rollout'].flops / 1e12:.1f} TFLOP, one training micro-batch "
                 f"{calls['training'].flops / 1e12:.1f} TFLOP (FlopCounterMode on the model's code, meta device; "
                 "each stack of alike blocks run at 2 and 3 blocks and scaled to its depth)")
    passes = phase_passes(cfg)
    if passes:
        lines.append("  an optimizer step's phases, per micro-batch: " + ", ".join(
            f"{role} {calls[f'{role} pass'].flops / 1e12:.1f} TFLOP x {n}" for role, n in passes) +
            " (each pass's calls: the trained role's forward and backward, the teacher's and other roles' forwards)")
    lines += ["", *eval_line(plan)]
    lines += ["", "not counted: " + "; ".join([*plan.notes, *NOT_COUNTED])]
    return "\n".join(lines)


def run(path: str, overrides: list[str], gpu: str, num_processes: int | None, as_json_output: bool,
        utilisation: float) -> int:
    """``ff-train --plan``: print the plan; the exit status is 0 when the config fits, 1 when it does not."""
    plan, changes, fitted = plan_for_cli(path, overrides, gpu, num_processes, utilisation)
    if as_json_output:
        print(json.dumps(as_json(plan, changes, fitted), indent=1))
    else:
        print(as_text(plan, changes, fitted))
    return 0 if plan.fits() else 1
