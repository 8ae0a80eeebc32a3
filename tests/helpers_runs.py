"""Writing a tiny run's dataset and config, shared by the end-to-end tests."""

from pathlib import Path

import yaml

TRAIN_PROMPTS = ["a red circle", "a blue square", "a green triangle", "two yellow stars",
                 "a cat on a mat", "a lake at dawn"]
TEST_PROMPTS = ["a purple cube", "a dog in the snow"]

# (model_type, fixture, resolution, num_frames, guidance)
TINY_MODELS = {
    "sd3-5": ("tiny_sd3_path", 64, None, 3.0),
    "flux1": ("tiny_flux_path", 64, None, 3.5),
    "wan2_t2v": ("tiny_wan_path", 32, 5, 3.0),
    "qwen-image": ("tiny_qwen_image_path", 64, None, 4.0),  # true CFG
    "z-image": ("tiny_z_image_path", 64, None, 0.0),  # Z-Image-Turbo's settings: no CFG
    "flux2": ("tiny_flux2_path", 64, None, 4.0),
    "flux2-klein": ("tiny_flux2_klein_path", 64, None, 1.0),  # step-distilled: no guidance
    "hunyuanvideo15": ("tiny_hunyuan_video15_path", 32, 5, 1.0),
    "ltx2_t2av": ("tiny_ltx2_path", 32, 9, 4.0),  # video with audio
    "qwen-image-2.1": ("tiny_qwen_image21_path", 64, None, 1.0),  # the released model's default: no CFG
}


# conditioned models: (fixture, resolution, num_frames, guidance); their datasets name condition files
CONDITIONED_MODELS = {
    "flux1-kontext": ("tiny_flux_kontext_path", 64, None, 2.5),
    "wan2_i2v": ("tiny_wan22_i2v_path", 32, 5, 3.0),  # Wan2.2 I2V's two experts (Wan2.1's CLIP: test_conditioned)
    "wan2_v2v": ("tiny_wan_v2v_path", 32, 5, 3.0),  # condition videos (mp4)
}
# conditioned models with a test file of their own (test_qwen_image_edit.py, test_ltx2_i2av.py), runnable by
# tiny_run_config too
OWN_FILE_CONDITIONED_MODELS = {"qwen-image-edit-plus": ("tiny_qwen_image_edit_path", 64, None, 2.5),
                               "ltx2_i2av": ("tiny_ltx2_i2av_path", 32, 9, 4.0),  # the first frame, with audio
                               "z-image-omni": ("tiny_z_image_omni_path", 64, None, 2.0)}  # CFG above 0
# the condition images of the conditioned datasets: (width, height), as the files are, and an RGB colour
CONDITION_IMAGES = {"red.png": ((83, 50), (200, 30, 30)), "green.png": ((83, 50), (30, 200, 30)),
                    "blue.png": ((83, 50), (30, 30, 200))}


def write_condition_image(path: Path, size: tuple[int, int], colour: tuple[int, int, int], seed: int = 0) -> Path:
    """A colour with a little noise (so resizing it is not trivial), saved as PNG."""
    import numpy as np
    from PIL import Image

    noise = np.random.default_rng(seed).integers(-30, 30, (size[1], size[0], 3))
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.clip(np.array(colour) + noise, 0, 255).astype(np.uint8)).save(path)
    return path


def write_condition_video(path: Path, size: tuple[int, int], colour: tuple[int, int, int], seed: int = 0,
                          frames: int = 6) -> Path:
    """A video of ``frames`` frames (``write_condition_image``'s, seeds ``seed``, ``seed + 10``, ...): an mp4
    (H.264; an odd size is padded to even) as Flow-Factory's datasets hold, or an animated GIF for ``.gif``."""
    from PIL import Image

    from flow_factory.media.video import write_mp4

    stills = []
    for k in range(frames):
        with Image.open(write_condition_image(path.with_suffix(f".{k}.png"), size, colour, seed + 10 * k)) as im:
            stills.append(im.convert("RGB"))
        path.with_suffix(f".{k}.png").unlink()
    if path.suffix == ".gif":
        stills[0].save(path, save_all=True, append_images=stills[1:], duration=100, loop=0)
    else:
        write_mp4(stills, path, fps=16)
    return path


