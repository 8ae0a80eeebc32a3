"""The first GPU's check: the GPU path in one command, one table, under 8 minutes on one 80 GB GPU.

    python bench/gpu_check.py                 # on the GPU (make gpu-check)
    python bench/gpu_check.py --device cpu    # the parts a CPU can run, in bf16 (FF_CPU_MIXED_PRECISION)

Three parts, each in its own time budget; what fails is a row with its error, and the rest goes on:

- ``tests``: the precision-sensitive tests (on-policy ratio, the pipelines' equality, exact resume, the
  non-finite guard, fp16's scaler) with ``FF_TEST_DEVICE`` set to the device: on a GPU they run there, in
  bf16 (on CPU in float32; ``FF_TEST_PRECISION=bf16`` for bf16 there).
- ``families``: every tiny model family x {grpo, nft}, 2 epochs through ``ff-train`` in bf16 autocast
  with the default fp16 trajectories, rollouts offloaded to CPU and the text encoders off the device.
- ``flux``: a randomly initialised transformer of FLUX.1-dev's size (no weights) at 1024 px: seconds
  per optimizer step and peak memory of LoRA training through the trainer's own rollout and optimisation
  loop, with ``steps_per_call``, the attention backend, ``torch_compile`` and gradient checkpointing
  each changed alone (cuDNN's attention last: a CUDA fault it causes ends the process's GPU use). Then
  full fine-tuning under ``fsdp2`` on one GPU, through ``ff-train`` in a process of its own (also alone:
  ``--parts fsdp2``), on a FLUX.1-dev width with 2 + 4 blocks: the full-size model's fp32 weights,
  gradients and AdamW moments, 190 GB, fit no single GPU. On CPU the same code runs on the tiny FLUX
  at 64 px.

The table is printed and appended, dated, to ``docs/experiments/gpu.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny runs' configs (helpers_runs.py), as the tests write them

ARGS = argparse.Namespace()
ROWS: list[dict] = []


def row(part: str, case: str, ok: bool | None, seconds: float | None = None, peak_gib: float | None = None,
        note: str = "") -> None:
    ROWS.append({"part": part, "case": case, "result": {True: "pass", False: "FAIL", None: "skipped"}[ok],
                 "seconds": seconds, "peak_gib": peak_gib, "note": note})
    shown = f"{seconds:.1f} s" if seconds is not None else ""
    print(f"[gpu-check] {part:8s} {case:42s} {ROWS[-1]['result']:7s} {shown:>9s} {note}", flush=True)


def error_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ").replace("|", "/")
    return text[:300]


# ---------------------------------------------------------------- tests
TESTS = ["tests/test_on_policy.py::test_on_policy_ratio_is_one",
         "tests/test_adapters.py::test_ode_rollout_reproduces_the_pipeline",
         "tests/test_run_safety.py::test_a_non_finite_gradient_skips_that_step",
         "tests/test_run_safety.py::test_a_non_finite_reward_skips_the_epoch_and_never_reaches_the_weights",
         "tests/test_train_cli.py::test_resume_matches_an_uninterrupted_run",
         "tests/test_mixed_precision.py"]


def part_tests(budget: float) -> None:
    env = {**os.environ, "FF_TEST_DEVICE": ARGS.device, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    workers = ["-n", str(ARGS.test_workers)] if ARGS.test_workers > 1 else []
    start = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", *TESTS, "-p", "no:cacheprovider", "-p", "no:benchmark",
                              "-W", "ignore", "--tb=line", "-rf", *workers],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget)
        text = out.stdout + out.stderr
        summary = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
        failed = [line.removeprefix("FAILED tests/")[:200] for line in text.splitlines() if line.startswith("FAILED")]
        row("tests", f"{len(TESTS)} test groups on {ARGS.device}", out.returncode == 0,
            time.perf_counter() - start, note=(summary[-1].strip("= ") if summary else text[-300:]) +
            (f"; failed: {', '.join(failed)}" if failed else ""))
        if out.returncode:
            print(text[-4000:], flush=True)
    except subprocess.TimeoutExpired:
        row("tests", f"{len(TESTS)} test groups on {ARGS.device}", False, budget, note="over its time budget")


# ---------------------------------------------------------------- families
def part_families(budget: float, work: Path) -> None:
    from helpers_runs import CONDITIONED_MODELS, OWN_FILE_CONDITIONED_MODELS, TINY_MODELS, tiny_run_config, write_config

    from flow_factory.testing import build_tiny_pipeline
    from flow_factory.train import main as ff_train

    deadline = time.perf_counter() + budget
    families = [*TINY_MODELS, *CONDITIONED_MODELS, *OWN_FILE_CONDITIONED_MODELS]
    for family in families:
        for trainer_type in ("grpo", "nft"):
            case = f"{family} {trainer_type}"
            if time.perf_counter() > deadline:
                row("families", case, None, note="not run: the part's time budget is spent")
                continue
            if family == "wan2_v2v" and not _has_module("av"):
                row("families", case, None, note="reads its condition videos with PyAV (av), not installed here")
                continue
            start = time.perf_counter()
            try:
                pipe = work / "pipes" / family
                if not (pipe / "model_index.json").exists():
                    build_tiny_pipeline(family, pipe)
                tmp = work / "runs" / case.replace(" ", "-")
                tmp.mkdir(parents=True)
                extra = {} if trainer_type == "grpo" else {"num_train_timesteps": 1}
                config = tiny_run_config(tmp, family, pipe, trainer_type=trainer_type, max_epochs=2,
                                         offload_samples_to_cpu=True, **extra)
                if trainer_type == "nft":
                    config["scheduler"] = {"dynamics_type": "ODE", "noise_level": 0.0}
                    config["train"].pop("clip_range")
                config["mixed_precision"] = "bf16"
                config["data"]["text_encoders_after_preprocess"] = "cpu"
                config["log"].update(verbose=False, video_format="gif")
                rc = ff_train([str(write_config(tmp, config))])
                history = json.loads((tmp / "saves" / "run" / "history.json").read_text())["train"]
                last = history[-1]
                finite = all(v == v and abs(v) != float("inf") for v in last.values() if isinstance(v, float))
                saved = (tmp / "saves" / "run" / "checkpoints" / "epoch_2" / "pytorch_lora_weights.safetensors")
                ratio = last.get("train/ratio_mean")
                note = f"ratio {ratio:.6f}; " if ratio is not None else ""
                note += f"loss {last.get('train/loss', float('nan')):.4g}"
                if "memory/peak_allocated_gib" in last:
                    note += f"; peak {last['memory/peak_allocated_gib']:.2f} GiB"
                skipped = sum(r.get("train/skipped_updates", 0) for r in history)
                if skipped:
                    note += f"; {skipped} optimizer steps skipped for non-finite gradients"
                ok = rc == 0 and finite and not skipped and saved.exists() and (ratio is None or abs(ratio - 1) < 1e-6)
                row("families", case, ok, time.perf_counter() - start, note=note)
            except BaseException as exc:  # noqa: BLE001 - one failure is a row, not the end of the check
                if isinstance(exc, KeyboardInterrupt):
                    raise
                row("families", case, False, time.perf_counter() - start, note=error_line(exc))
                traceback.print_exc()


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# ---------------------------------------------------------------- flux
# FLUX.1-dev's transformer (black-forest-labs/FLUX.1-dev, transformer/config.json)
FLUX_DEV = dict(patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=[16, 56, 56])


def flux_size_adapter(work: Path, device: str, dtype, layers: tuple[int, int] | None, tiny: bool):
    """The tiny FLUX pipeline (its text encoders and VAE) around a random transformer of FLUX.1-dev's size
    (``layers``: (double, single) blocks instead of 19 and 38), its text dimensions the tiny encoders'."""
    import torch
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from flow_factory.models.flux import FluxAdapter
    from flow_factory.testing import build_tiny_pipeline

    pipe_dir = work / "pipes" / "flux1"
    if not (pipe_dir / "model_index.json").exists():
        build_tiny_pipeline("flux1", pipe_dir)
    pipe = FluxPipeline.from_pretrained(pipe_dir, dtype=dtype)
    config = {**FLUX_DEV, "joint_attention_dim": pipe.text_encoder_2.config.d_model,
              "pooled_projection_dim": pipe.text_encoder.config.projection_dim}
    if layers is not None:
        config.update(num_layers=layers[0], num_single_layers=layers[1])
    if tiny:  # the same code on the tiny transformer
        config = dict(pipe.transformer.config)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: FLUX.1-dev in float32 first would take 48 GB
    try:
        with torch.device(device):
            transformer = FluxTransformer2DModel.from_config(config).to(dtype)
    finally:
        torch.set_default_dtype(default)
    pipe.transformer = transformer
    return FluxAdapter(pipe, device, dtype), config


