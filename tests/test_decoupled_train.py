"""`ff-train` end to end for nft, awm and dpo on tiny SD3, FLUX and Wan, each with ODE and
with CPS rollouts (and one DPM-Solver++2M run; dgpo and crd with ODE), exact resume with the EMA
(and crd's old and sampling models, dgpo's fast old-policy EMA sampled with and a guided reference),
off-policy sampling with the EMA weights, and crd sampling with its sampling model."""

import json

import pytest
import torch
from helpers_runs import TINY_MODELS, tiny_run_config, write_config
from safetensors.torch import load_file

from flow_factory.config import parse_config
from flow_factory.train import main
from flow_factory.trainer.trainer import Trainer

RUNS = [(algorithm, model, dynamics) for algorithm in ("nft", "awm", "dpo")
        for model in ("sd3-5", "flux1", "wan2_t2v") for dynamics in ("ODE", "CPS")]
RUNS += [("dpo", "wan2_t2v", "DPM-Solver++2M")]
RUNS += [("dgpo", model, "ODE") for model in ("sd3-5", "flux1", "wan2_t2v")]
RUNS += [("crd", model, "ODE") for model in ("sd3-5", "flux1", "wan2_t2v")]


def decoupled_config(tmp, model_type, path, trainer_type, dynamics, **train):
    config = tiny_run_config(tmp, model_type, path, trainer_type=trainer_type, num_train_timesteps=1, **train)
    config["scheduler"] = {"dynamics_type": dynamics, "noise_level": 0.7 if dynamics == "CPS" else 0.0}
    return config


@pytest.mark.parametrize("trainer_type,model_type,dynamics", RUNS)
def test_ff_train_decoupled(request, tmp_path, trainer_type, model_type, dynamics, monkeypatch):
    """With ODE rollouts in a GPU's precision (bf16 autocast, fp16 trajectories); the others in float32. On
    SD3 the LoRA loads in its diffusers pipeline."""
    if dynamics == "ODE":
        monkeypatch.setenv("FF_CPU_MIXED_PRECISION", "1")
    path = request.getfixturevalue(TINY_MODELS[model_type][0])
    config = decoupled_config(tmp_path, model_type, path, trainer_type, dynamics)
    assert main([str(write_config(tmp_path, config))]) == 0
    run_dir = tmp_path / "saves" / "run"
    history = json.loads((run_dir / "history.json").read_text())["train"]
    assert [r["epoch"] for r in history] == [0, 1, 2]
    expected = {"nft": "train/positive_loss", "awm": "train/ratio_mean", "dpo": "train/implicit_accuracy",
                "dgpo": "train/group_weight", "crd": "train/r_theta_mean"}
    for key in (expected[trainer_type], "train/loss", "train/grad_norm", "reward/jpeg/mean"):
        assert key in history[-1], key
    lora = load_file(run_dir / "checkpoints" / "epoch_3" / "pytorch_lora_weights.safetensors")
    assert max(float(v.abs().max()) for k, v in lora.items() if "lora_B" in k) > 0, "the LoRA did not move"
    if model_type == "sd3-5":
        from diffusers import StableDiffusion3Pipeline

        StableDiffusion3Pipeline.from_pretrained(path).load_lora_weights(run_dir / "checkpoints" / "epoch_3")


