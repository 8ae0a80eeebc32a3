"""A GPU's precision on this CPU (``FF_CPU_MIXED_PRECISION=1``): the precision each part runs in, the
rollout under bf16 autocast with fp16 trajectories, and fp16's gradient scaler beside the non-finite guard.

The families x algorithms matrix in bf16 lives with the end-to-end tests it shares its runs with
(test_train_cli.py, test_decoupled_train.py, test_conditioned.py: the ``gpu_precision`` fixture).
"""

import json
import math

import pytest
import torch
from helpers_algorithms import nan_on_first_call
from helpers_runs import tiny_run_config, write_config
from safetensors.torch import load_file

from flow_factory.dynamics import make_dynamics
from flow_factory.models import load_adapter
from flow_factory.precision import Precision, run_mixed_precision
from flow_factory.trajectory import TrajectoryOptions, sample_trajectory
from flow_factory.train import main


def test_a_cpu_run_computes_in_float32_unless_switched(monkeypatch):
    monkeypatch.delenv("FF_CPU_MIXED_PRECISION", raising=False)
    assert run_mixed_precision("bf16", cuda=False) == "no"
    assert run_mixed_precision("bf16", cuda=True) == "bf16"
    monkeypatch.setenv("FF_CPU_MIXED_PRECISION", "1")
    assert run_mixed_precision("fp16", cuda=False) == "fp16"
    gpu = Precision.of("bf16", "cuda", master="float32", trajectory="float16")
    assert (gpu.load, gpu.master, gpu.storage, gpu.autocast_dtype) == (torch.bfloat16, torch.float32,
                                                                       torch.float16, torch.bfloat16)
    assert Precision.of("no", "cpu").storage == torch.float32  # null storage: the load dtype


def test_fp16_trajectories_under_bf16_autocast_do_not_crash_the_rollout(tiny_sd3_path):
    """The crash every GPU run's first rollout hit: autocast's promotion for stack / cat accepts only float32 and
    the autocast dtype, so the fp16 trajectory may not be stacked inside the autocast region."""
    with pytest.raises(RuntimeError, match="prioritize"):  # what the old code did
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.stack([torch.zeros(2, dtype=torch.float16)] * 2)
    precision = Precision.of("bf16", "cpu", trajectory="float16")
    adapter = load_adapter("sd3-5", tiny_sd3_path, "cpu", precision.load)
    cond = adapter.encode(["a red cube", "a blue ball"], None, 3.0)
    noise = adapter.initial_noise(2, 64, 64, torch.Generator().manual_seed(1))
    traj = sample_trajectory(adapter, make_dynamics("Flow-SDE", 0.7), cond, noise, adapter.sigmas(3, 64, 64), 3.0,
                             generator=torch.Generator().manual_seed(2),
                             options=TrajectoryOptions(storage_dtype=precision.storage, autocast=precision.autocast))
    assert traj.latents.dtype == torch.float16 and traj.log_probs.dtype == torch.float32
    assert torch.isfinite(traj.log_probs).all() and traj.log_probs[:, 0].abs().sum() > 0


def _fp16_run(tmp_path, tiny_sd3_path, **train):
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path, **{"max_epochs": 2, "max_nonfinite_in_a_row": 0,
                                                                   **train})
    config["mixed_precision"] = "fp16"
    config["eval"]["eval_freq"] = 0
    return config


def _history(tmp_path):
    return json.loads((tmp_path / "saves" / "run" / "history.json").read_text())["train"]


