"""``ff-sample``: images or videos from a pipeline (optionally with a training checkpoint) for given prompts.

    ff-sample --checkpoint runs/x/checkpoints/epoch_8 --prompt-file prompts.txt --out DIR
    ff-sample MODEL_DIR --prompts "a photo of a red circle" ... --out DIR
    ff-sample MODEL_DIR --model-type flux1-kontext --prompt-file edits.jsonl --out DIR

With ``--checkpoint`` of a run, every sampling setting (model and model type, resolution, steps, guidance,
frames, condition image size, strength, flow shift, seed, batch size, mixed precision) defaults to the run's
eval, read from the config ff-train saved in the run folder (``checkpoint.run_config_file``), so a checkpoint
samples as the run evaluated it; a flag given overrides its setting. Without a run config, the defaults are
ff-sample's own (``PLAIN_DEFAULTS``). One line on stderr says which.

Writes ``DIR/NNNN.png`` (one per sample; a video as ``NNNN.mp4``, H.264, or with ``--video-format gif``
an animated ``NNNN.gif``), ``DIR/grid.png`` (every sample with its prompt, beside its condition images;
``grid.mp4`` / ``grid.gif`` for videos) and
``DIR/samples.jsonl`` (``{"index", "prompt", "seed", "file"}`` a line). A model with audio (LTX-2) puts
each sample's soundtrack in its mp4 as AAC, or beside its GIF as ``NNNN.wav`` (the line's ``audio``);
the grid stays silent. A conditioned model
(flux1-kontext, wan2_i2v, wan2_v2v) takes its condition files from a jsonl prompt file's rows (``image``, relative to
the file's folder's ``images/``; ``video``, to its ``videos/``); video-to-video regenerates the last ``--strength``
part of the steps.
Sample ``i`` is drawn from the ODE with noise seeded by ``(seed, i)`` exactly as the
Trainer's eval draws test prompt ``i``: the same seed gives the same images.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import own_process

# The settings a run's eval decides, and ff-sample's defaults for them when no run config is found. Their flags
# parse to None unless given, so a flag given is told apart from a default (and overrides the run's setting).
PLAIN_DEFAULTS = {"model": None, "model_type": "sd3-5", "resolution": 64, "num_frames": None,
                  "condition_image_size": None, "steps": 10, "guidance_scale": 1.0, "guidance_scale_2": None,
                  "strength": None, "flow_shift": None, "seed": 0, "batch_size": 8, "mixed_precision": "bf16"}


def run_eval_settings(cfg) -> dict:
    """The ``PLAIN_DEFAULTS`` settings as the run of ``cfg`` evaluates: its eval section (whose nulls the config
    filled from train's, as the Trainer's eval reads them) and the model, scheduler and precision it sets."""
    ev = cfg.eval
    return {"model": cfg.model.model_name_or_path, "model_type": cfg.model.model_type, "resolution": ev.resolution,
            "num_frames": ev.num_frames, "condition_image_size": ev.condition_image_size,
            "steps": ev.num_inference_steps, "guidance_scale": ev.guidance_scale,
            "guidance_scale_2": ev.guidance_scale_2, "strength": ev.strength, "flow_shift": cfg.scheduler.flow_shift,
            "seed": ev.seed, "batch_size": ev.per_device_batch_size, "mixed_precision": cfg.mixed_precision}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ff-sample", description=__doc__.split("\n")[0])

    def run_setting(flag: str, help: str, otherwise=None, **kwargs) -> None:
        """A flag whose default is the run's eval setting with --checkpoint, else ``otherwise`` (words for a
        default that is no value) or its ``PLAIN_DEFAULTS`` value."""
        plain = PLAIN_DEFAULTS[flag.removeprefix("--").replace("-", "_")] if otherwise is None else otherwise
        p.add_argument(flag, default=None, help=f"{help}; default: the run's eval setting with --checkpoint, "
                       f"else {plain}", **kwargs)

    p.add_argument("model", nargs="?", help="a diffusers pipeline folder (or hub id); default: the run's "
                   "model.model_name_or_path with --checkpoint, else required")
    p.add_argument("--checkpoint", help="an ff-train checkpoint folder (LoRA or full transformer); a run's "
                   "(RUN/checkpoints/epoch_N) also gives every setting below its run's eval value")
    from .config.families import MODEL_TYPES

    run_setting("--model-type", f"the adapter: {', '.join(MODEL_TYPES)}, or your adapter class's dotted path")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", nargs="+", help="prompts, one sample each")
    src.add_argument("--prompt-file", help="a prompt file: .txt (a prompt a line) or .jsonl")
    p.add_argument("--out", required=True, help="output folder")
    run_setting("--resolution", "image size in pixels", type=int)
    run_setting("--num-frames", "video models only", "the model's", type=int)
    p.add_argument("--video-format", choices=["mp4", "gif"], default="mp4",
                   help="video models: each sample and the grid as an H.264 mp4 or an animated GIF "
                   "(default: %(default)s)")
    run_setting("--condition-image-size", "conditioned models: the size condition images are resized to",
                "--resolution", type=int)
    run_setting("--steps", "ODE steps", type=int)
    run_setting("--guidance-scale", "CFG / guidance scale", type=float)
    run_setting("--strength", "video-to-video (wan2_v2v): the part of the steps that regenerate the condition "
                "video, in (0, 1]: the rollout starts from it noised to the first of the last int(steps x strength) "
                "steps", "0.8, the pipeline's", type=float)
    run_setting("--guidance-scale-2", "a two-expert model's low-noise expert (Wan2.2 A14B)", "--guidance-scale",
                type=float)
    run_setting("--flow-shift", "the sigma schedule's static shift (scheduler.flow_shift)", "the model's own",
                type=float)
    run_setting("--seed", "noise seed: sample i is seeded by (seed, i), as the eval's test prompt i", type=int)
    run_setting("--batch-size", "samples per transformer call", type=int)
    run_setting("--mixed-precision", "autocast precision on a GPU, as ff-train's mixed_precision (a CPU samples "
                "in float32 unless FF_CPU_MIXED_PRECISION=1)", choices=["no", "bf16", "fp16"])
    return p.parse_args(argv)


def fill_settings(args: argparse.Namespace) -> str:
    """Set each run setting not given as a flag to the run's eval value (``--checkpoint`` of a run whose config
    is found) or to ``PLAIN_DEFAULTS``; returns where they came from. ValueError when the run's config does not
    load or no model is named."""
    from .checkpoint import run_config_file
    from .config import ConfigError, load_config
    from .config.base import canonical_choice
    from .config.families import model_type_aliases

    path = run_config_file(args.checkpoint) if args.checkpoint else None
    if path is None:
        settings = PLAIN_DEFAULTS
        source = "ff-sample's defaults"
        if args.checkpoint:
            source += f" (no config.yaml in --checkpoint {args.checkpoint} or its run folder)"
    else:
        try:
            cfg = load_config(path)
        except ConfigError as e:
            raise ValueError(f"--checkpoint {args.checkpoint}: its run's config does not load: {e}") from None
        settings = run_eval_settings(cfg)
        source = f"run {cfg.log.run_name}'s eval settings ({path})"
    for key, value in settings.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.model_type = canonical_choice(args.model_type, model_type_aliases())  # a spelling the config accepts
    if args.model is None:
        raise ValueError("MODEL: name a diffusers pipeline folder or hub id, or give --checkpoint of a run "
                         "(RUN/checkpoints/epoch_N) whose config names it")
    return source


def describe(args: argparse.Namespace, source: str) -> str:
    """The one line saying what is sampled, and where the settings came from."""
    from .config.base import resolution_pair

    height, width = resolution_pair(args.resolution)
    guidance = f"guidance {args.guidance_scale:g}"
    if args.guidance_scale_2 is not None:
        guidance += f" / {args.guidance_scale_2:g}"
    frames = f", {args.num_frames} frames" if args.num_frames else ""
    return (f"ff-sample: sampling {args.model_type} {args.model} at {height}x{width} px{frames}, {args.steps} "
            f"steps, {guidance}, seed {args.seed}: {source}, flags given override")


def read_prompt_file(path: Path) -> list:
    from .data.prompts import PromptItem, _parse_jsonl, _content_lines

    if not path.is_file():
        raise FileNotFoundError(f"--prompt-file {path}: no such file")
    if path.suffix == ".jsonl":
        return _parse_jsonl(path)
    return [PromptItem(text) for _, text in _content_lines(path)]


def check_strength(args: argparse.Namespace, adapter_cls) -> None:
    """ValueError naming --strength unless it is unset, or in (0, 1] for a model that starts from a condition
    video and keeps at least one of --steps."""
    from .config.sections import strength_steps

    if args.strength is None:
        return
    if "videos" not in adapter_cls.condition_inputs:
        raise ValueError(f"--strength: {args.model_type} does not start from a condition video; the flag is for "
                         "video-to-video (wan2_v2v); remove it")
    if not 0 < args.strength <= 1:
        raise ValueError(f"--strength {args.strength:g}: must be in (0, 1], the part of the steps that regenerate "
                         "the condition video (1: all of them, from pure noise)")
    if strength_steps(args.steps, args.strength) == 0:
        raise ValueError(f"--strength {args.strength:g} with --steps {args.steps} keeps no step "
                         f"(int({args.steps} x {args.strength:g}) = 0); raise either")


def main(argv=None) -> int:
    args = parse_args(argv)
    from .config.base import resolution_pair

    try:
        source, items, size = read_and_check_prompts(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"ff-sample: {e}", file=sys.stderr)
        return 2
    if not items:
        print("ff-sample: no prompts given", file=sys.stderr)
        return 2
    print(describe(args, source), file=sys.stderr)

    import torch

    from .checkpoint import CheckpointError
    from .guards import NonFiniteError
    from .precision import Precision, run_mixed_precision
    from .sampling import SamplingSettings, sample_prompts

    own_process.imports_done()

    precision = Precision.of(run_mixed_precision(args.mixed_precision), "cuda" if torch.cuda.is_available() else "cpu")
    print(f"ff-sample: {precision.describe()}", file=sys.stderr)
    try:
        adapter = load_adapter(args, precision)
    except (CheckpointError, NonFiniteError, FlagRefused) as e:
        print(f"ff-sample: {e}", file=sys.stderr)
        return 2
    settings = SamplingSettings(*resolution_pair(args.resolution), args.num_frames, args.steps, args.guidance_scale,
                                args.batch_size, args.seed, condition_size=size, keep_audio=True)
    rollouts = sample_prompts(adapter, items, settings, autocast=precision.autocast)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    count, grid = write_samples(args, adapter, items, rollouts, out)
    print(f"ff-sample: {count} samples and {grid.name} in {out}")
    return 0


def read_and_check_prompts(args) -> tuple:
    """``(where the settings came from, the prompts, the condition image size)``: the prompts read and
    checked against what the model takes, before it loads (FileNotFoundError or ValueError otherwise)."""
    from .config.base import resolution_pair
    from .data.conditions import check_batchable, check_conditions
    from .data.prompts import PromptItem
    from .models import get_adapter_class
    from .models.preflight import checkpoint_conditions

    source = fill_settings(args)
    items = read_prompt_file(Path(args.prompt_file)) if args.prompt_file else [PromptItem(p) for p in args.prompts]
    adapter_cls = get_adapter_class(args.model_type)
    per_sample, note = checkpoint_conditions(adapter_cls, args.model)
    check_conditions(items, args.model_type, adapter_cls.condition_inputs, per_sample, note)
    check_strength(args, adapter_cls)
    size = resolution_pair(args.condition_image_size)
    check_batchable(items, lambda item: adapter_cls.call_shape([f.size for f in item.images], size),
                    args.batch_size, "--batch-size")
    return source, items, size


class FlagRefused(Exception):
    """A flag the loaded model cannot take."""


def load_adapter(args, precision):
    """The model (with ``--checkpoint``'s weights) set up as the flags say; FlagRefused for a flag it refuses."""
    from .checkpoint import load_for_sampling

    adapter = load_for_sampling(args.model_type, args.model, args.checkpoint, dtype=precision.load)
    if args.guidance_scale_2 is not None and len(adapter.experts(adapter.pipeline.config)) == 1:
        raise FlagRefused(f"--guidance-scale-2: {args.model} has one expert; remove the flag")
    adapter.guidance_scale_2 = args.guidance_scale_2
    if args.strength is not None:
        adapter.strength = args.strength
    if args.flow_shift is not None:  # the schedule the run evaluated on
        adapter.set_flow_shift(args.flow_shift)
    return adapter


def write_samples(args, adapter, items: list, rollouts, out: Path) -> tuple[int, Path]:
    """Each sample's file, ``samples.jsonl`` and the grid in ``out``: (the number of samples, the grid's path)."""
    from .media import VIDEO_FPS, sample_grid, save_grid, save_video
    from .rewards.base import images_to_pil, videos_to_pil

    media = rollouts.media
    rows = []
    pictures = videos_to_pil(media) if adapter.is_video else images_to_pil(media)
    fps = getattr(adapter, "frame_rate", VIDEO_FPS)
    for i, (item, picture) in enumerate(zip(items, pictures)):
        row = {"index": i, "prompt": item.prompt, "seed": args.seed}
        if adapter.is_video:  # every frame, as an mp4 or an animated GIF; a soundtrack in the mp4 or beside the GIF
            audio = None if rollouts.audio is None else rollouts.audio[i]
            row["file"] = save_video(picture, out / f"{i:04d}", args.video_format, fps, audio,
                                     rollouts.audio_sample_rate).name
            if audio is not None and args.video_format != "mp4":
                row["audio"] = f"{i:04d}.wav"
        else:
            row["file"] = f"{i:04d}.png"
            picture.save(out / row["file"])
        rows.append(row)
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    conditions = rollouts.conditions.per_sample() if rollouts.conditions else None
    grid = save_grid(sample_grid(media, [it.prompt for it in items], conditions=conditions), out / "grid",
                     args.video_format, fps)
    return len(rows), grid


def cli() -> int:
    """The ``ff-sample`` command: ``main`` in a process of its own (``own_process``)."""
    own_process.start()
    return main()


if __name__ == "__main__":
    sys.exit(cli())