@pytest.mark.parametrize("trainer_type,extra", [
    ("nft", {"ema_decay": 0.5, "off_policy": True, "ema_decay_schedule": "piecewise_linear", "ramp_rate": 0.3}),
    ("awm", {"ema_decay": 0.7, "ema_kl_beta": 0.1}),
    ("dpo", {}),
    # the fast old-policy EMA as the preference reference and, from the first step on, the rollouts' weights;
    # rollouts without CFG, the frozen reference with CFG at 3 (the prompts encoded with their negative branch)
    ("dgpo", {"kl_beta": 0.1, "clip_kl": True, "ema_decay": 0.5, "use_ema_ref": True, "switch_ema_ref": 0,
              "ema_ref_ramp_rate": 0.2, "guidance_scale": 1.0, "kl_cfg": 3.0}),
    ("crd", {"old_model_decay": "0-0.3-0.1-0.9", "sampling_model_decay": "1-0.0-0.2-0.9", "ema_decay": 0.5}),
])
def test_resume_matches_an_uninterrupted_run(tmp_path, tiny_sd3_path, trainer_type, extra):
    def run(folder, epochs, resume=None, name="run"):
        config = decoupled_config(folder, "sd3-5", tiny_sd3_path, trainer_type, "ODE", max_epochs=epochs, **extra)
        config["eval"]["eval_freq"] = 0
        config["log"]["run_name"] = name
        if resume:
            config["model"]["resume_path"] = str(resume)
        assert main([str(write_config(folder, config, f"{name}.yaml"))]) == 0
        return folder / "saves" / name / "checkpoints" / f"epoch_{epochs}"

    straight = run(tmp_path / "a", 3)
    half = run(tmp_path / "b", 1)
    resumed = run(tmp_path / "b", 3, resume=half, name="resumed")
    a = load_file(straight / "pytorch_lora_weights.safetensors")
    b = load_file(resumed / "pytorch_lora_weights.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    saved = ["ema.pt"] if extra.get("ema_decay") else []
    saved += ["crd_old.pt", "crd_sampling.pt"] if trainer_type == "crd" else []
    saved += ["ema_ref.pt"] if trainer_type == "dgpo" else []
    for name in saved:
        ema_a, ema_b = (torch.load(d / name, weights_only=True)["weights"] for d in (straight, resumed))
        for x, y in zip(ema_a, ema_b):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=0)


def test_off_policy_rollouts_use_the_ema_weights(tmp_path, tiny_sd3_path):
    def trainer(off_policy):
        config = decoupled_config(tmp_path, "sd3-5", tiny_sd3_path, "nft", "ODE", ema_decay=0.9,
                                  off_policy=off_policy)
        config["log"]["logging_backend"] = "none"
        config["log"]["run_name"] = f"off_policy_{off_policy}"  # both live at once: one run folder each
        return Trainer(parse_config(config))

    on, off = trainer(False), trainer(True)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in (on, off):  # same current weights in both; the EMA differs from them
            for p in t.params:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        for p_on, p_off in zip(on.params, off.params):
            p_off.copy_(p_on)
        for w in off.ema.weights:
            w.add_(torch.randn(w.shape, generator=gen) * 0.3)
    current = on.sample_epoch(0).latents[:, -1]
    sampled = off.sample_epoch(0).latents[:, -1]
    assert not torch.allclose(sampled, current, atol=1e-4), "off-policy rollout equals the current policy's"
    with torch.no_grad():  # load the EMA into the on-policy trainer's weights: its rollout must match
        for p, w in zip(on.params, off.ema.weights):
            p.copy_(w)
    torch.testing.assert_close(on.sample_epoch(0).latents[:, -1], sampled, atol=1e-6, rtol=0)
    for p_off, p_on in zip(off.params, on.params):  # sampling swapped the EMA in and back out
        assert not torch.equal(p_off, p_on)


def test_crd_rollouts_use_its_sampling_model(tmp_path, tiny_sd3_path):
    config = decoupled_config(tmp_path, "sd3-5", tiny_sd3_path, "crd", "ODE")
    config["log"]["logging_backend"] = "none"
    t = Trainer(parse_config(config))
    snapshot = t.snapshots["crd_sampling"]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        current = [torch.randn(p.shape, generator=gen) * 0.1 for p in t.params]
        other = [c + torch.randn(c.shape, generator=gen) * 0.3 for c in current]
        for p, c in zip(t.params, current):
            p.copy_(c)

    def sample_with(weights):
        with torch.no_grad():
            for w, x in zip(snapshot.weights, weights):
                w.copy_(x)
        return t.sample_epoch(0).latents[:, -1]

    sampled = sample_with(other)
    assert not torch.allclose(sampled, sample_with(current), atol=1e-4), "the rollout ignored the sampling model"
    with torch.no_grad():  # the same weights live: the rollout must match
        for p, x in zip(t.params, other):
            p.copy_(x)
    torch.testing.assert_close(sample_with(other), sampled, atol=1e-6, rtol=0)