def test_an_fp16_overflow_is_the_scalers_to_skip_and_the_run_goes_on(tmp_path, tiny_sd3_path, monkeypatch,
                                                                    gpu_precision, capsys):
    """A loss scale of 2^40 overflows fp16's backward: the scaler skips that step, weights untouched, and lowers the
    scale (here by 2^-30, to 2^10); the next epoch trains. The guard, allowed no skip at all
    (max_nonfinite_in_a_row 0), does not count it: finite losses whose scaled gradients overflowed are no data
    problem."""
    original = torch.amp.GradScaler.__init__

    def huge_scale(self, device="cuda", *args, **kwargs):  # accelerate's scaler on a GPU, ours on this CPU
        original(self, device, *args, **{**kwargs, "init_scale": 2.0 ** 40, "backoff_factor": 2.0 ** -30})

    monkeypatch.setattr(torch.amp.GradScaler, "__init__", huge_scale)
    assert main([str(write_config(tmp_path, _fp16_run(tmp_path, tiny_sd3_path)))]) == 0
    assert "precision: fp16 autocast on" in capsys.readouterr().err
    history = _history(tmp_path)
    assert [r["train/overflow_skipped_steps"] for r in history] == [1, 0]
    assert [r["train/skipped_updates"] for r in history] == [0, 0]
    assert history[-1]["train/loss_scale"] == 2.0 ** 10
    run = tmp_path / "saves" / "run" / "checkpoints"
    first, second = (load_file(run / f"epoch_{e}" / "pytorch_lora_weights.safetensors") for e in (1, 2))
    # epoch 0's step was skipped: LoRA's B matrices are still their initial zeros; epoch 1's step moved them
    assert all(float(v.abs().max()) == 0 for k, v in first.items() if "lora_B" in k)
    assert any(float(v.abs().max()) > 0 for k, v in second.items() if "lora_B" in k)
    assert all(torch.isfinite(v).all() for v in second.values())
    scaler = torch.load(run / "epoch_2" / "grad_scaler.pt", weights_only=True)  # resumes with its scale
    assert scaler["scale"] == 2.0 ** 10


def test_an_inf_from_the_data_under_fp16_is_the_guards_and_keeps_the_loss_scale(tmp_path, tiny_sd3_path,
                                                                               monkeypatch, gpu_precision):
    from flow_factory.algorithms.grpo import GRPO

    monkeypatch.setattr(GRPO, "loss", nan_on_first_call(GRPO.loss))
    config = _fp16_run(tmp_path, tiny_sd3_path, max_nonfinite_in_a_row=1)
    assert main([str(write_config(tmp_path, config))]) == 0
    history = _history(tmp_path)
    assert [r["train/skipped_updates"] for r in history] == [1, 0]
    assert [r["train/overflow_skipped_steps"] for r in history] == [0, 0]
    assert [r["train/loss_scale"] for r in history] == [65536.0, 65536.0]  # a data NaN is no overflow
    lora = load_file(tmp_path / "saves" / "run" / "checkpoints" / "epoch_2" / "pytorch_lora_weights.safetensors")
    assert all(torch.isfinite(v).all() for v in lora.values())
    assert math.isfinite(history[1]["train/loss"])


def test_a_full_fine_tunings_reference_keeps_the_modules_its_class_keeps_in_float32(tiny_wan_path, caplog):
    """Wan's norms and time embedder stay float32 in the bf16 reference, as from_pretrained loads them
    (diffusers' _keep_in_fp32_modules), and the copy is made without diffusers' warning about casting them."""
    from diffusers import WanTransformer3DModel

    from flow_factory.trainer.policy import frozen_copy

    trained = WanTransformer3DModel.from_pretrained(tiny_wan_path / "transformer")  # float32: master weights
    loaded = WanTransformer3DModel.from_pretrained(tiny_wan_path / "transformer", torch_dtype=torch.bfloat16)
    keep = set(trained._keep_in_fp32_modules)
    assert keep and any(keep & set(name.split(".")) for name, _ in trained.named_parameters())
    with caplog.at_level("WARNING"):
        reference = frozen_copy(trained, torch.device("cpu"), torch.bfloat16)
    assert "should be kept in float32" not in caplog.text
    dtypes = {name: p.dtype for name, p in reference.named_parameters()}
    assert dtypes == {name: p.dtype for name, p in loaded.named_parameters()}
    assert {torch.float32, torch.bfloat16} == set(dtypes.values())
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training
    for (name, p), q in zip(reference.named_parameters(), trained.parameters()):
        assert torch.equal(p, q.to(p.dtype)), name
