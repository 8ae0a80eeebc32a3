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
}


def write_dataset(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.txt").write_text("\n".join(TRAIN_PROMPTS) + "\n")
    (folder / "test.txt").write_text("\n".join(TEST_PROMPTS) + "\n")
    return folder


def tiny_run_config(tmp: Path, model_type: str, model_path, **train) -> dict:
    _, resolution, frames, guidance = TINY_MODELS[model_type]
    return {
        "seed": 7,
        "data": {"dataset_dir": str(write_dataset(tmp / "data")), "cache_dir": str(tmp / "prompt_cache")},
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
