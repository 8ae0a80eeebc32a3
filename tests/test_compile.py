"""model.torch_compile: the transformer is compiled in place after LoRA (whole, or its repeated blocks),
checkpoints keep their keys, and the on-policy ratio stays 1 through the compiled network (invariant 1);
Flow-Factory's ``acceleration`` block reads as these keys.

torch.compile's default backend (inductor) takes about a minute for the tiny SD3 on this CPU, so the
suite runs the ratio test with dynamo's "eager" backend (the graph capture, guards and recompilation
across LoRA toggles are the same; the kernels are torch's own); FF_COMPILE_TESTS=1, or a GPU, runs it
with inductor as a user gets it."""

import os

import pytest
import torch

from flow_factory.algorithms import make_algorithm
from flow_factory.config import parse_config
from flow_factory.config.train import TrainConfig
from flow_factory.dynamics import make_dynamics
from flow_factory.models import load_adapter
from flow_factory.models.lora import apply_lora
from flow_factory.trajectory import sample_trajectory
from flow_factory.trainer import Trainer
from flow_factory.trainer.policy import AdapterPolicy
from helpers_algorithms import assert_on_policy, perturb_lora
from helpers_runs import tiny_run_config

INDUCTOR = bool(os.environ.get("FF_COMPILE_TESTS")) or torch.cuda.is_available()


def test_torch_compile_compiles_the_transformer_in_place_and_keeps_checkpoint_keys(tmp_path, tiny_sd3_path):
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    config["model"].update(torch_compile=True, compile_mode="max-autotune-no-cudagraphs")  # true = auto: SD3 full
    config["log"]["logging_backend"] = "none"
    trainer = Trainer(parse_config(config))
    transformer = trainer.adapter.transformer
    assert transformer._compiled_call_impl is not None  # Module.compile: calls go through the compiled forward
    assert not any("_orig_mod" in k for k in transformer.state_dict())
    plain = Trainer(parse_config({**config, "model": {**config["model"], "torch_compile": "none"},
                                  "log": {**config["log"], "run_name": "plain"}}))
    assert plain.adapter.transformer._compiled_call_impl is None
    assert sorted(transformer.state_dict()) == sorted(plain.adapter.transformer.state_dict())
    trainer.run_folder.release()
    plain.run_folder.release()


def test_auto_compiles_repeated_blocks_where_the_model_declares_them(tiny_flux_path, tiny_sd3_path):
    flux = load_adapter("flux1", tiny_flux_path)
    assert flux.compile_transformers("auto", backend="eager") == {"transformer": "regional"}
    blocks = [m for m in flux.transformer.modules() if type(m).__name__ in flux.transformer._repeated_blocks]
    assert blocks and all(m._compiled_call_impl is not None for m in blocks)
    assert flux.transformer._compiled_call_impl is None
    sd3 = load_adapter("sd3-5", tiny_sd3_path)  # SD3's transformer declares no repeated blocks
    with pytest.raises(ValueError, match="model.torch_compile: regional .*SD3Transformer2DModel declares none"):
        sd3.compile_transformers("regional", backend="eager")
    assert sd3.compile_transformers("auto", backend="eager") == {"transformer": "full"}


def test_regional_on_a_model_without_repeated_blocks_is_refused_before_loading(tmp_path, tiny_sd3_path):
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    config["model"]["torch_compile"] = "regional"
    with pytest.raises(ValueError, match=r"model.torch_compile: regional .*SD3Transformer2DModel .*model_index.json"):
        Trainer(parse_config(config))


def test_flow_factory_acceleration_block_reads_as_our_keys(tmp_path, tiny_sd3_path):
    config = tiny_run_config(tmp_path, "sd3-5", tiny_sd3_path)
    config["acceleration"] = {"shared": [{"name": "attention_backend", "params": {"backend": "native"}},
                                         {"name": "torch_compile", "params": {"mode": "full",
                                                                             "compile_kwargs": {"mode": "max-autotune"}}}]}
    model = parse_config(config).model
    assert (model.attn_backend, model.torch_compile, model.compile_mode) == ("native", "full", "max-autotune")
    config["acceleration"] = {"shared": {"name": "torch_compile"}}  # one entry without the list; mode auto
    assert parse_config(config).model.torch_compile == "auto"
    # the rollout-only cache is train.rollout_cache (tests/test_rollout_cache.py), a decoupled algorithm's only
    config["acceleration"] = {"rollout": [{"name": "diffusers_cache", "params": {"policy": "first_block"}}]}
    with pytest.raises(ValueError, match="train.rollout_cache: first_block makes the rollout's steps differ"):
        parse_config(config)  # grpo
    config["acceleration"] = {"rollout": [{"name": "teacache"}]}
    with pytest.raises(ValueError, match=r"acceleration.rollout\[0\]: .*one rollout accelerator is taken here"):
        parse_config(config)
    config["acceleration"] = {"shared": [{"name": "teacache"}]}
    with pytest.raises(ValueError, match=r"acceleration.shared\[0\].name: 'teacache'; .*attention_backend and torch_compile"):
        parse_config(config)


@pytest.mark.parametrize("backend", [pytest.param("eager"), pytest.param(
    "inductor", marks=pytest.mark.skipif(not INDUCTOR, reason="about a minute on a CPU: FF_COMPILE_TESTS=1 runs it"))])
def test_on_policy_ratio_is_one_through_the_compiled_transformer(tiny_sd3_path, backend):
    adapter = load_adapter("sd3-5", tiny_sd3_path)
    apply_lora(adapter.transformer, 4, 4, "default", adapter.default_lora_targets)
    perturb_lora(adapter.transformer)
    adapter.compile_transformers("full", backend=backend)
    assert adapter.transformer._compiled_call_impl is not None
    dynamics = make_dynamics("Flow-SDE", 0.7)
    algorithm = make_algorithm("grpo", TrainConfig(kl_type="v-based"), dynamics)
    policy = AdapterPolicy(adapter, 3.0, "lora", keep_reference=False)

    cond = adapter.encode(["a red cube", "a blue ball"], None, 3.0)
    noise = adapter.initial_noise(2, 64, 64, torch.Generator().manual_seed(1))
    traj = sample_trajectory(adapter, dynamics, cond, noise, adapter.sigmas(3, 64, 64, None), 3.0,
                             generator=torch.Generator().manual_seed(2))
    assert_on_policy(algorithm, policy, traj, cond, backward=True)  # the compiled backward reaches LoRA
    grads = [p.grad for n, p in adapter.transformer.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