def part_flux(budget: float, work: Path) -> None:
    import torch
    from accelerate import Accelerator

    from flow_factory.algorithms import make_algorithm
    from flow_factory.config.train import TrainConfig
    from flow_factory.data.prompts import PromptItem
    from flow_factory.dynamics import make_dynamics
    from flow_factory.guards import NonFiniteGuard
    from flow_factory.models.lora import apply_lora
    from flow_factory.precision import Precision, avoid_cudnn_attention, run_mixed_precision
    from flow_factory.sampling import SamplingServices, SamplingSettings, collect_rollouts
    from flow_factory.trainer.optimize import OptimizeSettings, Stepper, optimize_epoch
    from flow_factory.trainer.policy import AdapterPolicy

    deadline = time.perf_counter() + budget
    gpu = ARGS.device == "cuda"
    size = 1024 if gpu else 64
    avoid_cudnn_attention()  # as the trainer does
    mixed = run_mixed_precision("bf16")
    accelerator = Accelerator(mixed_precision=mixed, cpu=not gpu)
    precision = Precision.of(mixed, accelerator.device)
    start = time.perf_counter()
    try:
        adapter, config = flux_size_adapter(work, ARGS.device, precision.load, None, tiny=not gpu)
        params = sum(p.numel() for p in adapter.transformer.parameters())
        apply_lora(adapter.transformer, 64, 64, "default", adapter.default_lora_targets)
        trained = [p for p in adapter.transformer.parameters() if p.requires_grad]
        for p in trained:
            p.data = p.data.float()  # fp32 master weights, as the trainer keeps them
        row("flux", f"build: {params / 1e9:.2f} B parameters, LoRA rank 64", True, time.perf_counter() - start,
            note=f"{len(trained)} LoRA tensors, {sum(p.numel() for p in trained) / 1e6:.1f} M values")
    except BaseException as exc:  # noqa: BLE001
        row("flux", "build", False, time.perf_counter() - start, note=error_line(exc))
        traceback.print_exc()
        return
    train = TrainConfig(trainer_type="grpo", clip_range=1e-4, num_inference_steps=4, per_device_batch_size=1)
    dynamics = make_dynamics("Flow-SDE", 0.7)
    algorithm = make_algorithm("grpo", train, dynamics)
    policy = AdapterPolicy(adapter, 3.5, "lora", keep_reference=False)
    optimizer = accelerator.prepare(torch.optim.AdamW(trained, lr=1e-5))
    # one group of 2 samples, 4 steps, the SDE window on steps 1 and 2: 4 micro-steps, 2 optimizer steps
    settings = SamplingSettings(size, size, None, 4, 3.5, 2, 0, sde_steps=[1, 2], storage_dtype=precision.storage,
                                keep_states=tuple(algorithm.kept_states(4, [1, 2])))
    items = [PromptItem("a red circle on a blue square")] * 2
    start = time.perf_counter()
    try:
        rollouts = collect_rollouts(adapter, dynamics, items, torch.tensor([0, 0]), [0, 1], settings, epoch=0,
                                    services=SamplingServices(autocast=precision.autocast))
        row("flux", f"rollout: 2 samples x 4 steps at {size} px", True, time.perf_counter() - start)
    except BaseException as exc:  # noqa: BLE001
        row("flux", "rollout", False, time.perf_counter() - start, note=error_line(exc))
        traceback.print_exc()
        return
    advantages = torch.tensor([1.0, -1.0])

    def train_once(steps_per_call) -> tuple[float, float | None]:
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        begin = time.perf_counter()
        _, steps = optimize_epoch(algorithm, policy, rollouts, advantages,
                                  OptimizeSettings(batch_size=1, accumulation=2, steps_per_call=steps_per_call),
                                  Stepper(accelerator, optimizer, trained, NonFiniteGuard(10)), epoch=0)
        if gpu:
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**30 if gpu else None
        if steps == 0:
            raise FloatingPointError("every optimizer step was skipped: non-finite gradients")
        return (time.perf_counter() - begin) / steps, peak

    adapter.transformer.enable_gradient_checkpointing()
    variants = [("LoRA, checkpointing, steps_per_call 1", {}),
                ("LoRA, checkpointing, steps_per_call 2", {"steps_per_call": 2}),
                ("LoRA, no gradient checkpointing", {"checkpointing": False}),
                ("LoRA, torch_compile regional", {"compile": True}),
                # last: cuDNN's attention is the one the trainer avoids (precision.avoid_cudnn_attention)
                ("LoRA, attn_backend _native_cudnn", {"attn": "_native_cudnn"})]
    cuda_lost = False
    for case, change in variants:
        if time.perf_counter() > deadline:
            row("flux", case, None, note="not run: the part's time budget is spent")
            continue
        if not gpu and ("attn" in change or change.get("compile")):  # a GPU's backend; minutes of compiling here
            row("flux", case, None, note="on a GPU only")
            continue
        start = time.perf_counter()
        try:
            if change.get("checkpointing") is False:
                adapter.transformer.disable_gradient_checkpointing()
            if "attn" in change:
                adapter.set_attention_backend(change["attn"])
            if change.get("compile"):
                adapter.compile_transformers("regional")
            train_once(change.get("steps_per_call", 1))  # warm-up (and compilation)
            seconds, peak = train_once(change.get("steps_per_call", 1))
            row("flux", case, True, seconds, peak, note=f"s per optimizer step (2 micro-steps at {size} px); "
                f"first epoch {time.perf_counter() - start:.0f} s in all")
        except BaseException as exc:  # noqa: BLE001
            row("flux", case, False, time.perf_counter() - start, note=error_line(exc))
            traceback.print_exc()
            if "CUDA error" in str(exc):  # the context is lost: nothing more runs on the GPU in this process
                cuda_lost = True
                break
        finally:
            if change.get("checkpointing") is False:
                adapter.transformer.enable_gradient_checkpointing()
            if "attn" in change and not cuda_lost:
                adapter.set_attention_backend("native")
    del adapter, policy, optimizer, rollouts, trained
    if gpu and not cuda_lost:
        torch.cuda.empty_cache()
    if time.perf_counter() > deadline:
        row("flux", "full fine-tuning, fsdp2, 1 process", None, note="not run: the part's time budget is spent")
        return
    full_finetune_fsdp2(work, max(60.0, deadline - time.perf_counter()), size)


