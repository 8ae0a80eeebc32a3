"""A distillation run's other roles beside DeepSpeed's engine in bf16: what precision the fake score trains in.

DeepSpeed's engine casts the network it wraps to bf16 (its fp32 masters are its own optimizer's, the generator's);
``trainer/roles.Roles._beside_engine`` puts the other roles' adapters back in float32. This runs dmd2 with LoRA
for 2 epochs on a tiny SD3 over 2 CPU processes under ``zero2`` (or ``zero1``) in bf16
(``FF_CPU_MIXED_PRECISION=1``) and prints the dtypes of the fake score's saved weights, AdamW state and EMA, and
how far its LoRA B moved. Needs DeepSpeed, ninja and a C++ compiler (DeepSpeed builds its CPU op on first use).

    python bench/roles_beside_deepspeed.py [zero2|zero1]
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from flow_factory.testing import build_tiny_pipeline


def config(folder: Path, model: Path, config_file: str) -> dict:
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train.txt").write_text("a red circle\na blue square\n")
    (folder / "data" / "test.txt").write_text("a green triangle\n")
    entry = {"learning_rate": 1e-3}
    return {
        "seed": 7, "config_file": config_file, "mixed_precision": "bf16",
        "data": {"dataset_dir": str(folder / "data"), "cache_dir": str(folder / "cache")},
        "model": {"model_name_or_path": str(model), "model_type": "sd3-5", "finetune_type": "lora", "lora_rank": 4,
                  "lora_alpha": 8},
        "scheduler": {"dynamics_type": "ODE"},
        "train": {"trainer_type": "dmd2", "resolution": 64, "num_inference_steps": 2, "guidance_scale": 1.0,
                  "per_device_batch_size": 1, "group_size": 1, "unique_sample_num_per_epoch": 2,
                  "max_epochs": 2, "ttur_fake_updates": 2, "real_guidance_scale": 2.0, "ema_decay": 0,
                  "ema_update_interval": 1},
        "optimizers": [{"name": "generator", **entry}, {"name": "fake", **entry, "ema_decay": 0.5}],
        "eval": {"eval_freq": 0},
        "log": {"run_name": "run", "save_dir": str(folder / "saves"), "logging_backend": "none"},
    }


def main() -> None:
    config_file = sys.argv[1] if len(sys.argv) > 1 else "zero2"
    with tempfile.TemporaryDirectory(prefix="ff-roles-ds-") as tmp:
        folder = Path(tmp)
        model = build_tiny_pipeline("sd3-5", folder / "tiny")
        path = folder / "config.yaml"
        path.write_text(yaml.safe_dump(config(folder, model, config_file)))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "FF_CPU_MIXED_PRECISION": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        subprocess.run([sys.executable, "-m", "flow_factory.train", str(path), "--num_processes", "2",
                        "--main_process_port", str(port)], env=env, check=True)
        checkpoint = folder / "saves" / "run" / "checkpoints" / "epoch_2"
        fake = torch.load(checkpoint / "fake_lora.pt", weights_only=True)
        state = torch.load(checkpoint / "fake_optimizer.pt", weights_only=True)["state"]
        ema = torch.load(checkpoint / "fake_ema.pt", weights_only=True)["weights"]
        moved = max(float(v.abs().max()) for k, v in fake.items() if "lora_B" in k)
        print(f"{config_file}, bf16: fake score weights {sorted({str(v.dtype) for v in fake.values()})}, AdamW state "
              f"{sorted({str(t.dtype) for s in state.values() for k, t in s.items() if k != 'step'})}, EMA "
              f"{sorted({str(t.dtype) for t in ema})}; its LoRA B moved {moved:.3g}")


if __name__ == "__main__":
    main()
