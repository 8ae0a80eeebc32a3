"""`ff-train` end to end on tiny SD3, FLUX and Wan pipelines saved to a temp folder."""

import json
import socket
import subprocess
import sys

import pytest
import torch
from helpers_runs import TINY_MODELS, tiny_run_config, write_config

from flow_factory.models import get_adapter_class
from flow_factory.train import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path, config):
    assert main([str(write_config(tmp_path, config))]) == 0


def _pipeline_output(pipe_cls, path, lora_dir, model_type):
    _, resolution, frames, guidance = TINY_MODELS[model_type]
    pipe = pipe_cls.from_pretrained(path)
    if lora_dir is not None:
        pipe.load_lora_weights(lora_dir)
    kwargs = {"num_frames": frames} if frames else {}
    out = pipe("a red circle", height=resolution, width=resolution, num_inference_steps=2,
               guidance_scale=guidance, output_type="latent",
               generator=torch.Generator().manual_seed(0), **kwargs)
    return (out.frames if hasattr(out, "frames") else out.images).float()


@pytest.mark.parametrize("trainer_type,epochs", [("grpo", 3), ("grpo-guard", 2)])
@pytest.mark.parametrize("model_type", list(TINY_MODELS))
def test_ff_train_runs_and_writes_a_loadable_lora(request, tmp_path, model_type, trainer_type, epochs):
    path = request.getfixturevalue(TINY_MODELS[model_type][0])
    extra = {"clip_range": 1e-5} if trainer_type == "grpo-guard" else {}
    config = tiny_run_config(tmp_path, model_type, path, trainer_type=trainer_type, max_epochs=epochs, **extra)
    _run(tmp_path, config)

    run_dir = tmp_path / "saves" / "run"
    events = list(run_dir.rglob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    history = json.loads((run_dir / "history.json").read_text())
    assert [r["epoch"] for r in history["train"]] == list(range(epochs))
    for key in ("reward/jpeg/mean", "train/loss", "train/ratio_mean", "train/clip_frac", "train/grad_norm",
                "advantage/std", "time/sampling", "time/training", "time/other"):
        assert key in history["train"][-1], key
    assert (run_dir / "reward_curve.png").exists()
    assert (run_dir / "samples" / "eval_epoch_0000.png").exists()

    lora_dir = run_dir / "checkpoints" / f"epoch_{epochs}"
    assert (lora_dir / "pytorch_lora_weights.safetensors").exists()
    pipe_cls = get_adapter_class(model_type).pipeline_class
    base = _pipeline_output(pipe_cls, path, None, model_type)
    tuned = _pipeline_output(pipe_cls, path, lora_dir, model_type)
    assert not torch.allclose(base, tuned, atol=1e-6), "the trained LoRA does not change the output"


def test_resume_matches_an_uninterrupted_run(tmp_path, tiny_sd3_path):
    straight = tiny_run_config(tmp_path / "a", "sd3-5", tiny_sd3_path, max_epochs=4)
    _run(tmp_path / "a", straight)

    first = tiny_run_config(tmp_path / "b", "sd3-5", tiny_sd3_path, max_epochs=2)
    _run(tmp_path / "b", first)
    resumed = tiny_run_config(tmp_path / "b", "sd3-5", tiny_sd3_path, max_epochs=4)
    resumed["model"]["resume_path"] = str(tmp_path / "b" / "saves" / "run" / "checkpoints" / "epoch_2")
    resumed["log"]["run_name"] = "resumed"
    _run(tmp_path / "b", resumed)

    from safetensors.torch import load_file
    a = load_file(tmp_path / "a" / "saves" / "run" / "checkpoints" / "epoch_4" / "pytorch_lora_weights.safetensors")
    b = load_file(tmp_path / "b" / "saves" / "resumed" / "checkpoints" / "epoch_4" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys() and len(a) > 0
    moved = 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
        moved += int(a[k].abs().max() > 0)
    assert moved > 0, "training did not move the LoRA weights"


def test_config_error_stops_before_anything_loads(tmp_path, tiny_sd3_path, capsys):
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    config["train"]["learnig_rate"] = 1e-4
    assert main([str(write_config(tmp_path, config))]) == 2
    err = capsys.readouterr().err
    assert "train.learnig_rate: unknown key; did you mean train.learning_rate?" in err
    assert not (tmp_path / "saves").exists()


def test_print_config_shows_resolved_defaults(tmp_path, tiny_sd3_path, capsys):
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    assert main(["--print-config", str(write_config(tmp_path, config)), "train.learning_rate=5e-4"]) == 0
    out = capsys.readouterr().out
    assert "learning_rate: 0.0005" in out and "dynamics_type: Flow-SDE" in out and "kl_beta:" in out


def test_two_processes_make_the_same_update_as_one(tmp_path, tiny_sd3_path):
    """DESIGN invariant 4: the same global batch on 1 and on 2 processes (accelerate launch,
    gloo on CPU) gives the same advantages and the same LoRA, up to float reduction order."""
    from safetensors.torch import load_file

    weights = {}
    for processes in (1, 2):
        folder = tmp_path / f"p{processes}"
        config = tiny_run_config(folder, "sd3-5", tiny_sd3_path, max_epochs=2, group_size=4)
        config["num_processes"] = processes
        config["main_process_port"] = _free_port()  # two test runs at once must not share a port
        config["eval"]["eval_freq"] = 0
        # the real CLI in its own process, with a deadline: a distributed hang fails, it does not stall CI
        command = [sys.executable, "-m", "flow_factory.train", str(write_config(folder, config))]
        subprocess.run(command, check=True, timeout=300, capture_output=True)
        weights[processes] = load_file(folder / "saves" / "run" / "checkpoints" / "epoch_2"
                                       / "pytorch_lora_weights.safetensors")
    assert max(float(v.abs().max()) for v in weights[1].values()) > 1e-3  # it trained
    for key, value in weights[1].items():
        torch.testing.assert_close(weights[2][key], value, atol=1e-6, rtol=0)