def full_finetune_fsdp2(work: Path, budget: float, size: int) -> None:
    """ff-train, full fine-tuning under config_file fsdp2 with one process, on a pipeline folder whose
    transformer has FLUX.1-dev's width and 2 + 4 blocks."""
    import torch
    from helpers_runs import tiny_run_config, write_config

    case = "full fine-tuning, fsdp2, 1 process (2+4 blocks)"
    start = time.perf_counter()
    try:
        folder = work / "pipes" / "flux-wide"
        if not (folder / "model_index.json").exists():
            # built on the CPU: a CUDA fault of an earlier case leaves this process's GPU unusable
            adapter, _ = flux_size_adapter(work, "cpu", torch.bfloat16, (2, 4), tiny=ARGS.device == "cpu")
            adapter.pipeline.save_pretrained(folder)
            del adapter
        tmp = work / "runs" / "flux-full-fsdp2"
        tmp.mkdir(parents=True)
        config = tiny_run_config(tmp, "flux1", folder, max_epochs=1, resolution=size, num_inference_steps=2,
                                 learning_rate=1e-6)
        config["model"]["finetune_type"] = "full"
        config.update(mixed_precision="bf16", config_file="fsdp2", num_processes=1,
                      main_process_port=29731)
        config["eval"]["eval_freq"] = 0
        config["log"]["verbose"] = False
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        if ARGS.device == "cpu":
            env["FF_CPU_MIXED_PRECISION"] = "1"
        out = subprocess.run([sys.executable, "-m", "flow_factory.train", str(write_config(tmp, config))],
                             env=env, capture_output=True, text=True, timeout=budget)
        if out.returncode:
            raise RuntimeError(f"ff-train exited {out.returncode}: {out.stderr.strip().splitlines()[-1:]}")
        history = json.loads((tmp / "saves" / "run" / "history.json").read_text())["train"][-1]
        row("flux", case, True, history.get("time/training"), history.get("memory/peak_allocated_gib"),
            note=f"s of the epoch's training phase; loss {history.get('train/loss', float('nan')):.3g}; "
                 f"whole run {time.perf_counter() - start:.0f} s")
    except subprocess.TimeoutExpired:
        row("flux", case, False, budget, note="over its time budget")
    except BaseException as exc:  # noqa: BLE001
        row("flux", case, False, time.perf_counter() - start, note=error_line(exc))
        traceback.print_exc()