def write_conditioned_dataset(folder: Path, videos: bool = False) -> Path:
    """train.jsonl / test.jsonl whose rows each name a condition image under images/ (or an mp4 video under
    videos/), and a metadata key."""
    import json

    key, kind = ("video", "videos") if videos else ("image", "images")
    names = [name.replace(".png", ".mp4") if videos else name for name in CONDITION_IMAGES]
    for i, (name, (size, colour)) in enumerate(zip(names, CONDITION_IMAGES.values())):
        write = write_condition_video if videos else write_condition_image
        write(folder / kind / name, size, colour, seed=i)
    for split, prompts in (("train", TRAIN_PROMPTS), ("test", TEST_PROMPTS)):
        rows = [{"prompt": f"make it {p}", key: names[i % len(names)], "row": i} for i, p in enumerate(prompts)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def write_mixed_condition_dataset(folder: Path) -> Path:
    """train.jsonl / test.jsonl of a model taking 0 or several condition images a row: rows with one image, with
    two (of other sizes), and without any (text to image in the same run)."""
    import json

    images = {"a.png": ((100, 72), (200, 30, 30)), "b.png": ((64, 80), (30, 200, 30))}
    for i, (name, (size, colour)) in enumerate(images.items()):
        write_condition_image(folder / "images" / name, size, colour, seed=i)
    rows = {"train": [{"prompt": "make it red", "image": "a.png"},
                      {"prompt": "blend them", "images": ["a.png", "b.png"]}, {"prompt": "a lake at dawn"}],
            "test": [{"prompt": "blend them", "images": ["b.png", "a.png"]}, {"prompt": "a red circle"}]}
    for split, lines in rows.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return folder


def write_dataset(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.txt").write_text("\n".join(TRAIN_PROMPTS) + "\n")
    (folder / "test.txt").write_text("\n".join(TEST_PROMPTS) + "\n")
    return folder


def tiny_run_config(tmp: Path, model_type: str, model_path, **train) -> dict:
    """A tiny run of ``model_type`` (``TINY_MODELS`` or ``CONDITIONED_MODELS``, with its condition dataset)."""
    conditioned = {**CONDITIONED_MODELS, **OWN_FILE_CONDITIONED_MODELS}
    _, resolution, frames, guidance = {**TINY_MODELS, **conditioned}[model_type]
    from flow_factory.config.families import MODEL_FAMILIES

    videos = "videos" in MODEL_FAMILIES[model_type].conditions

    def write(folder):
        return write_conditioned_dataset(folder, videos) if model_type in conditioned else write_dataset(folder)
    return {
        "seed": 7,
        "data": {"dataset_dir": str(write(tmp / "data")), "cache_dir": str(tmp / "prompt_cache")},
        "model": {"model_name_or_path": str(model_path), "model_type": model_type, "finetune_type": "lora",
                  "lora_rank": 4, "lora_alpha": 8},
        "scheduler": {"dynamics_type": "Flow-SDE", "noise_level": 0.7, "seed": 3},
        "train": {"trainer_type": "grpo", "resolution": resolution, "num_frames": frames,
                  "num_inference_steps": 3, "guidance_scale": guidance, "per_device_batch_size": 2,
                  "group_size": 2, "unique_sample_num_per_epoch": 2, "gradient_step_per_epoch": 1,
                  "learning_rate": 1e-3, "clip_range": 0.2, "max_epochs": 3, **train},
        "eval": {"eval_freq": 2, "per_device_batch_size": 2},
        "log": {"run_name": "run", "save_dir": str(tmp / "saves"), "save_freq": 1,
                "logging_backend": "tensorboard"},
        "rewards": [{"name": "jpeg", "reward_model": "jpeg_compressibility"}],
    }


def write_config(tmp: Path, config: dict, name: str = "config.yaml") -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump(config))
    return path


def ff_train_in_this_process(argv: list[str]) -> tuple[tuple[str, str], int]:
    """``ff-train ARGV`` run by the test's own process, for a one-process reference run: the same ``main`` a
    launch runs, without the seconds of imports a fresh process pays (the suite's process runs torch on one
    thread, as the launched runs do). Not from a thread: the run installs its signal handlers.
    Returns ((stdout, stderr), exit code)."""
    import contextlib
    import io

    from flow_factory.train import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return (out.getvalue(), err.getvalue()), code


def straight_and_resumed(tmp: Path, make_config, epochs: int, stop_after: int) -> tuple[Path, Path]:
    """A run of ``epochs`` epochs, and one stopped after ``stop_after`` and resumed to ``epochs``: their run
    folders. ``make_config(folder, epochs)`` is the run's config dict (eval is turned off here)."""
    from flow_factory.train import main

    def run(folder: Path, epochs: int, resume: Path | None = None, name: str = "run") -> Path:
        config = make_config(folder, epochs)
        config["eval"]["eval_freq"] = 0
        config["log"]["run_name"] = name
        if resume:
            config["model"]["resume_path"] = str(resume)
        assert main([str(write_config(folder, config, f"{name}.yaml"))]) == 0
        return folder / "saves" / name

    stopped = run(tmp / "b", stop_after) / "checkpoints" / f"epoch_{stop_after}"
    return run(tmp / "a", epochs), run(tmp / "b", epochs, resume=stopped, name="resumed")


def assert_same_state(a, b) -> None:
    """Two saved states (nested dicts, lists and tensors) equal exactly: a resumed run against the straight one."""
    import torch

    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_state(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_state(x, y)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:
        assert a == b