# ---------------------------------------------------------------- table
def table(device_name: str, seconds: float) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    import torch

    lines = [f"## {datetime.date.today().isoformat()}: `bench/gpu_check.py --device {ARGS.device}` on {device_name}",
             "",
             f"At {commit}, torch {torch.__version__}; {seconds:.0f} s in all.",
             "",
             "| part | case | result | seconds | peak GiB | note |",
             "|---|---|---|---|---|---|"]
    for r in ROWS:
        sec = "" if r["seconds"] is None else f"{r['seconds']:.2f}"
        peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        lines.append(f"| {r['part']} | {r['case']} | {r['result']} | {sec} | {peak} | {r['note']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--parts", default="tests,families,flux", help="comma-separated: tests, families, flux (fsdp2: its full fine-tuning case alone)")
    parser.add_argument("--budget", type=float, nargs=3, default=[100.0, 170.0, 170.0], metavar=("TESTS", "FAMILIES", "FLUX"),
                        help="seconds each part may take")
    parser.add_argument("--test-workers", type=int, default=1)
    parser.add_argument("--out", default=str(ROOT / "docs" / "experiments" / "gpu.md"),
                        help="the markdown file the dated table is appended to")
    parser.parse_args(namespace=ARGS)
    if ARGS.device == "cpu":
        os.environ["FF_CPU_MIXED_PRECISION"] = "1"  # before flow_factory is imported: its oneDNN cap
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if ARGS.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; run with --device cpu for the CPU-possible parts", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(0) if ARGS.device == "cuda" else "this CPU (bf16 via FF_CPU_MIXED_PRECISION)"
    began = time.perf_counter()
    parts = ARGS.parts.split(",")
    budgets = {**dict(zip(("tests", "families", "flux"), ARGS.budget)), "fsdp2": ARGS.budget[2]}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        for name, part in (("tests", part_tests), ("families", lambda b: part_families(b, Path(work))),
                           ("flux", lambda b: part_flux(b, Path(work))),
                           ("fsdp2", lambda b: full_finetune_fsdp2(Path(work), b, 1024 if ARGS.device == "cuda" else 64))):
            if name in parts:
                try:
                    part(budgets[name])
                except BaseException as exc:  # noqa: BLE001
                    if isinstance(exc, KeyboardInterrupt):
                        break
                    row(name, "the part itself", False, note=error_line(exc))
                    traceback.print_exc()
    text = table(device_name, time.perf_counter() - began)
    print("\n" + text)
    out = Path(ARGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.exists():
        out.write_text("# GPU checks\n\nEach section: one run of `bench/gpu_check.py` (`make gpu-check`), "
                       "dated, with the commit it ran.\n\n")
    with out.open("a") as f:
        f.write("\n" + text)
    return 0 if all(r["result"] != "FAIL" for r in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
